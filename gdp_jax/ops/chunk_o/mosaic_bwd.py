"""Pallas kernel (Mosaic GPU lowering): the backward of chunk_gdp_fwd_o.

The VJP derived in ``pallas_bwd`` (same names: w the carried state's row weights, P the pair
weights, S_m = P ⊙ q k_m^T, dpv_m = do v_m^T, dA_m = scale P ⊙ dpv_m), one program per (batch,
chunk, head) on one warpgroup, every product a wgmma on SMEM tiles:

    wdo    = scale w ⊙ do                             staged in SMEM; both state products read it
    dh     = q^T @ wdo                                 [K, V]   (q read transposed)
    dg_row = scale w ⊙ rowsum(do ⊙ (q @ h))            the carried state's share of dg
    dq     = wdo @ h^T + sum_m dA_m @ k_m               one accumulator over the copies
    per copy m:  dv_m = scale S_m^T @ do,  dk_m = dA_m^T @ q      (S_m, dA_m staged in SMEM)
                 Z_m = S_m ⊙ scale dpv_m, strictly below the diagonal (the diagonal cancels)
                 dg_row += rowsum(Z_m),  dg_col += colsum(Z_m)
    dg = ln2 (dg_row - dg_col)                         summed in XLA from the two [B, H, T] parts
    with q_factor (q = r x, l2norm's rows):  dx = r (dq - q rowsum(q ⊙ dq)), dq being whole rows

Past K, V = 128 those tiles outgrow SMEM (193 KiB at K = V = 128), so wider problems run two
kernels that split the same sums by what they read:

    copies (batch, chunk, head):       per copy m: S_m, dA_m, dv_m, dk_m, the Z sums; dA_m stored
    state  (batch, chunk, head, key tile), 64 keys kb each:
        dq1    = do @ h[kb]^T                           [BT, 64]
        dq[kb] = scale w ⊙ dq1 + sum_m dA_m @ k_m[:, kb]
        dh[kb] = (scale w ⊙ q[:, kb])^T @ do            [64, V]  (the row weights on q, not do)
        dg_row's state share, this key tile's part: scale w ⊙ rowsum(q[:, kb] ⊙ dq1)
                                                       (= rowsum(do ⊙ (q[:, kb] @ h[kb])))

so no program holds h whole or more than one [64, V] accumulator: 208 KiB of SMEM for the copies
kernel at K = V = 256, 128 KiB for the state kernel at V = 256, M = 3. The state kernel reads q,
k and dA_m (16-bit, [BT, BT] per copy) once more than the one-kernel form would. The key tile is
the state grid's last axis, the fastest of Mosaic GPU's row-major grid: the tiles of one chunk
run side by side, so do and dA_m come from HBM once per chunk, not once per tile (RESULTS.md,
"The Mosaic grids' fastest axis"). In every grid the head comes next, so the programs in flight
read and write whole token rows across heads (``mosaic_fwd``; RESULTS.md, "The Mosaic grids'
head axis").

Operands as in ``mosaic_fwd`` (k, v, dk, dv viewed as [B, T, M*H, *]; g as [B, H, T]).
Supported (``dispatch.chunk_o_backward_implementation``): what the forward takes (K and V padded
to multiples of 64 up to 256). Ragged T is padded to whole chunks here.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdp_jax._src import mosaic as mg
from gdp_jax._src.dispatch import MOSAIC_BWD_ONE_KERNEL_WIDTH as ONE_KERNEL_WIDTH
from gdp_jax._src.dispatch import MOSAIC_CHUNK_SIZE as CHUNK_SIZE
from gdp_jax._src.dispatch import MOSAIC_TILE as TILE
from gdp_jax._src.layout import chunk_state_index, compact_state_shape
from gdp_jax._src.pallas import LN2
from gdp_jax.ops.chunk_o.mosaic_fwd import chunk_weights, stream_operands


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Launch form; ``default_block_sizes`` picks it per shape."""
    two_kernels: bool        # the copies and state kernels instead of the one kernel
    slots: int = 1           # the one kernel's SMEM slots for the Householder copies' k and v

    def check(self, key_dim: int, value_dim: int, num_householder: int) -> None:
        """Raises ValueError if the form does not fit a [K, V] problem of M copies."""
        if not self.two_kernels and max(key_dim, value_dim) > ONE_KERNEL_WIDTH:
            raise ValueError(f"one kernel takes K, V up to {ONE_KERNEL_WIDTH}; got K = {key_dim}, "
                             f"V = {value_dim}")
        if not 1 <= self.slots <= max(num_householder, 1):
            raise ValueError(f"slots must be in [1, M = {num_householder}]; got {self.slots}")
        if self.two_kernels and self.slots != 1:
            raise ValueError(f"slots are the one kernel's; the two kernels take 1, got {self.slots}")


