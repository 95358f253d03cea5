"""Stage 3: the state walk over the chunks of each row, h at every chunk boundary and v_new.

``xla`` (a ``lax.scan``, its docstring states the walk), ``pallas_fwd`` (the walk kernel) and
``pallas_bwd`` (the reverse walk and its chunk-parallel epilogue, with the VJP's derivation).
"""
from gdp_jax.ops.chunk_h.pallas_bwd import chunk_h_bwd_pallas
from gdp_jax.ops.chunk_h.pallas_fwd import chunk_h_pallas
from gdp_jax.ops.chunk_h.xla import chunk_h_xla

__all__ = ["chunk_h_bwd_pallas", "chunk_h_pallas", "chunk_h_xla"]
