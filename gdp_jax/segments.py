"""Segment ids (packed variable-length sequences) in the form the chunked kernels use.

A segment is a maximal run of equal ids along T (SPEC, "Segments"): a new one starts wherever
``segment_ids[t] != segment_ids[t-1]``. Kernels never compare raw ids; they compare *run numbers*,
the count of segment starts up to and including t. Run numbers are non-decreasing along T, so
``same(a, b)`` is ``run[a] == run[b]``, and ids that repeat non-adjacently are different segments.
(The chunk_o forward kernel reads a form derived from them, ``chunk_o_pallas.segment_start_rows``.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_runs(segment_ids: jax.Array) -> jax.Array:
    """[..., T] integer ids -> [..., T] int32 run numbers, 0 for the row's first segment."""
    starts = segment_ids[..., 1:] != segment_ids[..., :-1]
    zero = jnp.zeros(segment_ids.shape[:-1] + (1,), jnp.int32)
    return jnp.concatenate([zero, jnp.cumsum(starts, axis=-1, dtype=jnp.int32)], axis=-1)


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """[..., T] -> [..., T] bool, True where a segment starts (t = 0 included)."""
    first = jnp.ones(segment_ids.shape[:-1] + (1,), bool)
    return jnp.concatenate([first, segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1)