def default_block_sizes(key_dim: int, value_dim: int, num_householder: int) -> BlockSizes:
    """SMEM decides:

    | shape class | choice | why |
    |---|---|---|
    | K, V <= 64, M >= 2 | one kernel, two k / v slots | 104 KiB, still two programs per SM; 0.989-0.993x the time of one slot (RESULTS.md, "Read-only store waits; k / v slots") |
    | K, V <= 128 | one kernel, one k / v slot | 193 KiB at K = V = 128, each input read once (RESULTS.md, "chunk_gdp_fwd_o on Mosaic GPU"); a second slot needs 229 KiB |
    | K or V > 128 | two kernels | one kernel's h and dh tiles alone are 256 KiB at K = V = 256 |
    """
    if max(key_dim, value_dim) > ONE_KERNEL_WIDTH:
        return BlockSizes(two_kernels=True)
    two_slots = max(key_dim, value_dim) <= TILE and num_householder >= 2
    return BlockSizes(two_kernels=False, slots=2 if two_slots else 1)


def _copy_chunk_rows(q_g, do_g, g_g, sr_g, q_s, do_s, g_s, sr_s, in_bar, b, hd, rows):
    """Starts the copies of a program's q and do rows, its g twice (read per row and per column)
    and its segment start rows, on barriers 0 (q), 1 (do), 2 and 3 (g), 4 (start rows); returns
    the two g tiles, or None without g."""
    plgpu.copy_gmem_to_smem(q_g.at[b, rows, hd], q_s, in_bar.at[0])
    plgpu.copy_gmem_to_smem(do_g.at[b, rows, hd], do_s, in_bar.at[1])
    g_copies = None
    if g_g is not None:
        g_copies = (g_s.at[0], g_s.at[1])
        for i, g_copy in enumerate(g_copies):
            plgpu.copy_gmem_to_smem(g_g.at[b, hd, rows], g_copy, in_bar.at[2 + i])
    if sr_g is not None:
        plgpu.copy_gmem_to_smem(sr_g.at[b, rows], sr_s, in_bar.at[4])
    return g_copies


def _pair_terms(rows_left, g_copies, sr_s, in_bar, interpret):
    """(chunk weights, P ⊙ x as a function of x, the pairs strictly below the diagonal) once the
    copies of ``_copy_chunk_rows`` land."""
    w = chunk_weights(rows_left, g_copies, (in_bar.at[2], in_bar.at[3]), sr_s, in_bar.at[4],
                      interpret)
    t_ids, s_ids = w.ids
    if g_copies is not None:
        weigh = lambda x: x * w.pair_weight
    else:
        weigh = lambda x: jnp.where(w.pair_mask, x, 0.0)
    return w, weigh, w.pair_mask & (s_ids < t_ids)


