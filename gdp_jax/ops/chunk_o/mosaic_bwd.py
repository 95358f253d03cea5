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

Past K, V = 128 the h and dh tiles outgrow SMEM (193 KiB at K = V = 128 already; h alone is
128 KiB at K = V = 256). The key-tiled form keeps one program per (batch, chunk, head) and splits
the state's sums by key tile instead:

    copies, over whole rows:   per copy m: S_m, dA_m (kept in SMEM), dv_m, dk_m, the Z sums
    then do's tile becomes wdo = scale w ⊙ do, and per key tile kb (64 keys):
        dq[kb] = sum_m dA_m @ k_m[:, kb] + wdo @ h[kb]^T             [BT, 64]
        dh[kb] = q[:, kb]^T @ wdo                                       [64, V]
        dg_row += rowsum(q[:, kb] ⊙ (wdo @ h[kb]^T))                   the state's share

h[kb] and k_m[:, kb] load into the SMEM the k and v tiles held (k_m again, from L2), so no tile
is larger than [64, 256] and each input comes from HBM once: 216 KiB of SMEM at K = V = 256,
M = 3, with S_m aliased to dk_m's tile. It replaced a two-kernel split that wrote dA_m out and
read q, k and do twice, which capped it at about 75 % of the floor (RESULTS.md, "The key-tiled
Mosaic backward"). In every grid the head is the second-fastest axis, so the programs in flight
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
    key_tiled: bool          # the key-tiled form (module docstring) instead of whole h tiles
    slots: int = 1           # the whole-tile form's SMEM slots for the copies' k and v

    def check(self, key_dim: int, value_dim: int, num_householder: int) -> None:
        """Raises ValueError if the form does not fit a [K, V] problem of M copies."""
        if not self.key_tiled and max(key_dim, value_dim) > ONE_KERNEL_WIDTH:
            raise ValueError(f"whole h tiles take K, V up to {ONE_KERNEL_WIDTH}; got "
                             f"K = {key_dim}, V = {value_dim}")
        if not 1 <= self.slots <= max(num_householder, 1):
            raise ValueError(f"slots must be in [1, M = {num_householder}]; got {self.slots}")
        if self.key_tiled and self.slots != 1:
            raise ValueError(f"slots are the whole-tile form's; the key-tiled one takes 1, got "
                             f"{self.slots}")


def default_block_sizes(key_dim: int, value_dim: int, num_householder: int) -> BlockSizes:
    """SMEM decides:

    | shape class | choice | why |
    |---|---|---|
    | K, V <= 64, M >= 2 | whole tiles, two k / v slots | 104 KiB, still two programs per SM; 0.989-0.993x the time of one slot (RESULTS.md, "Read-only store waits; k / v slots") |
    | K, V <= 128 | whole tiles, one k / v slot | 193 KiB at K = V = 128, each input read once (RESULTS.md, "chunk_gdp_fwd_o on Mosaic GPU"); a second slot needs 229 KiB |
    | K or V > 128 | key-tiled | whole h and dh tiles alone are 256 KiB at K = V = 256 |
    """
    if max(key_dim, value_dim) > ONE_KERNEL_WIDTH:
        return BlockSizes(key_tiled=True)
    two_slots = max(key_dim, value_dim) <= TILE and num_householder >= 2
    return BlockSizes(key_tiled=False, slots=2 if two_slots else 1)


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


def _key_tiled_kernel(*refs, scale: float, tokens: int, num_householder: int, heads: int,
                      has_g: bool, has_segments: bool, interpret: bool, scratch):
    """The backward past K, V = 128 (module docstring): the copies' sums over whole rows, then
    dh and dq one key tile at a time."""
    m, bt = num_householder, CHUNK_SIZE
    q_g, k_g, v_g, h_g, do_g = refs[:5]
    g_g = refs[5] if has_g else None
    sr_g = refs[5 + has_g] if has_segments else None
    dq_g, dk_g, dv_g, dh_g, dg_g = refs[-5:]
    (q_s, do_s, ((k_s, v_s), (h_s, kt_s)), da_s, (dk_s, s_s), dv_s, g_s, sr_s, dg_s,
     in_bar, kv_bar, h_bar, kt_bar) = scratch
    hd, c, b = (lax.axis_index(n) for n in ("head", "chunk", "batch"))
    rows = pl.ds(c * bt, bt)
    key_tiles = q_s.shape[1] // TILE
    keys = lambda kb: pl.ds(kb * TILE, TILE)
    h_at = chunk_state_index(len(h_g.shape), b, c, hd)        # h or its sub-chunk view

    g_copies = _copy_chunk_rows(q_g, do_g, g_g, sr_g, q_s, do_s, g_s, sr_s, in_bar, b, hd, rows)

    def load_kv(copy):
        plgpu.copy_gmem_to_smem(k_g.at[b, rows, copy * heads + hd], k_s, kv_bar.at[0])
        plgpu.copy_gmem_to_smem(v_g.at[b, rows, copy * heads + hd], v_s, kv_bar.at[1])

    # Key tile kb's h[kb] and k_m[:, kb] go where the k and v tiles were.
    def load_h(kb):
        plgpu.copy_gmem_to_smem(h_g.at[h_at + (keys(kb),)], h_s, h_bar.at[0])

    def load_k_tiles(kb):
        for copy in range(m):
            plgpu.copy_gmem_to_smem(k_g.at[b, rows, copy * heads + hd, keys(kb)], kt_s.at[copy],
                                    kt_bar.at[copy])
    load_kv(0)

    w, weigh, below_diagonal = _pair_terms(tokens - c * bt, g_copies,
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
        else:                                       # the k / v tiles' SMEM is free
            load_k_tiles(0)
            load_h(0)
        d_score = weigh(scale * dpv)                                         # dA_m
        if has_g:
            dg_row, dg_col = _add_z_sums(dg_row, dg_col, score * (scale * dpv), below_diagonal)
        mg.wait_stores_read()            # the previous copy's dk, dv have left
        s_s[...] = score.astype(s_s.dtype)
        da_s.at[copy][...] = d_score.astype(da_s.dtype)
        plgpu.commit_smem()
        _store_dv_dk(s_s, da_s.at[copy], q_s, do_s, dv_s, dk_s,
                     dv_g.at[b, rows, copy * heads + hd], dk_g.at[b, rows, copy * heads + hd],
                     scale, interpret)

    # do's last reader (dv_m's product) waited: its tile now holds scale w ⊙ do, which both
    # state products read: dq[kb] = (scale w ⊙ do) @ h[kb]^T + ..., dh[kb] = q[:, kb]^T @ (...).
    row_scale = scale if w.row_weight is None else scale * w.row_weight
    do = mg.tile(do_s, interpret).astype(jnp.float32)
    do_s[...] = (do * (row_scale if w.row_weight is None
                       else mg.broadcast_rows(row_scale, do.shape))).astype(do_s.dtype)
    plgpu.commit_smem()
    # Each tile's loads go out as soon as the last product that reads its SMEM is waited, so
    # that they overlap this key tile's remaining products and stores.
    for kb in range(key_tiles):
        q_kb = q_s.at[:, keys(kb)]

        def copies(mma):
            for copy in range(m):
                plgpu.barrier_wait(kt_bar.at[copy])
                mma(da_s.at[copy], kt_s.at[copy])
        dq = mg.accumulate((bt, TILE), copies, interpret)                   # sum_m dA_m k_m[kb]
        if kb + 1 < key_tiles:
            load_k_tiles(kb + 1)
        plgpu.barrier_wait(h_bar.at[0])
        dq_state = mg.dot_nt(do_s, h_s, interpret)                          # [BT, 64]
        if kb + 1 < key_tiles:
            load_h(kb + 1)
        dq = dq + dq_state
        if has_g:                        # dg_row's state share, this key tile's part
            q = mg.tile(q_kb, interpret).astype(jnp.float32)
            dg_row = dg_row + jnp.sum(q * dq_state, axis=1)
        dh = mg.dot_tn(q_kb, do_s, interpret)                               # dh[kb] [64, V]
        mg.wait_stores_read()            # the previous tile's dh, dq (or dk, dv) have left
        dv_s[...] = dh.astype(dv_s.dtype)
        s_s[...] = dq.astype(s_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dv_s, dh_g.at[b, c, hd, keys(kb)])
        plgpu.copy_smem_to_gmem(s_s, dq_g.at[b, rows, hd, keys(kb)])
    if has_g:
        _store_dg_parts(dg_s, dg_g, LN2 * dg_row, LN2 * dg_col, b, hd, rows)
    mg.wait_stores_read()


def _key_tiled(q, k, v, h, g, runs, do, *, scale, tokens, m, interpret):
    """The backward past K, V = 128 (module docstring) on ``stream_operands``' padded inputs."""
    batch, padded_tokens, heads, key_dim = q.shape
    value_dim, num_chunks, bt = v.shape[-1], h.shape[1], CHUNK_SIZE
    dtype = q.dtype
    tiles = mg.tile_transforms(dtype)
    smem = lambda *shape: plgpu.SMEM(shape, dtype, transforms=tiles)
    copy_tiles = (smem(bt, key_dim), smem(bt, value_dim))                    # k_m, v_m
    key_tile = (smem(TILE, value_dim), smem(m, bt, TILE))                    # h[kb], k_m[:, kb]
    scratch = (
        smem(bt, key_dim), smem(bt, value_dim),                              # q, do
        mg.aliased(copy_tiles, key_tile, interpret=interpret),
        smem(m, bt, bt),                                                     # dA_m
        # S_m is read (dv_m's product) before dk_m is written; then dq[kb]
        mg.aliased(smem(bt, key_dim), smem(bt, bt), interpret=interpret),    # dk_m, S_m
        smem(bt, value_dim),                                                 # dv_m, then dh[kb]
        plgpu.SMEM((2, bt), jnp.float32), plgpu.SMEM((bt,), jnp.int32),     # g x2, starts
        plgpu.SMEM((2, bt), jnp.float32),                                    # dg parts
        plgpu.Barrier(num_arrivals=1, num_barriers=5),                   # q, do, g x2, starts
        plgpu.Barrier(num_arrivals=1, num_barriers=2),                           # k, v
        plgpu.Barrier(num_arrivals=1, num_barriers=1),                           # h[kb]
        plgpu.Barrier(num_arrivals=1, num_barriers=m),                           # k_m[:, kb]
    )
    out_type = (
        jax.ShapeDtypeStruct((batch, padded_tokens, heads, key_dim), q.dtype),
        jax.ShapeDtypeStruct((batch, padded_tokens, m * heads, key_dim), k.dtype),
        jax.ShapeDtypeStruct((batch, padded_tokens, m * heads, value_dim), v.dtype),
        jax.ShapeDtypeStruct(compact_state_shape(h), h.dtype),
        jax.ShapeDtypeStruct((2, batch, heads, padded_tokens), jnp.float32),
    )
    grid, grid_names = mg.chunk_grid(batch, num_chunks, heads)
    call = mg.kernel(_key_tiled_kernel, out_type=out_type, scratch_types=scratch, grid=grid,
                     grid_names=grid_names, interpret=interpret, scale=scale, tokens=tokens,
                     num_householder=m, heads=heads, has_g=g is not None,
                     has_segments=runs is not None)
    dq, dk, dv, dh, dg_parts = call(q, k, v, h, do, *(x for x in (g, runs) if x is not None))
    dg = None if g is None else jnp.moveaxis(dg_parts[0] - dg_parts[1], 1, 2)   # [B, Tp, H]
    return dq, dk, dv, dh, dg


def _one_kernel(q, k, v, h, g, runs, do, q_factor, *, scale, tokens, m, slots, interpret):
    """The whole-tile backward (K, V up to ONE_KERNEL_WIDTH) on ``stream_operands``' inputs;
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

    ``q_factor`` (whole tiles only): [B, T, H] float32 l2norm factors r_t = (|x_t|^2 + eps)^(-1/2)
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
        if sizes.key_tiled:
            raise ValueError("q_factor needs the whole-tile backward (K, V up to "
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
    dq, dk, dv, dh, dg = (_key_tiled(*args, **kw) if sizes.key_tiled
                          else _one_kernel(*args, q_factor, slots=sizes.slots, **kw))
    dk = dk.reshape(batch, padded_tokens * m, heads, key_dim)
    dv = dv.reshape(batch, padded_tokens * m, heads, value_dim)
    return (dq[:, :tokens], dk[:, :tokens * m], dv[:, :tokens * m], dh,
            None if dg is None else dg[:, :tokens])
