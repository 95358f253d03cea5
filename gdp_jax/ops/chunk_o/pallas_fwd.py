"""Pallas kernel (Triton lowering): the forward of chunk_gdp_fwd_o.

One program computes one (value block, chunk, batch*head) tile of SPEC's chunked form:

    o[t] = scale * ( [same(t, c0)] * 2^g[t] * q[t]·h[c]
                     + sum_{s in [c0, t], same(s, t)} sum_{m < M} 2^(g[t]-g[s]) (q[t]·k[s*M+m]) v_new[s*M+m] )

The query tile is loaded once and reused for the carried-state term and for all M Householder
copies. With the K loop (``BlockSizes.block_k``), q·h and every copy's q·k scores accumulate over K
in block_k-wide steps, each q slice read once, so that Triton pipelines the loads with cp.async.
With ``value_step`` the K loop makes only the scores, and a second pipelined loop over value
columns makes q·h and the score·v dots.

The M copies of k and v are read straight from the caller's [B, T*M, H, *] arrays: viewed as
[B, T, M*H, *] (a free reshape), copy m of head h is "head" m*H + h, so each copy is one strided
BlockSpec over the same buffer and nothing is transposed or copied in HBM.

Segments reach the kernel as one int32 per token, the row where its segment begins within its
chunk (``segments.segment_start_rows``), so each mask is a comparison with a per-row value.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gdp_jax._src.pallas import (plgpu, apply_pair_weight, chunk_weights, index, load_rows,
                                 triton_call)
from gdp_jax._src.layout import chunk_state_index
from gdp_jax._src.segments import segment_start_rows


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Launch parameters of the forward kernel; ``default_block_sizes`` picks them per shape."""
    block_v: int                    # value columns of one h / v / o tile
    value_blocks_per_program: int   # value tiles one program loops over, reusing its q·k scores
    chunks_per_program: int = 1     # consecutive chunks one program walks, so Triton can prefetch
    num_warps: int = 4
    num_stages: int = 2
    # Without the K loop and with one value tile per program: "fused" takes q·h, then each copy's
    # score and its score·v dot in turn (one [BT, BT] score live); "scores_first" makes every
    # copy's scores first.
    copy_order: str = "scores_first"
    block_k: Optional[int] = None   # key columns per step of the pipelined K loop (None: no loop)
    value_step: Optional[int] = None  # value columns per step of the second loop (needs block_k)
    prefetch_values: bool = False   # v tiles loaded before the K loop (one value tile, no value_step)

    def check(self, key_dim: int, value_dim: int) -> None:
        """Raises ValueError if these sizes do not tile a [K, V] problem."""
        power_of_two = lambda n: n >= 16 and not n & (n - 1)
        program_width = self.block_v * self.value_blocks_per_program
        if not power_of_two(self.block_v) or value_dim % program_width:
            raise ValueError(f"block_v * value_blocks_per_program = {program_width} must divide "
                             f"V = {value_dim}, block_v a power of two >= 16")
        if self.copy_order not in ("scores_first", "fused"):
            raise ValueError(f"copy_order must be 'scores_first' or 'fused'; got {self.copy_order!r}")
        if self.block_k is not None:
            if not power_of_two(self.block_k) or key_dim % self.block_k:
                raise ValueError(f"block_k must be a power of two >= 16 dividing K = {key_dim}; "
                                 f"got {self.block_k}")
            if self.copy_order == "fused":
                raise ValueError("block_k takes copy_order='scores_first'")
        elif self.value_step is not None or self.prefetch_values:
            raise ValueError("value_step and prefetch_values need the K loop (block_k)")
        if self.value_step is not None and (not power_of_two(self.value_step)
                                            or program_width % self.value_step):
            raise ValueError(f"value_step must be a power of two >= 16 dividing the "
                             f"{program_width} value columns of a program; got {self.value_step}")
        if self.prefetch_values and (self.value_step is not None
                                     or self.value_blocks_per_program != 1):
            raise ValueError("prefetch_values needs one value tile per program and no value_step")


