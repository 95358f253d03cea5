"""The ops: the composed Gated DeltaProduct op, its decode step, and one package per stage
(``chunk_o``, ``wy``, ``chunk_h``; each with ``xla``, ``pallas_fwd`` and ``pallas_bwd``)."""
