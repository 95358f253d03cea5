"""Stage 1 of Gated DeltaProduct: cumulative log2 decays, chunk-local (docs/math.md, "Chunked form").

g[t] = log2(e) * sum of g_raw[s] for s from the start of t's chunk to t, inclusive. The sum restarts
at every chunk start (segments do not restart it), so every decay factor the later stages form,
2^(g[t] - g[s]) for s <= t in one chunk and 2^g[t], is at most 1 and never overflows.

The Pallas path's WY and walk stages work on sub-chunks of the expanded stream
(``sub_chunk_size``) and take the same sums there: ``expanded_log2_decays``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from gdp_jax._src.pallas import LOG2_E


def chunk_local_log2_cumsum(g_raw: jax.Array, chunk_size: int) -> jax.Array:
    """[B, T, H] natural-log gates -> log2(e) * cumulative sum restarted at every chunk start.

    Computed in g_raw's dtype (the float64 reference keeps float64); callers cast as they need.
    """
    batch, tokens, heads = g_raw.shape
    num_chunks = -(-tokens // chunk_size)
    padded = jnp.pad(g_raw, ((0, 0), (0, num_chunks * chunk_size - tokens), (0, 0)))
    cum = jnp.cumsum(padded.reshape(batch, num_chunks, chunk_size, heads), axis=2)
    return (LOG2_E * cum).reshape(batch, num_chunks * chunk_size, heads)[:, :tokens]


def sub_chunk_size(chunk_size: int) -> int:
    """Positions per sub-chunk of the expanded stream: it divides chunk_size * M for every M, and
    the WY system a program solves stays at most 64 x 64."""
    return min(chunk_size, 64)


def expanded_log2_decays(g_raw: jax.Array, num_householder: int, positions_padded: int,
                         sub_chunk: int) -> jax.Array:
    """[B, T, H] natural-log gates -> [B, P_pad, H] float32 sub-chunk-local cumulative log2 decays
    on the expanded stream: the gate of token t sits at its first copy t*M (it acts before the
    token's M steps), 0 at the other copies and in padding."""
    batch, tokens, heads = g_raw.shape
    m = num_householder
    gate = jnp.zeros((batch, tokens, m, heads), jnp.float32)
    gate = gate.at[:, :, 0].set(g_raw.astype(jnp.float32) * LOG2_E).reshape(batch, tokens * m, heads)
    gate = jnp.pad(gate, ((0, 0), (0, positions_padded - tokens * m), (0, 0)))
    cum = jnp.cumsum(gate.reshape(batch, positions_padded // sub_chunk, sub_chunk, heads), axis=2)
    return cum.reshape(batch, positions_padded, heads)
