"""Pallas kernel (Mosaic GPU lowering): the forward of chunk_gdp_fwd_o.

The same sum as ``pallas_fwd`` (SPEC's chunked form), one program per (batch, chunk, head, value
block) tile, one warpgroup each. Pallas' Mosaic GPU grid runs row-major (its last axis fastest).
The value block is the last axis, so the value programs of one chunk run side by side and only
the first reads q and k from HBM, the others from L2 (RESULTS.md, "The Mosaic grids' fastest
axis"). The head comes next, so the programs in flight read and write whole token rows across
heads rather than one head's 128-512 bytes of many rows: 0.92x the time at K = 64, 0.96-0.97x
elsewhere (RESULTS.md, "The Mosaic grids' head axis").

    o[t] = scale * ( [same(t, c0)] 2^g[t] q[t]·h[c]
                     + sum_{s in [c0, t], same(s, t)} sum_{m < M} 2^(g[t]-g[s])
                                                      (q[t]·k[sM+m]) v[sM+m] )

Data movement is explicit: TMA copies bring the q tile, g, the segment start rows, the [K, BV]
state tile and each Householder copy's k and v tiles into swizzled SMEM, each on its own barrier;
with S slots (``BlockSizes.slots``) copy m+S's k loads into copy m's slot once copy m's scores
are made, its v once copy m's product with v is.
Per copy, wgmma makes the scores q k_m^T (k_m as a transposed SMEM view), the registers weigh them
(causal and segment masks, decays), the weighted tile goes back to SMEM as the left operand of the
wgmma that adds it times v_m into the output accumulator. The state term q·h is a second
accumulator, weighted per row. The output tile leaves through a v slot by a TMA store.

Operands in the layout TMA reads without gathers: the M copies of k and v come from the caller's
[B, T*M, H, *] arrays viewed as [B, T, M*H, *] (copy m of head h is "head" m*H + h, a free
reshape); g goes to [B, H, T] so that a chunk's decays are one contiguous 256-byte row.

Supported here (``dispatch.mosaic_supported``; ``dispatch.chunk_o_implementation`` routes
everything else to the Triton kernel): 16-bit q, k, v and h of one dtype, chunk_size 64 (the
wgmma tile's 64 rows), K and V padded to multiples of 64 (the 128-byte swizzle of 16-bit tiles)
up to 256.
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
from gdp_jax._src.dispatch import KERNEL_MAX_WIDTH as MAX_WIDTH
from gdp_jax._src.dispatch import MOSAIC_CHUNK_SIZE as CHUNK_SIZE
from gdp_jax._src.dispatch import MOSAIC_TILE as TILE
from gdp_jax._src.layout import chunk_state_index
from gdp_jax._src.segments import segment_start_rows


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Launch parameters; ``default_block_sizes`` picks them per shape."""
    block_v: int             # value columns of one program's h / v / o tiles
    slots: int = 2           # SMEM slots for the Householder copies' k and v tiles
    # h's tile shares SMEM with the k and v slots (it loads once the last copy is read): less
    # SMEM per program, so more programs per SM, for a serial chain within each.
    h_in_copy_slots: bool = False

    def check(self, key_dim: int, value_dim: int, num_householder: int) -> None:
        """Raises ValueError if these sizes do not tile a [K, V] problem."""
        if self.block_v % TILE or value_dim % self.block_v:
            raise ValueError(f"block_v must be a multiple of {TILE} dividing V = {value_dim}; "
                             f"got {self.block_v}")
        if not 1 <= self.slots <= max(num_householder, 1):
            raise ValueError(f"slots must be in [1, M = {num_householder}]; got {self.slots}")
        if key_dim % TILE or key_dim > MAX_WIDTH:
            raise ValueError(f"K must be a multiple of {TILE} up to {MAX_WIDTH}; got {key_dim}")


