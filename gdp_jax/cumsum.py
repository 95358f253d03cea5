"""Stage 1 of Gated DeltaProduct: chunk-local cumulative log2 decays (SPEC, "Chunked form").

g[t] = log2(e) * sum of g_raw[s] for s from the start of t's chunk to t, inclusive. The sum restarts
at every chunk start (segments do not restart it), so every decay factor the later stages form,
2^(g[t] - g[s]) for s <= t in one chunk and 2^g[t], is at most 1 and never overflows.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LOG2_E = math.log2(math.e)


def chunk_local_log2_cumsum(g_raw: jax.Array, chunk_size: int) -> jax.Array:
    """[B, T, H] natural-log gates -> log2(e) * cumulative sum restarted at every chunk start.

    Computed in g_raw's dtype (the float64 reference keeps float64); callers cast as they need.
    """
    batch, tokens, heads = g_raw.shape
    num_chunks = -(-tokens // chunk_size)
    padded = jnp.pad(g_raw, ((0, 0), (0, num_chunks * chunk_size - tokens), (0, 0)))
    cum = jnp.cumsum(padded.reshape(batch, num_chunks, chunk_size, heads), axis=2)
    return (LOG2_E * cum).reshape(batch, num_chunks * chunk_size, heads)[:, :tokens]
