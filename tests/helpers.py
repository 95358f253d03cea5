"""The previous helpers' ``make_problem`` (a dict of chunk_o inputs), kept for the test files that
still import it (tests/test_context_parallel.py). New tests use ``cases.build(Case(...))``, which
this wraps: one problem builder, one float64 recurrence."""
from __future__ import annotations

import jax.numpy as jnp

from cases import Case, build, random_segment_ids, rel_err  # noqa: F401  (re-exported)


def make_problem(seed, *, batch=2, tokens=77, heads=2, key_dim=32, value_dim=16, m=2, chunk_size=16,
                 gated=True, segments=True, dtype=jnp.float32, initial_state=True, segment_ids=None):
    """Random q, k, v, beta, g_raw (+ ids) and the float64 recurrence over them: the chunk_o inputs
    q, k, v (= the recurrence's v_new), h, g, segment_ids, the reference ``o_ref`` and m,
    chunk_size."""
    case = Case(tokens, key_dim, value_dim, m, chunk_size, gated=gated,
                segments=segments or segment_ids is not None, initial_state=initial_state,
                dtype=jnp.dtype(dtype).name, batch=batch, heads=heads)
    p = build(case, seed=seed, segment_ids=segment_ids)
    return dict(q=p.q, k=p.k, v=p.v_new, h=p.h, g=p.g, segment_ids=p.segment_ids,
                o_ref=p.ref["o"], m=m, chunk_size=chunk_size)