# The K loop, for 16-bit inputs at chunk 64 with K of 128 or 256 and M <= 3 (where it was timed):
# (K, M) -> (block_k, num_stages, value_step, prefetch_values). Why, per row: RESULTS.md,
# "chunk_o forward launch table".
_KEY_LOOP = {
    (128, 1): (64, 2, None, False),    # pipelined q, k, h loads; 64 keys a step
    (128, 2): (32, 5, None, False),    # 32 keys, 5 stages
    (128, 3): (64, 2, 64, False),      # second loop over value columns (fewer spills); 128-wide programs only
    (256, 1): (32, 4, None, False),    # 32 keys, 4 stages, two 128-wide value programs
    (256, 2): (32, 4, None, True),     # as M = 1, v tiles loaded before the K loop
    (256, 3): (32, 4, None, False),    # as M = 1
}


def default_block_sizes(key_dim: int, value_dim: int, chunk_size: int, num_householder: int,
                itemsize: int = 2) -> BlockSizes:
    """The launch table for padded (power-of-two) K and V, ``itemsize`` the widest of q's and h's
    element sizes. Rows, first match wins (RESULTS.md, "chunk_o forward launch table"):

    | shape class | choice | why |
    |---|---|---|
    | 16-bit, chunk 64, (K, M) in ``_KEY_LOOP`` | that K loop; V > 128: 128-wide value programs | without it a program waits on each load group in turn |
    | K, V <= 64, chunk <= 64 | 4 chunks per program | Triton prefetches the next chunk's tiles |
    | otherwise | all of V <= 128 in one program; wider V loops over 128-wide tiles reusing the scores | re-reading q and k per value program costs more |

    Every row: 4 warps (memory-bound; more programs per SM), heads fastest in launch order, and
    M >= 3 without the K loop takes copy_order "fused" (its scores no longer all live at once).
    """
    m = num_householder
    key_loop = _KEY_LOOP.get((key_dim, m)) if chunk_size == 64 and itemsize <= 2 else None
    if key_loop is not None:
        block_k, num_stages, value_step, prefetch_values = key_loop
        block_v = min(value_dim, 128)
        return BlockSizes(block_v=block_v, value_blocks_per_program=1, num_stages=num_stages,
                          block_k=block_k, value_step=value_step if block_v == 128 else None,
                          prefetch_values=prefetch_values)
    block_v = min(value_dim, 128)
    small = key_dim <= 64 and value_dim <= 64 and chunk_size <= 64
    return BlockSizes(block_v=block_v, value_blocks_per_program=value_dim // block_v,
                      chunks_per_program=4 if small else 1,
                      copy_order="fused" if m >= 3 else "scores_first")