def _add_z_sums(dg_row, dg_col, product, below_diagonal):
    """dg_row + rowsum(Z), dg_col + colsum(Z) for Z = S_m ⊙ scale dpv_m (``product``) strictly
    below the diagonal (None: nothing summed yet)."""
    z = jnp.where(below_diagonal, product, 0.0)
    row, col = jnp.sum(z, axis=1), jnp.sum(z, axis=0)
    return (row if dg_row is None else dg_row + row), (col if dg_col is None else dg_col + col)


def _store_dv_dk(s_s, da_s, q_s, do_s, dv_s, dk_s, dv_dst, dk_dst, scale, interpret):
    """dv_m = scale S_m^T @ do and dk_m = dA_m^T @ q from the staged S_m and dA_m, each through
    its SMEM tile to ``*_dst`` (the tiles must have left from the previous copy)."""
    dv_s[...] = (scale * mg.dot_tn(s_s, do_s, interpret)).astype(dv_s.dtype)
    dk_s[...] = mg.dot_tn(da_s, q_s, interpret).astype(dk_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dv_s, dv_dst)
    plgpu.copy_smem_to_gmem(dk_s, dk_dst)


def _store_dg_parts(dg_s, dg_g, row, col, b, hd, rows):
    """A program's dg row and column parts [BT], through dg_s [2, BT], to dg_g[:, b, hd, rows]."""
    dg_s.at[0][...] = row
    dg_s.at[1][...] = col
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dg_s.at[0], dg_g.at[0, b, hd, rows])
    plgpu.copy_smem_to_gmem(dg_s.at[1], dg_g.at[1, b, hd, rows])


def _kernel(*refs, scale: float, tokens: int, num_householder: int, heads: int, has_g: bool,
            has_segments: bool, has_q_factor: bool, slots: int, interpret: bool, scratch):
    m, bt = num_householder, CHUNK_SIZE
    q_g, k_g, v_g, h_g, do_g = refs[:5]
    g_g = refs[5] if has_g else None
    sr_g = refs[5 + has_g] if has_segments else None
    qf_g = refs[5 + has_g + has_segments] if has_q_factor else None
    dq_g, dk_g, dv_g, dh_g, dg_g = refs[-5:]
    (q_s, do_s, h_s, k_s, v_s, wdo_s, s_s, da_s, dh_s, dk_s, dv_s, g_s, sr_s, dg_s,
     in_bar, kv_bar, *q_factor_scratch) = scratch
    hd, c, b = (lax.axis_index(n) for n in ("head", "chunk", "batch"))
    rows = pl.ds(c * bt, bt)

    g_copies = _copy_chunk_rows(q_g, do_g, g_g, sr_g, q_s, do_s, g_s, sr_s, in_bar, b, hd, rows)
    h_at = chunk_state_index(len(h_g.shape), b, c, hd)        # h or its sub-chunk view
    plgpu.copy_gmem_to_smem(h_g.at[h_at], h_s, in_bar.at[5])
    if has_q_factor:
        qf_s, qf_bar = q_factor_scratch
        plgpu.copy_gmem_to_smem(qf_g.at[b, hd, rows], qf_s, qf_bar.at[0])

    # Copy m's k and v tiles go to slot m % slots, on barriers slot (k) and slots + slot (v).
    def load_k(copy):
        slot = copy % slots
        plgpu.copy_gmem_to_smem(k_g.at[b, rows, copy * heads + hd], k_s.at[slot], kv_bar.at[slot])

    def load_v(copy):
        slot = copy % slots
        plgpu.copy_gmem_to_smem(v_g.at[b, rows, copy * heads + hd], v_s.at[slot],
                                kv_bar.at[slots + slot])
    for copy in range(slots):
        load_k(copy)
        load_v(copy)

    w, weigh, below_diagonal = _pair_terms(tokens - c * bt, g_copies,
                                           sr_s if has_segments else None, in_bar, interpret)
    row_weight = w.row_weight

    plgpu.barrier_wait(in_bar.at[0])
    plgpu.barrier_wait(in_bar.at[1])
    plgpu.barrier_wait(in_bar.at[5])
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
            slot = copy % slots
            k_m, v_m = k_s.at[slot], v_s.at[slot]
            plgpu.barrier_wait(kv_bar.at[slot])
            plgpu.barrier_wait(kv_bar.at[slots + slot])
            # Copy m + slots's k and v load into this slot as soon as its tiles are read (every
            # product waits), so each copy overlaps the products that follow the last read.
            score = weigh(mg.dot_nt(q_s, k_m, interpret))                   # S_m [BT, BT]
            dpv = mg.dot_nt(do_s, v_m, interpret)                            # [BT, BT]
            if copy + slots < m:
                load_v(copy + slots)
            d_score = weigh(scale * dpv)                                     # dA_m
            s_s[...] = score.astype(s_s.dtype)
            da_s[...] = d_score.astype(da_s.dtype)
            plgpu.commit_smem()
            mma(da_s, k_m)
            if copy + slots < m:
                load_k(copy + slots)
            mg.wait_stores_read()    # the previous copy's dk, dv have left SMEM
            _store_dv_dk(s_s, da_s, q_s, do_s, dv_s, dk_s, dv_g.at[b, rows, copy * heads + hd],
                         dk_g.at[b, rows, copy * heads + hd], scale, interpret)
            if has_g:
                dg_row_, dg_col_ = _add_z_sums(dg_row_, dg_col_, score * (scale * dpv),
                                               below_diagonal)
        return dg_row_, dg_col_

    dq, (dg_row, dg_col) = mg.accumulate((bt, q_s.shape[1]), dq_body, interpret,
                                         with_aux=True)                     # dq [BT, K]
    if has_q_factor:   # q = r x (l2norm): dx = r (dq - q (q·dq)), q as staged
        q = mg.tile(q_s, interpret).astype(jnp.float32)
        q_dot_dq = jnp.sum(q * dq, axis=1)
        plgpu.barrier_wait(qf_bar.at[0])
        factor = mg.row_vector(qf_s, interpret)
        dq = mg.broadcast_rows(factor, dq.shape) * (dq - q * mg.broadcast_rows(q_dot_dq, dq.shape))
    mg.wait_stores_read()            # dh, dk, dv have left SMEM
    dk_s[...] = dq.astype(dk_s.dtype)          # dk's tile is free: dq leaves through it
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dk_s, dq_g.at[b, rows, hd])
    if has_g:
        _store_dg_parts(dg_s, dg_g, LN2 * dg_row, LN2 * dg_col, b, hd, rows)
    mg.wait_stores_read()