def default_block_sizes(key_dim: int, value_dim: int, num_householder: int) -> BlockSizes:
    """Programs per SM decide: SMEM (227 KiB on an H200) holds 16-bit tiles of q, the k and v
    slots, h and one score tile; o leaves through a v slot. Measured in RESULTS.md ("chunk_gdp_fwd_o
    on Mosaic GPU").

    | shape class | choice | why |
    |---|---|---|
    | K <= 128 | 128-wide value programs (64 where V is not a multiple of 128); one k/v slot | 88 KiB at K = V = 128: two programs per SM; two slots (120 KiB) leave one, 1.1-1.3x slower |
    | K > 128 | the same widths; one k/v slot, h in the slots (``h_in_copy_slots``) | 106 KiB at K = V = 256: two programs per SM, 0.986-0.994x the time of two slots without h in them (202 KiB, one per SM), RESULTS.md "The Mosaic grids' fastest axis"; 64-wide programs would read q and k twice as often |
    """
    block_v = 128 if value_dim % 128 == 0 else TILE       # V = 192: three 64-wide programs
    if key_dim <= 128:
        return BlockSizes(block_v=block_v, slots=1)
    return BlockSizes(block_v=block_v, slots=1, h_in_copy_slots=True)


@dataclasses.dataclass(frozen=True)
class ChunkWeights:
    """One chunk's masks and decay weights (``pallas.chunk_weights``' rule), in the wgmma
    accumulator's layout. pair_mask [BT, BT] bool = [s <= t, same(s, t), t real]; pair_weight
    [BT, BT] f32 = pair_mask 2^(g[t] - g[s]), None without g; row_weight [BT] f32 =
    [same(t, c0)] 2^g[t] (row layout), None when all ones; ids: the (t, s) index tiles."""
    pair_mask: jax.Array
    pair_weight: Optional[jax.Array]
    row_weight: Optional[jax.Array]
    ids: tuple


def chunk_weights(rows_left, g_s, g_barriers, start_row_s, starts_barrier,
                  interpret: bool) -> ChunkWeights:
    """The weights of the chunk whose g and segment start rows are being copied into SMEM (each
    None when absent) on the given barriers; ``rows_left`` = T - c0, its real rows (the last
    chunk may be partial). ``g_s`` is two copies of the chunk's g: one read per row, one per
    column. Mosaic GPU's layout inference finds no solution where one SMEM ref is loaded in both
    layouts."""
    pair = (CHUNK_SIZE, CHUNK_SIZE)
    t_ids, s_ids = mg.iota(pair, 0, interpret), mg.iota(pair, 1, interpret)
    pair_mask = (s_ids <= t_ids) & (t_ids < rows_left)
    row_weight = None
    if start_row_s is not None:
        plgpu.barrier_wait(starts_barrier)
        start_row = mg.row_vector(start_row_s, interpret)
        pair_mask &= s_ids >= mg.broadcast_rows(start_row, pair)
        row_weight = jnp.where(start_row == 0, 1.0, 0.0)
    pair_weight = None
    if g_s is not None:
        for barrier in g_barriers:
            plgpu.barrier_wait(barrier)
        g_row, g_col = mg.row_vector(g_s[0], interpret), mg.column_vector(g_s[1], interpret)
        exponent = mg.broadcast_rows(g_row, pair) - mg.broadcast_columns(g_col, pair)
        # Outside the mask the exponent may overflow; the select drops it before any product.
        pair_weight = jnp.where(pair_mask, jnp.exp2(exponent), 0.0)
        row_weight = jnp.exp2(g_row) if row_weight is None else row_weight * jnp.exp2(g_row)
    return ChunkWeights(pair_mask, pair_weight, row_weight, (t_ids, s_ids))


