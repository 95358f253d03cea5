"""Stage 2 of Gated DeltaProduct in jnp: the WY (UT) representation of each chunk on the expanded stream.

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

(I + A)^{-1} is formed by block doubling with batched matmuls (``unit_lower_inverse``), not with
lax.linalg.triangular_solve: on CPU, jaxlib 0.10's LAPACK trsm splits large batches over XLA's
thread pool and then waits on it, so two solves running at once (w and u, or their VJPs) can
deadlock a 2-thread pool.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from gdp_jax._src.layout import chunk_decays, expand, from_chunks, to_chunks
from gdp_jax._src.pallas import HIGHEST as _HIGHEST, LN2 as _LN2


def wy_xla(k, v, beta, g, runs, *, chunk_size: int, num_householder: int):
    """w [B, T*M, H, K] and u [B, T*M, H, V] in float32 (see the module docstring).

    k [B, T*M, H, K], v [B, T*M, H, V], beta [B, T*M, H]; g [B, T, H] chunk-local log2 decays or
    None; runs [B, T] int32 segment run numbers (``_src.segments.segment_runs``) or None.
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
    t_inv = unit_lower_inverse(a)                                         # (I + A)^{-1}
    solve = lambda rhs: jnp.einsum("...ji,...id->...jd", t_inv, rhs, precision=_HIGHEST)
    w, u = solve(rhs_w), solve(rhs_u)
    return from_chunks(w, positions), from_chunks(u, positions)


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """(I + A)^{-1} for strictly lower triangular a [..., L, L], with batched matmuls only.

    Doubles the width s of the inverted diagonal blocks: [[X, 0], [C, Y]]^{-1} =
    [[X^{-1}, 0], [-Y^{-1} C X^{-1}, Y^{-1}]]. No LAPACK call (jaxlib 0.10's CPU trsm can deadlock
    XLA's thread pool when several run at once) and plain autodiff.
    """
    length = a.shape[-1]
    size = 1 << max(0, (length - 1).bit_length())
    if size != length:
        pad = [(0, 0)] * (a.ndim - 2) + [(0, size - length)] * 2
        a = jnp.pad(a, pad)
    batch = a.shape[:-2]
    inv = jnp.ones(batch + (size, 1, 1), a.dtype)             # inverses of the 1x1 diagonal blocks
    s = 1
    while s < size:
        n = size // (2 * s)
        blocks = a.reshape(batch + (n, 2 * s, n, 2 * s))
        diag = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)   # [..., n, 2s, 2s]
        c = diag[..., s:, :s]
        x, y = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        lower_left = -jnp.einsum("...ij,...jk,...kl->...il", y, c, x, precision=_HIGHEST)
        top = jnp.concatenate([x, jnp.zeros_like(x)], axis=-1)
        bottom = jnp.concatenate([lower_left, y], axis=-1)
        inv = jnp.concatenate([top, bottom], axis=-2)
        s *= 2
    return inv[..., 0, :length, :length]


def wy_bwd_xla(k, v, beta, g, runs, dw, du, *, chunk_size: int):
    """The VJP of ``wy_xla(k, v, beta, g, runs, chunk_size=chunk_size, num_householder=1)`` written
    out (the GPU path's WY backward on its sub-chunk grid for compiled float32 inputs; 16-bit ones
    use wy_bwd_pallas): (dk, dv, dbeta, dg or None), float32.

    With R_w = beta live 2^g k, R_u = beta v, T = (I + A)^{-1} and cotangents dw, du of w = T R_w,
    u = T R_u (d 2^x = ln2 2^x dx; the mask keeps A's structural zeros constant):

        dR   = T^T dX                                  for (X, R) = (w, R_w) and (u, R_u)
        dA   = -mask o (T^T (dw R_w^T + du R_u^T) T^T)          (dT = -T dA T)
        A    = beta_j D_ji G_ji,  D_ji = 2^(g_j - g_i) on the mask,  G = K K^T:
        dk   = dG K + dG^T K + beta live 2^g dR_w,     dG = dA o beta_j D
        dbeta_j  = sum_i dA_ji D_ji G_ji + v_j . dR_u_j + live_j 2^g_j (k_j . dR_w_j)
        dg_j     = ln2 (sum_i Z_ji - sum_i Z_ij + beta_j live_j 2^g_j (k_j . dR_w_j)),  Z = dA o A
        dv   = beta dR_u

    T is rebuilt once (``unit_lower_inverse``) and not differentiated, so this costs a handful of
    batched matmuls where autodiff of wy_xla also differentiates the block doubling.
    """
    batch, positions, heads, _ = k.shape
    f32 = jnp.float32
    einsum = lambda spec, *xs: jnp.einsum(spec, *xs, precision=_HIGHEST)
    kc = to_chunks(k.astype(f32), chunk_size)                             # [B, N, H, S, K]
    vc = to_chunks(v.astype(f32), chunk_size)                             # [B, N, H, S, V]
    bc = to_chunks(beta.astype(f32)[..., None], chunk_size)[..., 0]       # [B, N, H, S]
    gc, rc = chunk_decays(g, runs, batch, positions, heads, chunk_size)  # [B, N, H, S], [B, N, S]
    dwc, duc = to_chunks(dw.astype(f32), chunk_size), to_chunks(du.astype(f32), chunk_size)
    run = rc[:, :, None]                                                  # [B, N, 1, S]
    lower = jnp.tril(jnp.ones((chunk_size, chunk_size), bool), -1)
    mask = lower & (run[..., :, None] == run[..., None, :])
    decay = jnp.where(mask, jnp.exp2(jnp.where(mask, gc[..., :, None] - gc[..., None, :], 0.0)), 0.0)
    gram = einsum("bnhjk,bnhik->bnhji", kc, kc)
    a = bc[..., :, None] * decay * gram
    live_decay = (run == run[..., :1]).astype(f32) * jnp.exp2(gc)         # live 2^g
    scale_w = bc * live_decay
    rhs_w, rhs_u = scale_w[..., None] * kc, bc[..., None] * vc
    t_inv = unit_lower_inverse(a)
    d_rhs_w = einsum("bnhij,bnhik->bnhjk", t_inv, dwc)                   # T^T dw
    d_rhs_u = einsum("bnhij,bnhiv->bnhjv", t_inv, duc)
    outer = einsum("bnhjk,bnhik->bnhji", dwc, rhs_w) + einsum("bnhjv,bnhiv->bnhji", duc, rhs_u)
    d_a = -jnp.where(mask, einsum("bnhxj,bnhxy,bnhiy->bnhji", t_inv, outer, t_inv), 0.0)
    d_gram = d_a * bc[..., :, None] * decay
    k_dot_drw = jnp.sum(kc * d_rhs_w, axis=-1)
    dk = (einsum("bnhji,bnhik->bnhjk", d_gram, kc) + einsum("bnhij,bnhik->bnhjk", d_gram, kc)
          + scale_w[..., None] * d_rhs_w)
    dbeta = (jnp.sum(d_a * decay * gram, axis=-1) + jnp.sum(vc * d_rhs_u, axis=-1)
             + live_decay * k_dot_drw)
    dv = bc[..., None] * d_rhs_u
    flat = lambda x: from_chunks(x, positions)
    flat_row = lambda x: from_chunks(x[..., None], positions)[..., 0]
    dg = None
    if g is not None:
        z = d_a * a
        dg = _LN2 * (jnp.sum(z, axis=-1) - jnp.sum(z, axis=-2) + scale_w * k_dot_drw)
        dg = flat_row(dg)
    return flat(dk), flat(dv), flat_row(dbeta), dg