def _copies_kernel(*refs, scale: float, tokens: int, num_householder: int, heads: int,
                   has_g: bool, has_segments: bool, interpret: bool, scratch):
    """The wide backward's per-copy sums: dk_m, dv_m, dA_m and the Z row / column sums."""
    m, bt = num_householder, CHUNK_SIZE
    q_g, k_g, v_g, do_g = refs[:4]
    g_g = refs[4] if has_g else None
    sr_g = refs[4 + has_g] if has_segments else None
    dk_g, dv_g, da_g, dg_g = refs[-4:]
    (q_s, do_s, k_s, v_s, s_s, da_s, dk_s, dv_s, g_s, sr_s, dg_s, in_bar, kv_bar) = scratch
    hd, c, b = (lax.axis_index(n) for n in ("head", "chunk", "batch"))
    rows = pl.ds(c * bt, bt)

    g_copies = _copy_chunk_rows(q_g, do_g, g_g, sr_g, q_s, do_s, g_s, sr_s, in_bar, b, hd, rows)

    def load_kv(copy):
        plgpu.copy_gmem_to_smem(k_g.at[b, rows, copy * heads + hd], k_s, kv_bar.at[0])
        plgpu.copy_gmem_to_smem(v_g.at[b, rows, copy * heads + hd], v_s, kv_bar.at[1])
    load_kv(0)

    _, weigh, below_diagonal = _pair_terms(tokens - c * bt, g_copies,
                                           sr_s if has_segments else None, in_bar, interpret)

    plgpu.barrier_wait(in_bar.at[0])
    plgpu.barrier_wait(in_bar.at[1])
    dg_row = dg_col = None
    for copy in range(m):
        plgpu.barrier_wait(kv_bar.at[0])
        plgpu.barrier_wait(kv_bar.at[1])
        score = weigh(mg.dot_nt(q_s, k_s, interpret))                       # S_m [BT, BT]
        dpv = mg.dot_nt(do_s, v_s, interpret)                                # [BT, BT]
        if copy + 1 < m:                            # neither tile is read again
            load_kv(copy + 1)
        d_score = weigh(scale * dpv)                                         # dA_m
        if has_g:
            dg_row, dg_col = _add_z_sums(dg_row, dg_col, score * (scale * dpv), below_diagonal)
        mg.wait_stores_read()            # the previous copy's dA, dk, dv have left
        s_s[...] = score.astype(s_s.dtype)
        da_s[...] = d_score.astype(da_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(da_s, da_g.at[b, rows, copy * heads + hd])
        _store_dv_dk(s_s, da_s, q_s, do_s, dv_s, dk_s, dv_g.at[b, rows, copy * heads + hd],
                     dk_g.at[b, rows, copy * heads + hd], scale, interpret)
    if has_g:
        _store_dg_parts(dg_s, dg_g, dg_row, dg_col, b, hd, rows)
    mg.wait_stores_read()


def _state_kernel(*refs, scale: float, tokens: int, num_householder: int, heads: int,
                  has_g: bool, has_segments: bool, interpret: bool, scratch):
    """The wide backward's key-tile sums: dq[kb], dh[kb] and dg_row's state share (its kb part)."""
    m, bt = num_householder, CHUNK_SIZE
    q_g, k_g, h_g, do_g, da_g = refs[:5]
    g_g = refs[5] if has_g else None
    sr_g = refs[5 + has_g] if has_segments else None
    dq_g, dh_g, dg_g = refs[-3:]
    (q_s, wq_s, do_s, h_s, k_s, da_s, g_s, sr_s, dg_s, in_bar, k_bar, da_bar) = scratch
    kb, hd, c, b = (lax.axis_index(n) for n in ("key", "head", "chunk", "batch"))
    rows, keys = pl.ds(c * bt, bt), pl.ds(kb * TILE, TILE)

    plgpu.copy_gmem_to_smem(q_g.at[b, rows, hd, keys], q_s, in_bar.at[0])
    plgpu.copy_gmem_to_smem(do_g.at[b, rows, hd], do_s, in_bar.at[1])
    h_at = chunk_state_index(len(h_g.shape), b, c, hd)        # h or its sub-chunk view
    plgpu.copy_gmem_to_smem(h_g.at[h_at + (keys,)], h_s, in_bar.at[2])
    if has_g:
        plgpu.copy_gmem_to_smem(g_g.at[b, hd, rows], g_s, in_bar.at[3])
    if has_segments:
        plgpu.copy_gmem_to_smem(sr_g.at[b, rows], sr_s, in_bar.at[4])
    for copy in range(m):
        plgpu.copy_gmem_to_smem(k_g.at[b, rows, copy * heads + hd, keys], k_s.at[copy],
                                k_bar.at[copy])
        plgpu.copy_gmem_to_smem(da_g.at[b, rows, copy * heads + hd], da_s.at[copy],
                                da_bar.at[copy])

    # scale w: [same(t, c0)] 2^g[t] scale per row (chunk_weights' row_weight), a [BT] row vector,
    # or the scalar scale where w is all ones.
    row_scale = scale
    if has_segments:
        plgpu.barrier_wait(in_bar.at[4])
        row_scale = jnp.where(mg.row_vector(sr_s, interpret) == 0, scale, 0.0)
    if has_g:
        plgpu.barrier_wait(in_bar.at[3])
        row_scale = row_scale * jnp.exp2(mg.row_vector(g_s, interpret))
    by_row = lambda x: x * (row_scale if isinstance(row_scale, float)
                            else mg.broadcast_rows(row_scale, x.shape))
    plgpu.barrier_wait(in_bar.at[0])
    q = mg.tile(q_s, interpret).astype(jnp.float32)                         # [BT, 64]
    wq_s[...] = by_row(q).astype(wq_s.dtype)
    plgpu.commit_smem()

    plgpu.barrier_wait(in_bar.at[1])
    plgpu.barrier_wait(in_bar.at[2])
    dq1 = mg.dot_nt(do_s, h_s, interpret)                                   # [BT, 64]
    h_s[...] = mg.dot_tn(wq_s, do_s, interpret).astype(h_s.dtype)           # dh[kb], via h's tile
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(h_s, dh_g.at[b, c, hd, keys])
    dg_part = jnp.sum(q * dq1, axis=1) * row_scale if has_g else None

    def copies(mma):
        for copy in range(m):
            plgpu.barrier_wait(k_bar.at[copy])
            plgpu.barrier_wait(da_bar.at[copy])
            mma(da_s.at[copy], k_s.at[copy])
    dq = mg.accumulate((bt, TILE), copies, interpret) + by_row(dq1)
    wq_s[...] = dq.astype(wq_s.dtype)               # wq's last reader (dh's product) waited
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(wq_s, dq_g.at[b, rows, hd, keys])
    if has_g:
        dg_s[...] = dg_part
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dg_s, dg_g.at[kb, b, hd, rows])
    mg.wait_stores_read()