def stream_operands(q, k, v, h, g, runs, *value_width, num_householder: int, chunk_size: int):
    """The kernels' operands: q, k and v viewed as [B, Tp, M*H, *] (copy m of head h is "head"
    m*H + h), h as given, the ``value_width`` [B, T, H, V] arrays, g as [B, H, Tp] float32 and the
    segment start rows [B, Tp] (those two only when given), Tp = T padded to whole chunks (a copy
    only where T is ragged)."""
    batch, tokens, heads, key_dim = q.shape
    value_dim, m = v.shape[-1], num_householder
    padded_tokens = h.shape[1] * chunk_size
    pad = padded_tokens - tokens

    def pad_tokens(x, per_token=1):
        if not pad:
            return x
        return jnp.pad(x, [(0, 0), (0, pad * per_token)] + [(0, 0)] * (x.ndim - 2))

    operands = [pad_tokens(q),
                pad_tokens(k, m).reshape(batch, padded_tokens, m * heads, key_dim),
                pad_tokens(v, m).reshape(batch, padded_tokens, m * heads, value_dim), h,
                *(pad_tokens(x) for x in value_width)]
    if g is not None:
        operands.append(jnp.moveaxis(pad_tokens(g.astype(jnp.float32)), 1, 2))
    if runs is not None:
        operands.append(pad_tokens(segment_start_rows(runs, chunk_size)))
    return operands


def _kernel(*refs, scale: float, tokens: int, num_householder: int, heads: int,
            has_g: bool, has_segments: bool, sizes: BlockSizes, interpret: bool, scratch):
    m, bt, slots, bv = num_householder, CHUNK_SIZE, sizes.slots, sizes.block_v
    q_g, k_g, v_g, h_g = refs[:4]
    g_g = refs[4] if has_g else None
    sr_g = refs[4 + has_g] if has_segments else None
    o_g = refs[-1]
    (q_s, (h_s, (k_s, v_s)), s_s, g_s, sr_s, in_bar, k_bar, v_bar) = scratch  # g_s: [2, BT]
    h_late = sizes.h_in_copy_slots
    vb, hd, c, b = (lax.axis_index(n) for n in ("value", "head", "chunk", "batch"))
    rows = pl.ds(c * bt, bt)
    cols = pl.ds(vb * bv, bv)

    # Copy m's k and v tiles go to slot m % slots.
    def load_k(copy):
        slot = copy % slots
        plgpu.copy_gmem_to_smem(k_g.at[b, rows, copy * heads + hd], k_s.at[slot], k_bar.at[slot])

    def load_v(copy):
        slot = copy % slots
        plgpu.copy_gmem_to_smem(v_g.at[b, rows, copy * heads + hd, cols], v_s.at[slot],
                                v_bar.at[slot])

    def load_h():
        h_at = chunk_state_index(len(h_g.shape), b, c, hd)     # h or its sub-chunk view
        plgpu.copy_gmem_to_smem(h_g.at[h_at + (slice(None), cols)], h_s, in_bar.at[1])

    plgpu.copy_gmem_to_smem(q_g.at[b, rows, hd], q_s, in_bar.at[0])
    for copy in range(slots):
        load_k(copy)
        load_v(copy)
    if not h_late:
        load_h()
    g_copies = (g_s.at[0], g_s.at[1]) if has_g else None
    if has_g:
        for i, g_copy in enumerate(g_copies):
            plgpu.copy_gmem_to_smem(g_g.at[b, hd, rows], g_copy, in_bar.at[2 + i])
    if has_segments:
        plgpu.copy_gmem_to_smem(sr_g.at[b, rows], sr_s, in_bar.at[4])

    w = chunk_weights(tokens - c * bt, g_copies, (in_bar.at[2], in_bar.at[3]),
                      sr_s if has_segments else None, in_bar.at[4], interpret)
    pair_mask, pair_weight, row_weight = w.pair_mask, w.pair_weight, w.row_weight

    plgpu.barrier_wait(in_bar.at[0])

    def copies(mma):                          # sum_m (P ⊙ q k_m^T) @ v_m in one accumulator
        for copy in range(m):
            slot = copy % slots
            plgpu.barrier_wait(k_bar.at[slot])
            score = mg.dot_nt(q_s, k_s.at[slot], interpret)                 # [BT, BT] f32
            if copy + slots < m:              # k's slot is read (the product waited)
                load_k(copy + slots)
            score = score * pair_weight if has_g else jnp.where(pair_mask, score, 0.0)
            s_s[...] = score.astype(s_s.dtype)  # free: the last mma that read it waited
            plgpu.commit_smem()               # the register stores, visible to wgmma's reads
            plgpu.barrier_wait(v_bar.at[slot])
            mma(s_s, v_s.at[slot])
            if copy + slots < m:              # v's slot is read (mma waited)
                load_v(copy + slots)
    intra = mg.accumulate((bt, bv), copies, interpret)                      # [BT, BV] f32

    if h_late:                                # every k and v copy is read (the products waited)
        load_h()
    plgpu.barrier_wait(in_bar.at[1])
    state = mg.dot(q_s, h_s, interpret)                                     # [BT, BV] f32
    if row_weight is not None:
        state = state * mg.broadcast_rows(row_weight, state.shape)
    o_s = v_s.at[0]                           # every v copy (and h) is read: o leaves through slot 0
    o_s[...] = (scale * (state + intra)).astype(o_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_g.at[b, rows, hd, cols])
    mg.wait_stores_read()


