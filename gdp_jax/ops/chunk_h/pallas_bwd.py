"""Backward of stage 3 (the chunk-state walk): a Pallas kernel (Triton lowering) for the reverse
walk, then a chunk-parallel Pallas epilogue kernel. Together they are the exact VJP of
``chunk_h.xla.chunk_h_xla`` (and, with ``subchunks``, of ``chunk_h_pallas``'s sub-chunk walk).

Forward, per batch row and head (see ``chunk_h.xla``). Chunk c has L = BT*M positions j (j = t*M + m for
token t of the chunk, padded to a whole chunk), chunk-local log2 decays gamma_j = g[t(j)] (padding
repeats the last real token) and run numbers run_j:

    S_in[c]   = 0 if reset[c] else S_out[c-1]          reset[c] = c > 0 and run[c0] != run[c0 - 1];
                S_in[0] = initial_state (or 0)
    h[c]      = S_in[c]                                                          [K, V]
    v_new_c   = u_c - w_c h[c]                                                   [L, V]
    S_out[c]  = d_c h[c] + kd_c^T v_new_c                                        [K, V]
    final     = S_out[NT-1]
    with  d_c = [run_first == run_last] 2^gamma_last,
          a_j = [run_j == run_last] 2^(gamma_last - gamma_j),  kd_c[j] = a_j k_j.

Cotangents: dh[c] (of h[c]), dv_new_c (of v_new_c), dfinal (of final). Write dS_c for the cotangent
of S_out[c]. Reverse-mode through one chunk, with dS_c known:

    dvt_c      = dv_new_c + kd_c dS_c                  total cotangent of v_new_c    [L, V]
    du_c       = dvt_c                                 (v_new = u - w h)
    dw_c       = -dvt_c h[c]^T                                                       [L, K]
    dkd_c      = v_new_c dS_c^T                        (S_out = ... + kd^T v_new)    [L, K]
    dd_c       = <h[c], dS_c>                          Frobenius product (S_out = d h + ...)
    dS_in[c]   = dh[c] + d_c dS_c - w_c^T dvt_c        total cotangent of h[c]       [K, V]
    dS_{c-1}   = 0 if reset[c] else dS_in[c]           (the reset multiplies by 0)
    dS_{NT-1}  = dfinal;   dinitial_state = dS_in[0]   (reset[0] is false).

k enters only through kd, so dk_j = a_j dkd_c[j]. g enters through a_j and d_c, both powers of two
(d 2^x = ln2 2^x dx): with z_j = ln2 a_j (k_j . dkd_c[j]) and y_c = ln2 d_c dd_c,

    dgamma_j    -= z_j                       for every position j,
    dgamma_last += sum_j z_j + y_c,

and a token's dg sums its M positions. "last" is the chunk's last (padded) token; for a partial last
chunk that token is a copy of token T-1 (edge padding), so the padding's dg is added onto T-1, and
padding positions themselves contribute nothing (their k, w, u are zero). dg is the gradient with
respect to the chunk-local log2 decays this stage was given; the caller's cumsum is autodiffed.

Split. Only the dS recurrence is sequential, and it is closed per value column: dvt_c[:, vb] and
dS_in[c][:, vb] need only dS_c[:, vb] (and all of k, w). So the kernel runs one program per (value
block, head, batch row), walks the chunks in reverse (a ``lax.fori_loop``) carrying dS [K, BV] in
float32, and writes dvt (= du) and each chunk's dS_c (and dinitial_state). Everything else is a
product of per-chunk quantities that are all known after the walk, so it runs chunk-parallel in a
second kernel, one program per (head, chunk, batch row): dw = -dvt h^T and dkd = v_new dS^T sum over
the whole V, which a per-value-block program could only produce as partial sums (an extra
[V/BV, ...] output per cotangent and a reduction). h and v_new are the forward's outputs, saved as
residuals (no recomputation); the epilogue re-reads them and dS (one [B, NT, H, K, V] array,
the size of h, written once and read once). This follows flash-linear-attention, whose bwd_dhu
kernel also walks only the state and dv while dk/dw/dg come from a chunk-parallel kernel.
The trade-off: a short walk per iteration (two [BT, BK] x [BK, BV]-sized dots per copy and key
block, on the critical path) and full parallelism for the rest, for one extra h-sized round trip.

Kernel details. The state cotangent is held as a tuple of [BK, BV] float32 tiles, one per key block
(static Python loop), so no live tile is wider than [BT, BK] and [BK, BV]. The M copies of a chunk
are a real inner ``lax.fori_loop`` (dynamic index on the copy axis), not unrolled: unrolled, every
copy gets its own load/store sites whose address tensors the compiler hoists out of the chunk loop
and keeps live (more registers, spills). Dots take ``dot_dtype`` operands with float32
accumulation: float32 (TF32 on the GPU) by default, bfloat16 in the op for bfloat16 inputs
(``_src.dispatch.walk_bwd_dot_dtype``); dvt, dS and dw then pass through HBM in 16 bits too.
Chunk-end values are scalar loads (run_first, run_last and gamma_last), not reductions over the
chunk's vectors, which would put a cross-warp exchange on the walk's serial path every step. The
reset between chunk c-1 and c is applied one iteration later (when chunk c-1's runs are loaded),
comparing with chunk c's run_first carried in the loop. Rows, K and V are padded like the
forward kernel (zero k, w, dv_new, dh, dfinal; edge-padded g and runs), which changes nothing.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gdp_jax._src.layout import pad_state, stream_layout, tile_width
from gdp_jax._src.pallas import plgpu, LN2, triton_call
from gdp_jax.ops.chunk_h.pallas_fwd import (FEW_PROGRAMS, LONG_WALK_STEPS, decay_and_run_operands,
                                            value_block)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Launch parameters of the reverse walk (one program per (value block, head, batch row)) and
    its epilogue (one per (head, chunk, batch row)); ``default_block_sizes`` picks them."""
    block_k: int
    block_v: int
    num_warps: int
    num_stages: int = 1
    epilogue_warps: int = 4