def _wide(q, k, v, h, g, runs, do, *, scale, tokens, m, interpret):
    """The two-kernel backward (module docstring) on ``stream_operands``' padded inputs."""
    batch, padded_tokens, heads, key_dim = q.shape
    value_dim, num_chunks, bt = v.shape[-1], h.shape[1], CHUNK_SIZE
    has_g, has_segments = g is not None, runs is not None
    extras = [x for x in (g, runs) if x is not None]
    dtype = q.dtype
    tiles = mg.tile_transforms(dtype)
    smem = lambda *shape: plgpu.SMEM(shape, dtype, transforms=tiles)
    kwargs = dict(scale=scale, tokens=tokens, num_householder=m, heads=heads, has_g=has_g,
                  has_segments=has_segments)

    def call(kernel, scratch, out_type, grid_and_names, *operands):
        grid, grid_names = grid_and_names
        return mg.kernel(kernel, out_type=out_type, scratch_types=scratch, grid=grid,
                         grid_names=grid_names, interpret=interpret, **kwargs)(*operands)

    copies_scratch = (
        smem(bt, key_dim), smem(bt, value_dim), smem(bt, key_dim), smem(bt, value_dim),  # q do k v
        smem(bt, bt), smem(bt, bt), smem(bt, key_dim), smem(bt, value_dim),      # S, dA, dk, dv
        plgpu.SMEM((2, bt), jnp.float32), plgpu.SMEM((bt,), jnp.int32),         # g x2, starts
        plgpu.SMEM((2, bt), jnp.float32),                                        # Z sums
        plgpu.Barrier(num_arrivals=1, num_barriers=5),                 # q, do, g x2, starts
        plgpu.Barrier(num_arrivals=1, num_barriers=2),                             # k, v
    )
    dk, dv, da, dg_z = call(_copies_kernel, copies_scratch, (
        jax.ShapeDtypeStruct((batch, padded_tokens, m * heads, key_dim), k.dtype),
        jax.ShapeDtypeStruct((batch, padded_tokens, m * heads, value_dim), v.dtype),
        jax.ShapeDtypeStruct((batch, padded_tokens, m * heads, bt), dtype),       # dA_m
        jax.ShapeDtypeStruct((2, batch, heads, padded_tokens), jnp.float32),
    ), mg.chunk_grid(batch, num_chunks, heads), q, k, v, do, *extras)

    key_tiles = key_dim // TILE
    state_scratch = (
        smem(bt, TILE), smem(bt, TILE), smem(bt, value_dim), smem(TILE, value_dim),  # q, wq, do, h
        smem(m, bt, TILE), smem(m, bt, bt),                                           # k_m, dA_m
        plgpu.SMEM((bt,), jnp.float32), plgpu.SMEM((bt,), jnp.int32),               # g, starts
        plgpu.SMEM((bt,), jnp.float32),                                              # dg part
        plgpu.Barrier(num_arrivals=1, num_barriers=5),                 # q, do, h, g, starts
        plgpu.Barrier(num_arrivals=1, num_barriers=m),                             # k_m
        plgpu.Barrier(num_arrivals=1, num_barriers=m),                             # dA_m
    )
    dq, dh, dg_state = call(_state_kernel, state_scratch, (
        jax.ShapeDtypeStruct((batch, padded_tokens, heads, key_dim), dtype),
        jax.ShapeDtypeStruct(compact_state_shape(h), h.dtype),
        jax.ShapeDtypeStruct((key_tiles, batch, heads, padded_tokens), jnp.float32),
    ), mg.chunk_grid(batch, num_chunks, heads, key_tiles, "key"), q, k, h, do, da, *extras)
    dg = None
    if has_g:
        dg = jnp.moveaxis(LN2 * (jnp.sum(dg_state, axis=0) + dg_z[0] - dg_z[1]), 1, 2)
    return dq, dk, dv, dh, dg