def _chunk_o_kernel(q_ref, k_refs, v_refs, h_ref, g_ref, start_rows_ref, q_scale_ref,
                    k_scale_refs, o_ref, *, scale: float, chunk_size: int, tokens: int,
                    num_chunks: int, sizes: BlockSizes):
    chunks_per_program, block_v, block_k = sizes.chunks_per_program, sizes.block_v, sizes.block_k
    value_blocks_per_program, value_step = sizes.value_blocks_per_program, sizes.value_step
    first_chunk = pl.program_id(2) * chunks_per_program
    t_in_chunk = jax.lax.broadcasted_iota(jnp.int32, (chunk_size,), 0)

    def one_chunk(i, carry):
        chunk_rows = pl.ds(i * chunk_size, chunk_size)              # this chunk within the block
        row_valid = (first_chunk + i) * chunk_size + t_in_chunk < tokens   # last chunk may be partial
        load = functools.partial(load_rows, row_valid=row_valid)
        q = None if block_k else load(q_ref.at[chunk_rows])         # [BT, K], read once
        row_weight, pair_mask, pair_weight = chunk_weights(
            None if g_ref is None else load(g_ref.at[chunk_rows]),
            None if start_rows_ref is None else load(start_rows_ref.at[chunk_rows]), chunk_size)

        # Row factors of q and k (use_qk_l2norm on raw q, k): q_n·k_n = r_q r_k q·k, so the
        # scores' columns take r_k and o's rows r_q when stored.
        q_scale = None if q_scale_ref is None else load(q_scale_ref.at[chunk_rows])   # [BT]

        def weigh(score, copy):                                     # [BT, BT] f32 -> v's dtype
            if k_scale_refs is not None:
                score = score * load(k_scale_refs[copy].at[chunk_rows])[None, :]
            return apply_pair_weight(score, pair_mask, pair_weight).astype(v_refs[0].dtype)

        def copy_score(copy):
            k = load(k_refs[copy].at[chunk_rows])
            return weigh(plgpu.dot(q, k, trans_b=True), copy)                       # [BT, BT]

        def store(o, value_cols):
            o = scale * o if q_scale is None else o * (scale * q_scale)[:, None]
            plgpu.store(o_ref.at[chunk_rows, value_cols], o.astype(o_ref.dtype),
                        mask=row_valid[:, None])

        def state_dot(q_cols, state):                               # [BT, k] @ [k, BV] -> f32
            dot_dtype = jnp.promote_types(q_cols.dtype, state.dtype)
            return plgpu.dot(q_cols.astype(dot_dtype), state.astype(dot_dtype))

        def weigh_rows(o):      # the carried-state term's row weight, applied in f32
            return o if row_weight is None else o * row_weight[:, None]

        def state_term(q, value_cols):                              # [BT, BV] f32
            return weigh_rows(state_dot(q, h_ref[i, :, value_cols]))

        def load_value(v_ref, value_cols):                          # [BT, BV]
            return load(v_ref.at[chunk_rows, value_cols])

        def finish(o, scores, value_cols, values=None):
            """Adds every copy's score·v to the state term o and stores. ``values``: the v tiles
            if already loaded, else each is loaded just before its dot."""
            for copy, (score, v_ref) in enumerate(zip(scores, v_refs)):
                v = values[copy] if values is not None else load_value(v_ref, value_cols)
                o += plgpu.dot(score, v)
            store(o, value_cols)

        if block_k is not None:
            zeros = lambda n: jnp.zeros((chunk_size, n), jnp.float32)

            def key_loop(value_cols, copy_k_refs):
                """q·h[:, value_cols] (omitted where value_cols is None) and each copy's q·k^T,
                summed over K in block_k steps; Triton pipelines the loop's loads."""
                with_state = value_cols is not None

                def key_step(j, acc):
                    key_cols = pl.ds(j * block_k, block_k)
                    q_part = load(q_ref.at[chunk_rows, key_cols])                  # [BT, BK]
                    if with_state:
                        o_state = acc[0] + state_dot(q_part, h_ref[i, key_cols, value_cols])
                    scores = [score + plgpu.dot(q_part, load(k_ref.at[chunk_rows, key_cols]),
                                                trans_b=True)                        # [BT, BT]
                              for score, k_ref in zip(acc[with_state:], copy_k_refs)]
                    return (o_state, *scores) if with_state else tuple(scores)

                init = ((zeros(block_v),) if with_state else ()) + tuple(
                    zeros(chunk_size) for _ in copy_k_refs)
                return jax.lax.fori_loop(0, q_ref.shape[-1] // block_k, key_step, init)

            if value_step is not None:
                scores = [weigh(score, copy)
                          for copy, score in enumerate(key_loop(None, k_refs))]
                q = load(q_ref.at[chunk_rows])                      # [BT, K], L2-resident by now

                def value_step_body(j, carry):
                    value_cols = pl.ds(j * value_step, value_step)
                    finish(state_term(q, value_cols), scores, value_cols)
                    return carry
                jax.lax.fori_loop(0, block_v * value_blocks_per_program // value_step,
                                  value_step_body, None)
                return carry

            # One loop for the state term of value tile 0 and every copy's scores; further value
            # tiles run a state-only loop each and reuse the scores.
            value_cols = pl.ds(0, block_v)
            values = ([load_value(v_ref, value_cols) for v_ref in v_refs]
                      if sizes.prefetch_values else None)
            o_state, *scores = key_loop(value_cols, k_refs)
            scores = [weigh(score, copy) for copy, score in enumerate(scores)]
            finish(weigh_rows(o_state), scores, value_cols, values)
            for j in range(1, value_blocks_per_program):
                value_cols = pl.ds(j * block_v, block_v)
                (o_state,) = key_loop(value_cols, [])
                finish(weigh_rows(o_state), scores, value_cols)
            return carry

        if sizes.copy_order == "fused" and value_blocks_per_program == 1:
            value_cols = pl.ds(0, block_v)
            o = state_term(q, value_cols)
            for copy, v_ref in enumerate(v_refs):                   # one score live at a time
                o += plgpu.dot(copy_score(copy), load_value(v_ref, value_cols))
            store(o, value_cols)
            return carry

        scores = [copy_score(copy) for copy in range(len(k_refs))]  # once, for every value tile
        for j in range(value_blocks_per_program):
            value_cols = pl.ds(j * block_v, block_v)
            finish(state_term(q, value_cols), scores, value_cols)
        return carry

    if chunks_per_program == 1:
        one_chunk(0, None)
    else:
        # The last program may own fewer chunks; a dynamic trip count keeps h reads in bounds.
        trip_count = index(jnp.minimum(chunks_per_program, num_chunks - first_chunk))
        jax.lax.fori_loop(0, trip_count, one_chunk, None)


def chunk_o_fwd_pallas(q, k, v, h, g, runs, *, scale: float, chunk_size: int,
                       num_householder: int, interpret: bool = False, q_scale=None, k_scale=None,
                       block_sizes: Optional[BlockSizes] = None) -> jax.Array:
    """o [B, T, H, V] in v's dtype from validated inputs; K and V powers of two >= 16.

    q [B, T, H, K]; k [B, T*M, H, K]; v [B, T*M, H, V] (one dtype for q, k, v); h [B, NT, H, K, V]
    or its [B, NT, S, H, K, V] view (``layout.chunk_state_index``);
    g [B, T, H] float32 or None; runs [B, T] int32 segment run numbers or None.
    q_scale [B, T, H] and k_scale [B, T*M, H] float32, or None: factors q and k are taken times
    (use_qk_l2norm's normalisation of raw q, k; applied to the scores and o, not to the tiles).
    ``block_sizes`` overrides the launch table (``default_block_sizes``), for tuning.
    """
    batch, tokens, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    m = num_householder
    num_chunks = h.shape[1]
    sizes = block_sizes or default_block_sizes(
        key_dim, value_dim, chunk_size, m,
        max(jnp.dtype(q.dtype).itemsize, jnp.dtype(h.dtype).itemsize))
    sizes.check(key_dim, value_dim)
    cpp = sizes.chunks_per_program
    block_t = cpp * chunk_size
    program_width = sizes.block_v * sizes.value_blocks_per_program
    # Grid (value split, head, chunk group, batch), first varying fastest: neighbouring programs
    # take neighbouring heads and read one contiguous [BT, H, K] slab of q.
    grid = (value_dim // program_width, heads, pl.cdiv(num_chunks, cpp), batch)

    def token_spec(width, copy=0, value_split=True):
        # A [cpp*BT, width] tile of a [B, T, M*H, width] array: copy `copy` of head h is "head"
        # copy*H + h. Only value-width operands follow the value split.
        return pl.BlockSpec((None, block_t, None, width),
                            lambda vb, hd, c, b: (b, c, copy * heads + hd, vb if value_split else 0))

    k_copies = k.reshape(batch, tokens, m * heads, key_dim)
    v_copies = v.reshape(batch, tokens, m * heads, value_dim)
    start_rows = None if runs is None else segment_start_rows(runs, chunk_size)
    per_token = lambda copy: pl.BlockSpec((None, block_t, None),
                                          lambda vb, hd, c, b: (b, c, copy * heads + hd))
    k_scale_copies = (None if k_scale is None
                      else (k_scale.astype(jnp.float32).reshape(batch, tokens, m * heads),) * m)
    operands = (q, (k_copies,) * m, (v_copies,) * m, h, g, start_rows,
                None if q_scale is None else q_scale.astype(jnp.float32), k_scale_copies)
    in_specs = (
        token_spec(key_dim, value_split=False),
        tuple(token_spec(key_dim, i, value_split=False) for i in range(m)),
        tuple(token_spec(program_width, i) for i in range(m)),
        pl.BlockSpec((None, cpp) + (None,) * (h.ndim - 4) + (key_dim, program_width),
                     lambda vb, hd, c, b: chunk_state_index(h.ndim, b, c, hd) + (0, vb)),
        None if g is None else pl.BlockSpec((None, block_t, None), lambda vb, hd, c, b: (b, c, hd)),
        None if runs is None else pl.BlockSpec((None, block_t), lambda vb, hd, c, b: (b, c)),
        None if q_scale is None else per_token(0),
        None if k_scale is None else tuple(per_token(i) for i in range(m)),
    )
    kernel = functools.partial(_chunk_o_kernel, scale=scale, chunk_size=chunk_size, tokens=tokens,
                               num_chunks=num_chunks, sizes=sizes)
    return triton_call(
        kernel, *operands, name="gdp_chunk_o_fwd", grid=grid, in_specs=in_specs,
        out_specs=token_spec(program_width),
        out_shape=jax.ShapeDtypeStruct((batch, tokens, heads, value_dim), v.dtype),
        num_warps=sizes.num_warps, num_stages=sizes.num_stages, interpret=interpret)