# Bytes of k, w and dv one step of the reverse walk loads (a token chunk's sub-chunks) up to which
# it takes two stages: M = 2 at K = 64 (48 KiB). The next measured, M = 2 at K = 128 (80 KiB),
# ran 1.02x slower with two.
TWO_STAGE_STEP_BYTES = 2 * 64 * (2 * 64 + 64) * 2
# The same where few programs narrow the value blocks (one program an SM, each latency-bound):
# the next step's loads then overlap this one's dots at up to M = 3 from T (78 KiB a step).
FEW_PROGRAMS_TWO_STAGE_STEP_BYTES = 80 * 1024
# float32 dots there: two stages measured up to M = 3 from w (a step of 192 rows).
FEW_PROGRAMS_FLOAT32_TWO_STAGE_ROWS = 192


def default_block_sizes(key_dim: int, value_dim: int, chunk_size: int, rows_per_step: int,
                        dot_dtype=jnp.float32, walks: int = 0, steps: int = 0,
                        applies_inverse: bool = False) -> BlockSizes:
    """The launch table for K, V (padded to tile widths inside), the chunk size, the rows of k, w
    and dv one step of the reverse walk reads (chunk_size * subchunks * num_householder), the
    dots' operand dtype, the ``walks`` (B * H) of ``steps`` chunks each (0: not known, many) and
    whether the walk reads the WY stage's T [rows, chunk_size] in w's place (``inverse``).
    RESULTS.md, "Reverse state walk and its epilogue":

    | shape class | (block_k, block_v) | why |
    |---|---|---|
    | 16-bit dots, K <= 128 | (K, 64) | measured fastest of the block and warp choices |
    | the same, few programs on a long walk (``pallas_fwd.value_block``) | (K, 32 or 16) | more programs for a latency-bound walk: on B1 T65536 H16 the reverse walk at 16 columns 8.81 ms, at 32 1.06x, at 64 1.21x |
    | 16-bit dots, padded K = 256, chunk 64 | (128, 32; 16 where few programs) | reverse walk + epilogue 0.73x of (64, 16) at M = 2, 0.76x at M = 3, 0.87x at M = 1; (256, 32) level, (64, 32) 0.76x, (64, 64) 0.87x |
    | float32 dots, K <= 128 | (64, 32) | no spill in offline sm_90a builds (BK 32 spills: more load sites) |
    | float32 dots (and 16-bit at other chunks), K = 256 | (64, 16) | the widest value block without spills offline |
    | 16-bit dots, a step of at most TWO_STAGE_STEP_BYTES | 2 stages | the next step's loads overlap this one's dots: 0.72x at K = 64, M = 2; 0.89x at K = 128, M = 1 |
    | the same narrowed to few programs, a step of at most FEW_PROGRAMS_TWO_STAGE_STEP_BYTES | 2 stages | with the epilogue, from T: 0.67x on B1 T65536 H16 M = 2 (0.93x ungated), 0.64x at M = 3, 0.76x on B2 T32768 H16 |
    | float32 dots, few programs (``pallas_fwd.FEW_PROGRAMS`` on a ``LONG_WALK_STEPS`` walk), a step of at most FEW_PROGRAMS_FLOAT32_TWO_STAGE_ROWS rows | 2 stages | on B1 T65536 H16 0.78x at M = 2 and 0.87x at M = 3 for float16 inputs, 0.85x at M = 2 for float32 |
    | padded K = 256 | 1 stage | 2 stages 1.03x at M = 1 from T |
    | otherwise | 1 stage | 1.02x at K = 128, M = 2 with two (1.03x from T) |

    8 warps at chunk 128 (4 spill there offline), else 4. The walk is latency bound (one dependent
    chain of dots per chunk), so narrower value blocks, i.e. more programs, are preferred.
    """
    kp, vp = tile_width(key_dim), tile_width(value_dim)
    warps = 8 if chunk_size >= 128 else 4
    itemsize = jnp.dtype(dot_dtype).itemsize
    if itemsize == 2 and kp <= 128:
        block_k, block_v = kp, value_block(value_dim, walks, steps)
    elif itemsize == 2 and chunk_size == 64:
        block_k, block_v = 128, value_block(value_dim, walks, steps, widest=32)
    else:
        block_k, block_v = min(kp, 64), min(vp, 32 if kp <= 128 else 16)
    first_width = chunk_size if applies_inverse else kp                # w's rows or T's
    step_bytes = rows_per_step * (kp + first_width + block_v) * itemsize
    few = steps >= LONG_WALK_STEPS and walks * (vp // block_v) < FEW_PROGRAMS
    if kp > 128:
        stages = 1
    elif itemsize == 2:
        stages = 2 if step_bytes <= (FEW_PROGRAMS_TWO_STAGE_STEP_BYTES if few or block_v < min(vp, 64)
                                     else TWO_STAGE_STEP_BYTES) else 1
    else:
        stages = 2 if few and rows_per_step <= FEW_PROGRAMS_FLOAT32_TWO_STAGE_ROWS else 1
    return BlockSizes(block_k=block_k, block_v=block_v, num_warps=warps, num_stages=stages)


def _decay_coefficients(g, g_last, segment, chunk_size: int):
    """(a [BT], d) of one chunk for both backward kernels: a_j = [run_j == run_last]
    2^(g_last - g_j) weighs position j's key in the carried state, d = [run_first == run_last]
    2^g_last the state carried in. g [BT] chunk-local log2 decays and g_last its last (padded)
    position's, or None; segment (run [BT], run_first, run_last) or None."""
    if g is not None:
        coeff = jnp.exp2(g_last - g)
        carry_in = jnp.exp2(g_last)
    else:
        coeff = jnp.ones((chunk_size,), jnp.float32)
        carry_in = jnp.float32(1.0)
    if segment is not None:
        run, run_first, run_last = segment
        coeff = jnp.where(run == run_last, coeff, 0.0)
        carry_in = jnp.where(run_first == run_last, carry_in, 0.0)
    return coeff, carry_in


def _chunk_h_bwd_kernel(k_ref, w_ref, dv_ref, dh_ref, dfinal_ref, g_ref, runs_ref, beta_ref,
                        du_ref, dstate_ref, dinit_ref, *, num_householder: int, chunk_size: int,
                        num_chunks: int, block_k: int, subchunks: int, dot_dtype):
    """With ``beta_ref`` (``chunk_h_bwd_walk``'s ``inverse``) w_ref holds the WY stage's T,
    w^T dvt is formed as k^T (r (T^T dvt)), r = beta live 2^gamma per row (w = T diag(r) k), and
    du_ref receives T^T dvt rather than dvt."""
    has_g, has_segments = g_ref is not None, runs_ref is not None
    key_dim = dstate_ref.shape[-2]
    key_blocks = [pl.ds(start, block_k) for start in range(0, key_dim, block_k)]

    def one_chunk(c, carry, dh_index):
        ds, run_first_next = carry           # dS_in of chunk c+1 (unmasked) and its run_first
        first = c * chunk_size
        last = first + chunk_size - 1                                # padding repeats the last token
        rows = pl.ds(first, chunk_size)
        if has_segments:
            run = runs_ref[rows]                                     # [BT] run numbers
            run_first, run_last = runs_ref[first], runs_ref[last]
            reset_next = (c < num_chunks - 1) & (run_first_next != run_last)   # c+1 started one
            ds = tuple(jnp.where(reset_next, 0.0, x) for x in ds)    # -> dS_c
        else:
            run_first = run_first_next
        ds_operand = tuple(x.astype(dot_dtype) for x in ds)          # dS_c as the dots take it
        for kb, x in zip(key_blocks, ds):
            dstate_ref[c, kb, :] = x.astype(dstate_ref.dtype)
        coeff, carry_in = _decay_coefficients(
            g_ref[rows] if has_g else None,                         # [BT] chunk-local log2 decays
            g_ref[last] if has_g else None,
            (run, run_first, run_last) if has_segments else None, chunk_size)
        if beta_ref is not None:            # w's row weights r: beta live 2^gamma
            row_w = beta_ref[rows].astype(jnp.float32)
            if has_g:
                row_w = row_w * jnp.exp2(g_ref[rows])
            if has_segments:
                row_w = jnp.where(run == run_first, row_w, 0.0)
        acc = tuple(carry_in * x for x in ds)
        if dh_index is not None:                                     # h[c] is an output
            acc = tuple(dh_ref[dh_index, kb, :].astype(jnp.float32) + a
                        for kb, a in zip(key_blocks, acc))

        def one_copy(m, acc):
            # kd dS with kd = coeff k: the row weights scale the [BT, BV] product, so k goes to
            # the dot as loaded.
            keys = [k_ref[rows, m, kb].astype(dot_dtype) for kb in key_blocks]
            k_ds = sum(plgpu.dot(key, x) for key, x in zip(keys, ds_operand))   # [BT, BV] f32
            dvt = dv_ref[rows, m, :].astype(jnp.float32) + coeff[:, None] * k_ds
            if beta_ref is None:
                du_ref[rows, m, :] = dvt.astype(du_ref.dtype)
                dvt = dvt.astype(dot_dtype)
                return tuple(a - plgpu.dot(w_ref[rows, m, kb].astype(dot_dtype), dvt,
                                           trans_a=True)             # [BK, BV]
                             for kb, a in zip(key_blocks, acc))
            # T^T dvt, the cotangent of u's right-hand side (u = T Ru): stored in dvt's place
            y = plgpu.dot(w_ref[rows, m, :].astype(dot_dtype), dvt.astype(dot_dtype), trans_a=True)
            du_ref[rows, m, :] = y.astype(du_ref.dtype)
            y = (row_w[:, None] * y).astype(dot_dtype)
            return tuple(a - plgpu.dot(key, y, trans_a=True) for key, a in zip(keys, acc))

        if num_householder == 1:
            acc = one_copy(0, acc)
        else:
            acc = jax.lax.fori_loop(0, num_householder, one_copy, acc)
        return acc, run_first

    ds = tuple(dfinal_ref[kb, :].astype(jnp.float32) for kb in key_blocks)

    def one_stored_chunk(i, carry):      # h was stored before the first of every `subchunks` chunks
        stored = num_chunks // subchunks - 1 - i
        for e in reversed(range(subchunks)):
            carry = one_chunk(stored * subchunks + e, carry, stored if e == 0 else None)
        return carry

    ds, _ = jax.lax.fori_loop(0, num_chunks // subchunks, one_stored_chunk, (ds, jnp.int32(0)))
    if dinit_ref is not None:                                        # dS_in[0], never reset
        for kb, x in zip(key_blocks, ds):
            dinit_ref[kb, :] = x


def chunk_h_bwd_walk(k, w, g, runs, dh, dv_new, dfinal, *, chunk_size: int, num_householder: int,
                     with_initial_state: bool, subchunks: int = 1, dot_dtype=jnp.float32,
                     inverse: Optional[jax.Array] = None, beta: Optional[jax.Array] = None,
                     interpret: bool = False, block_sizes: Optional[BlockSizes] = None):
    """The reverse walk alone: (dvt [B, T_pad*M, H, Vp], dS [B, NT, H, Kp, Vp], dinitial
    [B, H, Kp, Vp] or None), padded (T to whole chunks, K and V to tile widths). dvt and dS come
    in ``dot_dtype`` (the dtype the dots' operands are rounded to, float32 accumulation), dinitial
    in float32; the carried dS is float32.

    ``subchunks`` > 1 mirrors ``chunk_h_pallas``'s: dh [B, NT / subchunks, H, K, V] is the
    cotangent of the states stored before every ``subchunks``-th chunk (the others were not
    outputs). The stream must then already be padded to whole groups of ``subchunks`` chunks with
    non-decaying g (edge padding here would decay the final state's cotangent).

    ``inverse`` (the WY stage's T [B, P, H, chunk_size]) with ``beta`` [B, P, H], w None: w is
    never read; w^T dvt is formed from T and k (w = T diag(beta live 2^g) k, as
    ``chunk_h_pallas``'s ``inverse``), one [chunk_size, chunk_size] x [chunk_size, BV] dot more a
    step, and the first result is T^T dvt (the cotangent of u's right-hand side Ru, u = T Ru)
    instead of dvt. Only on the sub-chunk grid (num_householder 1, g sub-chunk-local)."""
    batch, positions, heads, key_dim = k.shape
    value_dim = dv_new.shape[-1]
    m = num_householder
    if (inverse is None) != (beta is None) or (inverse is None) == (w is None):
        raise ValueError("chunk_h_bwd_walk: give w, or inverse and beta (not both)")
    if inverse is not None and (m != 1 or inverse.shape[-1] != chunk_size):
        raise ValueError(f"chunk_h_bwd_walk: inverse needs num_householder 1 and T's last axis = "
                         f"chunk_size {chunk_size}; got {m} and {inverse.shape}")
    tokens = positions // m
    if subchunks > 1 and tokens % (chunk_size * subchunks):
        raise ValueError(f"chunk_h_bwd_walk: with subchunks={subchunks}, T = {tokens} must be a "
                         f"multiple of chunk_size * subchunks = {chunk_size * subchunks}")
    num_chunks = -(-tokens // chunk_size)
    pad_t = num_chunks * chunk_size - tokens
    t_pad = tokens + pad_t
    kp, vp = tile_width(key_dim), tile_width(value_dim)
    sizes = block_sizes or default_block_sizes(key_dim, value_dim, chunk_size,
                                               chunk_size * subchunks * m, dot_dtype,
                                               walks=batch * heads, steps=num_chunks,
                                               applies_inverse=inverse is not None)
    block_k, block_v = sizes.block_k, sizes.block_v
    for name, block, width in (("block_k", block_k, kp), ("block_v", block_v, vp)):
        if width % block or block < 16 or block & (block - 1):
            raise ValueError(f"{name} must be a power of two >= 16 dividing {width}; got {block}")
    f32 = jnp.float32
    key_stream = pl.BlockSpec((None, t_pad, m, None, kp), lambda vb, hd, b: (b, 0, 0, hd, 0))
    value_stream = pl.BlockSpec((None, t_pad, m, None, block_v),
                                lambda vb, hd, b: (b, 0, 0, hd, vb))
    states = pl.BlockSpec((None, num_chunks, None, kp, block_v),
                          lambda vb, hd, b: (b, 0, hd, 0, vb))
    one_state = pl.BlockSpec((None, None, kp, block_v), lambda vb, hd, b: (b, hd, 0, vb))
    stored_states = pl.BlockSpec((None, num_chunks // subchunks, None, kp, block_v),
                                 lambda vb, hd, b: (b, 0, hd, 0, vb))
    (g_p, runs_p), (g_spec, runs_spec) = decay_and_run_operands(g, runs, pad_t)
    # States stay in their dtype: the kernel upcasts its loads.
    if inverse is None:
        first, first_spec, beta_p, beta_spec = stream_layout(w, kp, pad_t, m), key_stream, None, None
    else:
        first = stream_layout(inverse, chunk_size, pad_t, m)
        first_spec = pl.BlockSpec((None, t_pad, m, None, chunk_size),
                                  lambda vb, hd, b: (b, 0, 0, hd, 0))
        beta_p = jnp.pad(beta, ((0, 0), (0, pad_t), (0, 0)))
        beta_spec = pl.BlockSpec((None, t_pad, None), lambda vb, hd, b: (b, 0, hd))
    operands = (stream_layout(k, kp, pad_t, m), first,
                stream_layout(dv_new, vp, pad_t, m), pad_state(dh, kp, vp),
                pad_state(dfinal, kp, vp), g_p, runs_p, beta_p)
    in_specs = (key_stream, first_spec, value_stream, stored_states, one_state, g_spec, runs_spec,
                beta_spec)
    dot_dtype = jnp.dtype(dot_dtype)
    out_shape = (jax.ShapeDtypeStruct((batch, t_pad, m, heads, vp), dot_dtype),
                 jax.ShapeDtypeStruct((batch, num_chunks, heads, kp, vp), dot_dtype),
                 jax.ShapeDtypeStruct((batch, heads, kp, vp), f32) if with_initial_state else None)
    out_specs = (value_stream, states, one_state if with_initial_state else None)
    kernel = functools.partial(
        _chunk_h_bwd_kernel, num_householder=m, chunk_size=chunk_size, num_chunks=num_chunks,
        block_k=block_k, subchunks=subchunks, dot_dtype=dot_dtype)
    dvt, dstate, dinit = triton_call(
        kernel, *operands, name="gdp_chunk_h_bwd", grid=(vp // block_v, heads, batch),
        in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        num_warps=sizes.num_warps, num_stages=sizes.num_stages, interpret=interpret)
    return dvt.reshape(batch, t_pad * m, heads, vp), dstate, dinit


def _epilogue_kernel(k_ref, v_new_ref, dvt_ref, h_ref, dstate_ref, g_ref, runs_ref,
                     dk_ref, dw_ref, dgamma_ref, *, num_householder: int, chunk_size: int,
                     block_k: int, block_v: int, dot_dtype, key_gate_terms: bool):
    """One program per (head, chunk, batch row): dw, dk and dgamma of chunk c from the walk's dvt
    and dS_c and the forward's h[c] and v_new (see the module docstring). Without
    ``key_gate_terms`` dgamma holds y_c alone (at the last position) and k is not read."""
    has_g, has_segments = g_ref is not None, runs_ref is not None
    key_terms = has_g and key_gate_terms
    f32 = jnp.float32
    key_dim, value_dim = h_ref.shape
    key_blocks = [pl.ds(s, block_k) for s in range(0, key_dim, block_k)]
    value_blocks = [pl.ds(s, block_v) for s in range(0, value_dim, block_v)]
    is_last = jax.lax.broadcasted_iota(jnp.int32, (chunk_size,), 0) == chunk_size - 1
    g = g_ref[...] if has_g else None
    segment = None
    if has_segments:
        segment = (runs_ref[...], runs_ref[0], runs_ref[chunk_size - 1])
    coeff, carry_in = _decay_coefficients(g, g_ref[chunk_size - 1] if has_g else None, segment,
                                          chunk_size)

    def one_copy(m, carry):
        z_sum, hds = carry
        z = jnp.zeros((chunk_size,), f32)
        for kb in key_blocks:
            dw = jnp.zeros((chunk_size, block_k), f32)
            dkd = jnp.zeros((chunk_size, block_k), f32)
            for vb in value_blocks:
                dvt = dvt_ref[:, m, vb].astype(dot_dtype)                  # [BT, BV]
                v_new = v_new_ref[:, m, vb].astype(dot_dtype)
                h, ds = h_ref[kb, vb], dstate_ref[kb, vb]
                dw -= plgpu.dot(dvt, h.astype(dot_dtype), trans_b=True)      # -dvt h^T
                dkd += plgpu.dot(v_new, ds.astype(dot_dtype), trans_b=True)  # v_new dS^T
                if has_g:   # h o dS from the tiles loaded for the dots (first copy only),
                    hds += jnp.where(m == 0, h.astype(f32) * ds.astype(f32), 0.0)   # summed once
            dw_ref[:, m, kb] = dw.astype(dw_ref.dtype)
            dk_ref[:, m, kb] = (coeff[:, None] * dkd).astype(dk_ref.dtype)
            if key_terms:
                z += jnp.sum(k_ref[:, m, kb].astype(f32) * dkd, axis=1)
        if key_terms:
            z_sum = z_sum + LN2 * coeff * z                               # z_j, summed over copies
        return z_sum, hds

    z_sum = jnp.zeros((chunk_size,), f32)
    hds = jnp.zeros((block_k, block_v), f32)
    if num_householder == 1:
        z_sum, hds = one_copy(0, (z_sum, hds))
    else:
        z_sum, hds = jax.lax.fori_loop(0, num_householder, one_copy, (z_sum, hds))
    if has_g:
        frobenius = jnp.sum(hds)                                          # <h[c], dS_c>
        y = LN2 * carry_in * frobenius
        if key_terms:
            dgamma_ref[...] = -z_sum + jnp.where(is_last, jnp.sum(z_sum) + y, 0.0)
        else:                                                             # z is the WY VJP's
            dgamma_ref[...] = jnp.where(is_last, y, 0.0)


def chunk_h_bwd_pallas(k, w, g, runs, h, v_new, dh, dv_new, dfinal, *, chunk_size: int,
                       num_householder: int, with_initial_state: bool, subchunks: int = 1,
                       dot_dtype=jnp.float32, inverse: Optional[jax.Array] = None,
                       beta: Optional[jax.Array] = None, key_gate_terms: bool = True,
                       interpret: bool = False, block_sizes: Optional[BlockSizes] = None):
    """(dk, dw, du, dg, dinitial_state): the VJP of ``chunk_h.xla.chunk_h_xla``. dg and
    dinitial_state are float32; dk, dw and du come in ``dot_dtype``.

    Primals: k, w [B, T*M, H, K]; g [B, T, H] chunk-local log2 decays or None; runs [B, T] int32
    or None. Forward results (residuals): h [B, NT, H, K, V] (any float dtype), v_new
    [B, T*M, H, V]. Cotangents: dh [B, NT, H, K, V], dv_new [B, T*M, H, V], dfinal [B, H, K, V],
    each in any float dtype (the kernels upcast what they load). dg is None when g is None,
    dinitial_state None unless ``with_initial_state``.
    ``dot_dtype`` (float32 by default, TF32 on the GPU) is the dtype both kernels round their dots'
    operands to (float32 accumulation, float32 carried state), and the dtype of the intermediates
    they pass through HBM (dvt, the per-chunk dS) and of dw, du.
    ``subchunks`` > 1 (``chunk_h_pallas``'s): dh [B, NT / subchunks, H, K, V] holds the cotangents
    of the states stored before every ``subchunks``-th chunk, while h (the residual) holds all NT
    chunks' states; T must then be a multiple of chunk_size * subchunks. The result is then the
    VJP of ``chunk_h_pallas(subchunks=...)``.
    ``inverse`` and ``beta`` in place of w (None): the reverse walk forms w^T dvt from the WY
    stage's T (``chunk_h_bwd_walk``), and dw, du come pulled back through T, T^T dw and T^T du:
    the cotangents of w's and u's right-hand sides (w = T Rw, u = T Ru), which the WY VJP then
    takes as they are (``wy_bwd_pallas``'s ``rhs_cotangents``).
    ``key_gate_terms=False``: dg leaves out the terms through the keys' weights a_j, for a caller
    that forms them from dk itself: z_j = ln2 k_j·dk_j (summed over a token's copies), -z_j at
    each token and sum_j z_j at the chunk's last (padded) token. ``wy_bwd_pallas(
    walk_share_gates=True)`` does, from tiles it loads anyway, where the epilogue would read k
    only for them.
    """
    batch, positions, heads, key_dim = k.shape
    value_dim = v_new.shape[-1]
    m = num_householder
    tokens = positions // m
    num_chunks = -(-tokens // chunk_size)
    pad_t = num_chunks * chunk_size - tokens
    t_pad = tokens + pad_t
    kp, vp = tile_width(key_dim), tile_width(value_dim)
    f32 = jnp.float32
    sizes = block_sizes or default_block_sizes(key_dim, value_dim, chunk_size,
                                               chunk_size * subchunks * m, dot_dtype,
                                               walks=batch * heads, steps=num_chunks,
                                               applies_inverse=inverse is not None)
    dvt, dstate, dinit = chunk_h_bwd_walk(
        k, w, g, runs, dh, dv_new, dfinal, chunk_size=chunk_size, num_householder=m,
        with_initial_state=with_initial_state, subchunks=subchunks, dot_dtype=dot_dtype,
        inverse=inverse, beta=beta, interpret=interpret, block_sizes=sizes)
    # The epilogue, chunk-parallel: dw = -dvt h^T and dkd = v_new dS^T sum over the whole V (see
    # the module docstring), on [BT, 64] tiles, reading h[c] and dS_c once per copy.
    block_k, block_v = min(kp, 64), min(vp, 64)
    key_stream = pl.BlockSpec((None, chunk_size, m, None, kp), lambda hd, c, b: (b, c, 0, hd, 0))
    value_stream = pl.BlockSpec((None, chunk_size, m, None, vp), lambda hd, c, b: (b, c, 0, hd, 0))
    state = pl.BlockSpec((None, None, None, kp, vp), lambda hd, c, b: (b, c, hd, 0, 0))
    per_token = pl.BlockSpec((None, chunk_size, None), lambda hd, c, b: (b, c, hd))
    g_p = None if g is None else jnp.pad(g.astype(f32), ((0, 0), (0, pad_t), (0, 0)), mode="edge")
    runs_p = None if runs is None else jnp.pad(runs.astype(jnp.int32), ((0, 0), (0, pad_t)),
                                               mode="edge")
    operands = (stream_layout(k, kp, pad_t, m), stream_layout(v_new, vp, pad_t, m),
                dvt.reshape(batch, t_pad, m, heads, vp), pad_state(h, kp, vp), dstate, g_p, runs_p)
    in_specs = (key_stream, value_stream, value_stream, state, state,
                None if g is None else per_token,
                None if runs is None else pl.BlockSpec((None, chunk_size), lambda hd, c, b: (b, c)))
    out_shape = (jax.ShapeDtypeStruct((batch, t_pad, m, heads, kp), dvt.dtype),    # dk
                 jax.ShapeDtypeStruct((batch, t_pad, m, heads, kp), dvt.dtype),    # dw
                 None if g is None else jax.ShapeDtypeStruct((batch, t_pad, heads), f32))
    out_specs = (key_stream, key_stream, None if g is None else per_token)
    kernel = functools.partial(_epilogue_kernel, num_householder=m, chunk_size=chunk_size,
                               block_k=block_k, block_v=block_v, dot_dtype=dvt.dtype,
                               key_gate_terms=key_gate_terms)
    dk, dw, dgamma = triton_call(
        kernel, *operands, name="gdp_chunk_h_bwd_epilogue", grid=(heads, num_chunks, batch),
        in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        num_warps=sizes.epilogue_warps, num_stages=1, interpret=interpret)
    flat = lambda x, width: x.reshape(batch, t_pad * m, heads, x.shape[-1])[:, :positions, :, :width]
    dk, dw = flat(dk, key_dim), flat(dw, key_dim)
    dg = None
    if g is not None:
        dg = dgamma[:, :tokens].at[:, -1].add(dgamma[:, tokens:].sum(axis=1))   # edge padding
    dinit = None if dinit is None else dinit[..., :key_dim, :value_dim]
    return dk, dw, dvt[:, :positions, :, :value_dim], dg, dinit