def _one_kernel(q, k, v, h, g, runs, do, q_factor, *, scale, tokens, m, slots, interpret):
    """The one-kernel backward (K, V up to ONE_KERNEL_WIDTH) on ``stream_operands``' inputs;
    q_factor [B, H, Tp] float32 or None."""
    batch, padded_tokens, heads, key_dim = q.shape
    value_dim, num_chunks, bt = v.shape[-1], h.shape[1], CHUNK_SIZE
    dtype = q.dtype
    tiles = mg.tile_transforms(dtype)
    smem = lambda shape: plgpu.SMEM(shape, dtype, transforms=tiles)
    scratch = (
        smem((bt, key_dim)), smem((bt, value_dim)), smem((key_dim, value_dim)),     # q, do, h
        smem((slots, bt, key_dim)), smem((slots, bt, value_dim)),                    # k, v slots
        smem((bt, value_dim)), smem((bt, bt)), smem((bt, bt)),                       # wdo, S, dA
        smem((key_dim, value_dim)), smem((bt, key_dim)), smem((bt, value_dim)),     # dh, dk, dv
        plgpu.SMEM((2, bt), jnp.float32), plgpu.SMEM((bt,), jnp.int32),             # g x2, starts
        plgpu.SMEM((2, bt), jnp.float32),                                            # dg parts
        plgpu.Barrier(num_arrivals=1, num_barriers=6),               # q, do, g x2, starts, h
        plgpu.Barrier(num_arrivals=1, num_barriers=2 * slots),              # k slots, v slots
    )
    if q_factor is not None:
        scratch += (plgpu.SMEM((bt,), jnp.float32), plgpu.Barrier(num_arrivals=1, num_barriers=1))
    out_type = (
        jax.ShapeDtypeStruct((batch, padded_tokens, heads, key_dim), q.dtype),
        jax.ShapeDtypeStruct((batch, padded_tokens, m * heads, key_dim), k.dtype),
        jax.ShapeDtypeStruct((batch, padded_tokens, m * heads, value_dim), v.dtype),
        jax.ShapeDtypeStruct(compact_state_shape(h), h.dtype),
        jax.ShapeDtypeStruct((2, batch, heads, padded_tokens), jnp.float32),
    )

    grid, grid_names = mg.chunk_grid(batch, num_chunks, heads)
    call = mg.kernel(_kernel, out_type=out_type, scratch_types=scratch, grid=grid,
                     grid_names=grid_names, interpret=interpret, scale=scale, tokens=tokens,
                     num_householder=m, heads=heads, has_g=g is not None,
                     has_segments=runs is not None, has_q_factor=q_factor is not None,
                     slots=slots)
    dq, dk, dv, dh, dg_parts = call(q, k, v, h, do,
                                    *(x for x in (g, runs, q_factor) if x is not None))
    dg = None if g is None else jnp.moveaxis(dg_parts[0] - dg_parts[1], 1, 2)   # [B, Tp, H]
    return dq, dk, dv, dh, dg


