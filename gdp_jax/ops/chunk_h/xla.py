"""Stage 3 of Gated DeltaProduct in jnp: walk the chunks of each row in order, carrying the state.

For chunk c (first token c0, last position of the chunk ``last``; padding repeats the last real
token's decay and run so it changes nothing), with w and u from stage 2:

    h[c]          = state carried in, zeroed if a segment starts exactly at c0 (c > 0);
                    initial_state (or zero) for c = 0
    v_new[chunk]  = u - w h[c]
    state out     = d h[c] + sum_j kd[j] v_new[j]^T, where
        d     = [same(last, c0)] 2^gamma_last                (h[c] survives only if no segment
                                                               starts after c0 in the chunk)
        kd[j] = [same(j, last)] 2^(gamma_last - gamma_j) k[j]  (only the last segment is carried)

and the final state is the state out of the last chunk: the state after each row's last token.

Gradients: ``chunk_h_xla`` is differentiated by plain autodiff (implementation="xla"). The Pallas
walk (``pallas_fwd.py``) gets its VJP from the kernels of ``pallas_bwd.py``, whose docstring
derives it.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from gdp_jax._src.layout import chunk_decays, expand, from_chunks, to_chunks
from gdp_jax._src.pallas import HIGHEST as _HIGHEST


def chunk_h_xla(k, w, u, g, runs, initial_state: Optional[jax.Array], *, chunk_size: int,
                num_householder: int):
    """(h [B, NT, H, K, V], v_new [B, T*M, H, V], final_state [B, H, K, V]), all float32.

    k [B, T*M, H, K]; w [B, T*M, H, K] and u [B, T*M, H, V] from ``wy.wy_xla``; g [B, T, H]
    chunk-local log2 decays or None; runs [B, T] int32 run numbers or None; initial_state
    [B, H, K, V] or None. A ``lax.scan`` over chunks: exact gradients by autodiff.
    """
    batch, positions, heads, key_dim = k.shape
    value_dim = u.shape[-1]
    m = num_householder
    tokens = positions // m
    f32 = jnp.float32
    kc = to_chunks(k.astype(f32), chunk_size, m)                  # [B, NT, H, L, K]
    wc = to_chunks(w.astype(f32), chunk_size, m)
    uc = to_chunks(u.astype(f32), chunk_size, m)                  # [B, NT, H, L, V]
    gc, rc = chunk_decays(g, runs, batch, tokens, heads, chunk_size)   # [B, NT, H, BT], [B, NT, BT]
    gamma = expand(gc, m, axis=3)                                 # [B, NT, H, L]
    run = expand(rc, m, axis=2)[:, :, None]                       # [B, NT, 1, L]
    carried = (run == run[..., -1:]).astype(f32)                   # same segment as the last position
    survives = (run[..., 0] == run[..., -1]).astype(f32)           # [B, NT, 1]: no start after c0
    d = survives * jnp.exp2(gamma[..., -1])                       # [B, NT, H]
    kd = (carried * jnp.exp2(gamma[..., -1:] - gamma))[..., None] * kc
    # A segment starting exactly at c0 (c > 0) zeroes the state carried in.
    reset = jnp.concatenate([jnp.zeros((batch, 1), bool), rc[:, 1:, 0] != rc[:, :-1, -1]], axis=1)

    state0 = (jnp.zeros((batch, heads, key_dim, value_dim), f32) if initial_state is None
              else initial_state.astype(f32))
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (wc, uc, kd, d, reset))

    def step(state, x):
        w_c, u_c, kd_c, d_c, reset_c = x
        state = jnp.where(reset_c[:, None, None, None], 0.0, state)
        v_new = u_c - jnp.einsum("bhlk,bhkv->bhlv", w_c, state, precision=_HIGHEST)
        out = d_c[..., None, None] * state + jnp.einsum("bhlk,bhlv->bhkv", kd_c, v_new,
                                                        precision=_HIGHEST)
        return out, (state, v_new)

    final_state, (h, v_new) = jax.lax.scan(step, state0, xs)
    return jnp.moveaxis(h, 0, 1), from_chunks(jnp.moveaxis(v_new, 0, 1), positions), final_state