def chunk_o_fwd_mosaic(q, k, v, h, g, runs, *, scale: float, chunk_size: int,
                       num_householder: int, interpret: bool = False,
                       block_sizes: Optional[BlockSizes] = None) -> jax.Array:
    """o [B, T, H, V] in v's dtype, for inputs ``dispatch.mosaic_supported`` accepts, with K and V
    already padded to multiples of 64.

    q [B, T, H, K]; k [B, T*M, H, K]; v [B, T*M, H, V] (one 16-bit dtype for q, k, v and h);
    h [B, NT, H, K, V] or its [B, NT, S, H, K, V] view (``layout.chunk_state_index``); g [B, T, H]
    float32 or None; runs [B, T] int32 run numbers or None.
    Ragged T is padded to whole chunks here (one copy of q, k, v); whole chunks copy nothing.
    """
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"the Mosaic GPU kernel takes chunk_size {CHUNK_SIZE}; got {chunk_size}")
    batch, tokens, heads, key_dim = q.shape
    value_dim, m, num_chunks = v.shape[-1], num_householder, h.shape[1]
    sizes = block_sizes or default_block_sizes(key_dim, value_dim, m)
    sizes.check(key_dim, value_dim, m)
    padded_tokens = num_chunks * chunk_size
    operands = stream_operands(q, k, v, h, g, runs, num_householder=m, chunk_size=chunk_size)

    dtype, bv, bt = q.dtype, sizes.block_v, chunk_size
    tiles = mg.tile_transforms(dtype)
    h_tile = plgpu.SMEM((key_dim, bv), dtype, transforms=tiles)
    copy_slots = (plgpu.SMEM((sizes.slots, bt, key_dim), dtype, transforms=tiles),      # k slots
                  plgpu.SMEM((sizes.slots, bt, bv), dtype, transforms=tiles))           # v slots
    scratch = (
        plgpu.SMEM((bt, key_dim), dtype, transforms=tiles),                  # q
        (mg.aliased(h_tile, copy_slots, interpret=interpret) if sizes.h_in_copy_slots
         else (h_tile, copy_slots)),
        plgpu.SMEM((bt, bt), dtype, transforms=tiles),                       # weighted scores
        plgpu.SMEM((2, bt), jnp.float32),                                    # g, twice
        plgpu.SMEM((bt,), jnp.int32),                                        # segment start rows
        plgpu.Barrier(num_arrivals=1, num_barriers=5),                       # q, h, g x2, starts
        plgpu.Barrier(num_arrivals=1, num_barriers=sizes.slots),             # k slots
        plgpu.Barrier(num_arrivals=1, num_barriers=sizes.slots),             # v slots
    )

    grid, grid_names = mg.chunk_grid(batch, num_chunks, heads, value_dim // bv, "value")
    call = mg.kernel(
        _kernel, out_type=jax.ShapeDtypeStruct((batch, padded_tokens, heads, value_dim), v.dtype),
        scratch_types=scratch, grid=grid, grid_names=grid_names, interpret=interpret, scale=scale,
        tokens=tokens, num_householder=m, heads=heads, has_g=g is not None,
        has_segments=runs is not None, sizes=sizes)
    return call(*operands)[:, :tokens]