def chunk_o_bwd_mosaic(q, k, v, h, g, runs, do, *, scale: float, chunk_size: int,
                       num_householder: int, interpret: bool = False,
                       block_sizes: Optional[BlockSizes] = None,
                       q_factor: Optional[jax.Array] = None):
    """(dq, dk, dv, dh, dg) for inputs ``dispatch.chunk_o_backward_implementation`` routes here,
    K and V padded to multiples of 64: dq, dk, dv in q's, k's, v's dtype, dh in h's, dg [B, T, H]
    float32 or None without g. Arguments as ``chunk_o_fwd_mosaic``'s, and do [B, T, H, V]. One
    kernel or two (module docstring): ``block_sizes``, default ``default_block_sizes``.

    ``q_factor`` (one kernel only): [B, T, H] float32 l2norm factors r_t = (|x_t|^2 + eps)^(-1/2)
    of raw queries x, q being their normalised rows r_t x_t (use_qk_l2norm): dq then comes as the
    cotangent of x, r_t (dq_t - q_t (q_t·dq_t)), from the dq tile the kernel holds whole, so that
    the normalisation's VJP costs no pass over HBM of its own."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"the Mosaic GPU kernel takes chunk_size {CHUNK_SIZE}; got {chunk_size}")
    batch, tokens, heads, key_dim = q.shape
    value_dim, m, num_chunks = v.shape[-1], num_householder, h.shape[1]
    padded_tokens = num_chunks * chunk_size
    sizes = block_sizes or default_block_sizes(key_dim, value_dim, m)
    sizes.check(key_dim, value_dim, m)
    if q_factor is not None:
        if sizes.two_kernels:
            raise ValueError("q_factor needs the one-kernel backward (K, V up to "
                             f"{ONE_KERNEL_WIDTH}), whose dq tiles are whole rows; got "
                             f"K = {key_dim}, V = {value_dim} with {sizes}")
        if q_factor.shape != (batch, tokens, heads):
            raise ValueError(f"q_factor must be [B, T, H] = {(batch, tokens, heads)}; got "
                             f"{q_factor.shape}")
        q_factor = jnp.moveaxis(jnp.pad(q_factor.astype(jnp.float32),
                                        ((0, 0), (0, padded_tokens - tokens), (0, 0))), 1, 2)
    operands = stream_operands(q, k, v, h, g, runs, do.astype(v.dtype), num_householder=m,
                               chunk_size=chunk_size)
    q_, k_, v_, h_, do_ = operands[:5]
    g_ = operands[5] if g is not None else None
    runs_ = operands[-1] if runs is not None else None
    args = (q_, k_, v_, h_, g_, runs_, do_)
    kw = dict(scale=scale, tokens=tokens, m=m, interpret=interpret)
    dq, dk, dv, dh, dg = (_wide(*args, **kw) if sizes.two_kernels
                          else _one_kernel(*args, q_factor, slots=sizes.slots, **kw))
    dk = dk.reshape(batch, padded_tokens * m, heads, key_dim)
    dv = dv.reshape(batch, padded_tokens * m, heads, value_dim)
    return (dq[:, :tokens], dk[:, :tokens * m], dv[:, :tokens * m], dh,
            None if dg is None else dg[:, :tokens])
