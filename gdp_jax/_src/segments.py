"""Segment ids (packed variable-length sequences) in the form the chunked kernels use.

A segment is a maximal run of equal ids along T (SPEC, "Segments"): a new one starts wherever
``segment_ids[t] != segment_ids[t-1]``. Kernels never compare raw ids; they compare *run numbers*,
the count of segment starts up to and including t. Run numbers are non-decreasing along T, so
``same(a, b)`` is ``run[a] == run[b]``, and ids that repeat non-adjacently are different segments.
The chunk_o kernels read a form derived from them, ``segment_start_rows``.
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


def segment_start_rows(runs: jax.Array, chunk_size: int) -> jax.Array:
    """[B, T] int32 run numbers -> [B, T] int32: the row within t's chunk where t's segment begins,
    0 if it began at or before the chunk's first row.

    The chunk_o kernels, forward and backward, read this instead of run numbers: since runs never
    decrease, same(s, t) for s <= t in one chunk is ``s >= start_row[t]``, and the segment live at
    the chunk's first token is the one with ``start_row[t] == 0``. Each mask then needs one value
    per row, where run numbers need a second, scattered load along the score columns
    (RESULTS.md, "Segments as start rows").
    """
    batch, tokens = runs.shape
    num_chunks = -(-tokens // chunk_size)
    padded = jnp.pad(runs, ((0, 0), (0, num_chunks * chunk_size - tokens)), mode="edge")
    padded = padded.reshape(batch, num_chunks, chunk_size)
    row = jnp.arange(chunk_size, dtype=jnp.int32)
    # Each chunk's row 0 counts as a start: a segment that began earlier begins at row 0 here.
    start_row = jax.lax.cummax(jnp.where(segment_starts(padded), row, 0), axis=2)
    return start_row.reshape(batch, num_chunks * chunk_size)[:, :tokens]
