"""Stage 2 of Gated DeltaProduct: the WY (UT) representation of each chunk on the expanded stream.

Within chunk c (first token c0, state h[c] before it), write position j of the expanded stream for
step m of token t = t(j), gamma_j = g[t(j)] (chunk-local cumulative log2 decay, stage 1), live_j =
[same(t(j), c0)]. Unrolling SPEC's recurrence inside the chunk gives, for every position j,

    v_new[j] = beta_j ( v[j] - live_j 2^gamma_j h[c]^T k[j]
                        - sum_{i < j, same(i, j)} 2^(gamma_j - gamma_i) (k[i]·k[j]) v_new[i] )

(positions of the same token share gamma, so their relative decay is 1). That is the unit lower
triangular system (I + A) v_new = beta (v - live 2^gamma K h[c]) with the strictly lower

    A[j, i] = beta_j 2^(gamma_j - gamma_i) (k[j]·k[i])   for i < j in one segment, else 0,

so, with T = (I + A)^{-1}, v_new = u - w h[c] for

    u = T (beta v)            w = T (beta live 2^gamma k).

A is block diagonal over the segments inside a chunk (the segment mask), so a segment start inside
the chunk needs nothing more: rows after it never see h[c] (live = 0) nor earlier positions.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from gdp_jax._chunking import expand, from_chunks, to_chunks

_HIGHEST = jax.lax.Precision.HIGHEST


def chunk_decays(g: Optional[jax.Array], runs: Optional[jax.Array], batch: int, tokens: int,
                 heads: int, chunk_size: int):
    """Per-chunk float32 decays [B, NT, H, BT] and int32 run numbers [B, NT, BT] (padding repeats
    the last real token: it neither decays nor starts a segment). None -> zeros."""
    g = jnp.zeros((batch, tokens, heads), jnp.float32) if g is None else g.astype(jnp.float32)
    runs = jnp.zeros((batch, tokens), jnp.int32) if runs is None else runs.astype(jnp.int32)
    return to_chunks(g, chunk_size, mode="edge"), to_chunks(runs, chunk_size, mode="edge")


def wy_xla(k, v, beta, g, runs, *, chunk_size: int, num_householder: int):
    """w [B, T*M, H, K] and u [B, T*M, H, V] in float32 (see the module docstring).

    k [B, T*M, H, K], v [B, T*M, H, V], beta [B, T*M, H]; g [B, T, H] chunk-local log2 decays or
    None; runs [B, T] int32 segment run numbers (gdp_jax.segments.segment_runs) or None.
    """
    batch, positions, heads, _ = k.shape
    m = num_householder
    tokens = positions // m
    f32 = jnp.float32
    kc = to_chunks(k.astype(f32), chunk_size, m)                          # [B, NT, H, L, K]
    vc = to_chunks(v.astype(f32), chunk_size, m)                          # [B, NT, H, L, V]
    bc = to_chunks(beta.astype(f32)[..., None], chunk_size, m)[..., 0]     # [B, NT, H, L], pad 0
    gc, rc = chunk_decays(g, runs, batch, tokens, heads, chunk_size)
    gamma = expand(gc, m, axis=3)                                         # [B, NT, H, L]
    run = expand(rc, m, axis=2)[:, :, None]                               # [B, NT, 1, L]
    length = chunk_size * m
    lower = jnp.tril(jnp.ones((length, length), bool), -1)                 # i < j, strictly
    mask = lower & (run[..., :, None] == run[..., None, :])               # [B, NT, 1, L, L]
    # Mask the exponent, not the result, so no inf (and no NaN gradient) appears above the diagonal.
    decay = jnp.where(mask, jnp.exp2(jnp.where(mask, gamma[..., :, None] - gamma[..., None, :], 0.0)), 0.0)
    gram = jnp.einsum("bnhjk,bnhik->bnhji", kc, kc, precision=_HIGHEST)
    a = bc[..., :, None] * decay * gram                                   # strictly lower
    live = (run == run[..., :1]).astype(f32)                              # same segment as c0
    rhs_w = (bc * live * jnp.exp2(gamma))[..., None] * kc
    rhs_u = bc[..., None] * vc
    solve = lambda rhs: jax.lax.linalg.triangular_solve(
        a, rhs, left_side=True, lower=True, unit_diagonal=True)           # (I + A)^{-1} rhs
    w, u = solve(rhs_w), solve(rhs_u)
    return from_chunks(w, positions), from_chunks(u, positions)
