"""Pallas kernel (Mosaic GPU lowering): the backward of chunk_gdp_fwd_o.

The VJP derived in ``pallas_bwd`` (same names: w the carried state's row weights, P the pair
weights, S_m = P ⊙ q k_m^T, dpv_m = do v_m^T, dA_m = scale P ⊙ dpv_m), one program per (head,
chunk, batch) on one warpgroup, every product a wgmma on SMEM tiles:

    wdo    = scale w ⊙ do                             staged in SMEM; both state products read it
    dh     = q^T @ wdo                                 [K, V]   (q read transposed)
    dg_row = scale w ⊙ rowsum(do ⊙ (q @ h))            the carried state's share of dg
    dq     = wdo @ h^T + sum_m dA_m @ k_m               one accumulator over the copies
    per copy m:  dv_m = scale S_m^T @ do,  dk_m = dA_m^T @ q      (S_m, dA_m staged in SMEM)
                 Z_m = S_m ⊙ scale dpv_m, strictly below the diagonal (the diagonal cancels)
                 dg_row += rowsum(Z_m),  dg_col += colsum(Z_m)
    dg = ln2 (dg_row - dg_col)                         summed in XLA from the two [B, H, T] parts

Operands as in ``mosaic_fwd`` (k, v, dk, dv viewed as [B, T, M*H, *]; g as [B, H, T]).
Supported (``dispatch.chunk_o_backward_implementation``): what the forward takes, with K and V
up to 128 (the kernel's SMEM tiles: 193 KiB at K = V = 128). Ragged T is padded to whole chunks
here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdp_jax._src import mosaic as mg
from gdp_jax._src.dispatch import MOSAIC_CHUNK_SIZE as CHUNK_SIZE
from gdp_jax._src.pallas import LN2
from gdp_jax.ops.chunk_o.mosaic_fwd import chunk_weights, stream_operands


def _kernel(*refs, scale: float, tokens: int, num_householder: int, heads: int, has_g: bool,
            has_segments: bool, interpret: bool, scratch):
    m, bt = num_householder, CHUNK_SIZE
    q_g, k_g, v_g, h_g, do_g = refs[:5]
    g_g = refs[5] if has_g else None
    sr_g = refs[5 + has_g] if has_segments else None
    dq_g, dk_g, dv_g, dh_g, dg_g = refs[-5:]
    (q_s, do_s, h_s, k_s, v_s, wdo_s, s_s, da_s, dh_s, dk_s, dv_s, g_s, sr_s, dg_s,
     in_bar, kv_bar) = scratch
    hd, c, b = (lax.axis_index(n) for n in ("head", "chunk", "batch"))
    rows = pl.ds(c * bt, bt)

    plgpu.copy_gmem_to_smem(q_g.at[b, rows, hd], q_s, in_bar.at[0])
    plgpu.copy_gmem_to_smem(do_g.at[b, rows, hd], do_s, in_bar.at[1])
    plgpu.copy_gmem_to_smem(h_g.at[b, c, hd], h_s, in_bar.at[2])
    g_copies = (g_s.at[0], g_s.at[1]) if has_g else None      # read per row, per column
    if has_g:
        for i, g_copy in enumerate(g_copies):
            plgpu.copy_gmem_to_smem(g_g.at[b, hd, rows], g_copy, in_bar.at[3 + i])
    if has_segments:
        plgpu.copy_gmem_to_smem(sr_g.at[b, rows], sr_s, in_bar.at[5])

    def load_k(copy):
        plgpu.copy_gmem_to_smem(k_g.at[b, rows, copy * heads + hd], k_s, kv_bar.at[0])

    def load_v(copy):
        plgpu.copy_gmem_to_smem(v_g.at[b, rows, copy * heads + hd], v_s, kv_bar.at[1])
    load_k(0)
    load_v(0)

    w = chunk_weights(tokens - c * bt, g_copies, (in_bar.at[3], in_bar.at[4]),
                      sr_s if has_segments else None, in_bar.at[5], interpret)
    pair_mask, pair_weight, row_weight = w.pair_mask, w.pair_weight, w.row_weight
    t_ids, s_ids = w.ids
    below_diagonal = pair_mask & (s_ids < t_ids)

    def weigh(x):                                   # P ⊙ x
        return x * pair_weight if has_g else jnp.where(pair_mask, x, 0.0)

    plgpu.barrier_wait(in_bar.at[0])
    plgpu.barrier_wait(in_bar.at[1])
    plgpu.barrier_wait(in_bar.at[2])
    do = mg.tile(do_s, interpret).astype(jnp.float32)                       # [BT, V]
    row_scale = scale if row_weight is None else scale * row_weight
    row_scale_tile = (row_scale if row_weight is None
                      else mg.broadcast_rows(row_scale, do.shape))
    wdo_s[...] = (do * row_scale_tile).astype(wdo_s.dtype)
    plgpu.commit_smem()

    dh_s[...] = mg.dot_tn(q_s, wdo_s, interpret).astype(dh_s.dtype)        # [K, V]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dh_s, dh_g.at[b, c, hd])

    dg_row = dg_col = None
    if has_g:
        state = mg.dot(q_s, h_s, interpret)                                 # [BT, V]
        dg_row = jnp.sum(state * do, axis=1) * row_scale

    def dq_body(mma):
        dg_row_, dg_col_ = dg_row, dg_col
        mma(wdo_s, h_s, transpose_b=True)
        for copy in range(m):
            plgpu.barrier_wait(kv_bar.at[0])
            plgpu.barrier_wait(kv_bar.at[1])
            # The next copy's k and v load as soon as their tiles are read (every product
            # waits), so each copy overlaps the products that follow the last read.
            score = weigh(mg.dot_nt(q_s, k_s, interpret))                   # S_m [BT, BT]
            dpv = mg.dot_nt(do_s, v_s, interpret)                            # [BT, BT]
            if copy + 1 < m:
                load_v(copy + 1)
            d_score = weigh(scale * dpv)                                     # dA_m
            s_s[...] = score.astype(s_s.dtype)
            da_s[...] = d_score.astype(da_s.dtype)
            plgpu.commit_smem()
            mma(da_s, k_s)
            if copy + 1 < m:
                load_k(copy + 1)
            plgpu.wait_smem_to_gmem(0)          # the previous copy's dk, dv have left SMEM
            dv_s[...] = (scale * mg.dot_tn(s_s, do_s, interpret)).astype(dv_s.dtype)
            dk_s[...] = mg.dot_tn(da_s, q_s, interpret).astype(dk_s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dv_s, dv_g.at[b, rows, copy * heads + hd])
            plgpu.copy_smem_to_gmem(dk_s, dk_g.at[b, rows, copy * heads + hd])
            if has_g:
                z = jnp.where(below_diagonal, score * (scale * dpv), 0.0)
                dg_row_ = dg_row_ + jnp.sum(z, axis=1)
                col = jnp.sum(z, axis=0)
                dg_col_ = col if dg_col_ is None else dg_col_ + col
        return dg_row_, dg_col_

    dq, (dg_row, dg_col) = mg.accumulate((bt, q_s.shape[1]), dq_body, interpret,
                                         with_aux=True)                     # dq [BT, K]
    plgpu.wait_smem_to_gmem(0)                  # dh, dk, dv have left SMEM
    dk_s[...] = dq.astype(dk_s.dtype)          # dk's tile is free: dq leaves through it
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dk_s, dq_g.at[b, rows, hd])
    if has_g:
        dg_s.at[0][...] = LN2 * dg_row
        dg_s.at[1][...] = LN2 * dg_col
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dg_s.at[0], dg_g.at[0, b, hd, rows])
        plgpu.copy_smem_to_gmem(dg_s.at[1], dg_g.at[1, b, hd, rows])
    plgpu.wait_smem_to_gmem(0)


def chunk_o_bwd_mosaic(q, k, v, h, g, runs, do, *, scale: float, chunk_size: int,
                       num_householder: int, interpret: bool = False):
    """(dq, dk, dv, dh, dg) for inputs ``dispatch.chunk_o_backward_implementation`` routes here,
    K and V padded to multiples of 64: dq, dk, dv in q's, k's, v's dtype, dh in h's, dg [B, T, H]
    float32 or None without g. Arguments as ``chunk_o_fwd_mosaic``'s, and do [B, T, H, V]."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"the Mosaic GPU kernel takes chunk_size {CHUNK_SIZE}; got {chunk_size}")
    batch, tokens, heads, key_dim = q.shape
    value_dim, m, num_chunks = v.shape[-1], num_householder, h.shape[1]
    padded_tokens = num_chunks * chunk_size
    operands = stream_operands(q, k, v, h, g, runs, do.astype(v.dtype), num_householder=m,
                               chunk_size=chunk_size)

    dtype, bt = q.dtype, chunk_size
    tiles = mg.tile_transforms(dtype)
    smem = lambda shape: plgpu.SMEM(shape, dtype, transforms=tiles)
    scratch = (
        smem((bt, key_dim)), smem((bt, value_dim)), smem((key_dim, value_dim)),     # q, do, h
        smem((bt, key_dim)), smem((bt, value_dim)),                                  # k, v
        smem((bt, value_dim)), smem((bt, bt)), smem((bt, bt)),                       # wdo, S, dA
        smem((key_dim, value_dim)), smem((bt, key_dim)), smem((bt, value_dim)),     # dh, dk, dv
        plgpu.SMEM((2, bt), jnp.float32), plgpu.SMEM((bt,), jnp.int32),             # g x2, starts
        plgpu.SMEM((2, bt), jnp.float32),                                            # dg parts
        plgpu.Barrier(num_arrivals=1, num_barriers=6),               # q, do, h, g x2, starts
        plgpu.Barrier(num_arrivals=1, num_barriers=2),                              # k, v
    )
    out_type = (
        jax.ShapeDtypeStruct((batch, padded_tokens, heads, key_dim), q.dtype),
        jax.ShapeDtypeStruct((batch, padded_tokens, m * heads, key_dim), k.dtype),
        jax.ShapeDtypeStruct((batch, padded_tokens, m * heads, value_dim), v.dtype),
        jax.ShapeDtypeStruct(h.shape, h.dtype),
        jax.ShapeDtypeStruct((2, batch, heads, padded_tokens), jnp.float32),
    )

    def body(*refs):
        n = len(refs) - len(scratch)
        return _kernel(*refs[:n], scratch=refs[n:], scale=scale, tokens=tokens,
                       num_householder=m, heads=heads, has_g=g is not None,
                       has_segments=runs is not None, interpret=interpret)

    call = mg.kernel(body, out_type=out_type, scratch_types=scratch,
                     grid=(heads, num_chunks, batch), grid_names=("head", "chunk", "batch"),
                     interpret=interpret)
    dq, dk, dv, dh, dg_parts = call(*operands)
    dk = dk.reshape(batch, padded_tokens * m, heads, key_dim)
    dv = dv.reshape(batch, padded_tokens * m, heads, value_dim)
    dg = None
    if g is not None:
        dg = jnp.moveaxis(dg_parts[0] - dg_parts[1], 1, 2)                   # [B, Tp, H]
    return (dq[:, :tokens], dk[:, :tokens * m], dv[:, :tokens * m], dh,
            None if dg is None else dg[:, :tokens])
