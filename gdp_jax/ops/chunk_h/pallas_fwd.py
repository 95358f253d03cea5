"""Pallas kernel (Triton lowering): stage 3 of Gated DeltaProduct, the chunk-state walk.

One program owns one (value block, head, batch) and walks the row's chunks in order with a
``lax.fori_loop``, carrying the [K, BV] float32 state in registers (``chunk_h.xla`` has the math):

    h[c] = state (zeroed at a segment start exactly on c0, c > 0)
    v_new[chunk] = u - w h[c]
    state <- d h[c] + sum_j kd[j] v_new[j]^T

The M Householder copies are read and written through a [B, T, M, H, *] view of the caller's
[B, T*M, H, *] arrays (a free reshape), indexing the copy axis inside the kernel. The full op runs
it on the sub-chunk grid of the expanded stream (``subchunks``, see ``chunk_h_pallas``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gdp_jax._src.layout import pad_state, stream_layout, tile_width
from gdp_jax._src.pallas import plgpu, triton_call


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Launch parameters of the walk: one program per (value block, head, batch row);
    ``block_v`` None means min(V, 64). ``chunks_per_step``: on the sub-chunk grid
    (``subchunks`` > 1), the sub-chunks one loop step takes, a divisor of ``subchunks`` (None:
    all of a token chunk's); fewer rows a step let two stages fit in shared memory where a whole
    token chunk's do not. ``transposed`` (the walk applying T only): the state carried as h^T
    [BV, K], so that each dot of a step's chain takes the previous result as its left operand,
    kept in registers, where the default form stores it to shared memory and waits on a barrier
    before the next dot reads it (same products, same results). ``default_block_sizes`` picks
    them per problem."""
    block_v: Optional[int] = None
    num_warps: int = 4
    num_stages: int = 1
    chunks_per_step: Optional[int] = None
    transposed: bool = False


# Bytes of k, w and u one loop step loads (the M sub-chunks of one token chunk at K = V = 128,
# 64-wide value blocks, 16-bit): the largest step measured to compile with two stages. The next
# measured, M = 3 at K = 128 and M = 2 at K = 256, exceed the H200's shared memory.
TWO_STAGE_STEP_BYTES = 2 * 64 * (2 * 128 + 64) * 2


# A walk is one dependent chain of dots per step, so its programs are latency-bound: below this
# many (B * H * value blocks; the H200 has 132 SMs) SMs sit idle, and on a long walk narrower
# value blocks buy programs. Walks of fewer steps take microseconds either way.
FEW_PROGRAMS = 128
LONG_WALK_STEPS = 512


def value_block(value_dim: int, walks: int, steps: int, widest: int = 64) -> int:
    """Value columns a walk program takes: min(padded V, ``widest``), halved down to 16 while
    ``walks`` (B * H) times the value blocks stays under FEW_PROGRAMS, on walks of at least
    LONG_WALK_STEPS ``steps``."""
    vp = tile_width(value_dim)
    block = min(vp, widest)
    while block > 16 and steps >= LONG_WALK_STEPS and walks * (vp // block) < FEW_PROGRAMS:
        block //= 2
    return block


def default_block_sizes(key_dim: int, value_dim: int, chunk_size: int, subchunks: int,
                        num_householder: int, dot_dtype, every_chunk_too: bool = False,
                        walks: int = 0, steps: int = 0, applies_inverse: bool = False) -> BlockSizes:
    """The walk's launch table (RESULTS.md, "State walk") for K, V (unpadded), the chunk the walk
    steps by, ``subchunks`` of them a stored state, ``num_householder`` rows a token, whether
    the state before every chunk is stored too, the ``walks`` (B * H) of ``steps`` chunks each
    (0: not known, many) and whether the walk applies T itself. A step's bytes are its rows of
    k, w and u (k, T and v where it applies T).

    | case | choice | why |
    |---|---|---|
    | all | 64 value columns, 4 warps | fastest of the block_v x warps sweep |
    | 16-bit dots, few programs on a long walk (``value_block``) | 32 or 16 value columns | more programs for a latency-bound walk: the op's forward / forward + backward 0.90x / 0.86x on B1 T65536 H16 (16 columns), 0.92x / 0.94x on B2 T32768 H16 and 0.59x / 0.96x on B1 T32768 K256 (32) |
    | the same (narrowed), a whole token chunk's step <= TWO_STAGE_STEP_BYTES | whole token chunks a step, 2 stages | one program an SM either way, so fewer, longer steps win: the walk applying T 0.88x (h at every sub-chunk too: 0.79x) on B1 T65536 H16, 0.72x at M = 3, 0.93x on B2 T32768 H16; the op's forward / forward + backward 0.91x / 0.95x and 0.95x / 0.99x |
    | 16-bit dots, sub-chunk grid, h at token chunks only, padded K >= 128, a sub-chunk <= TWO_STAGE_STEP_BYTES | one sub-chunk a step, 2 stages | 0.79x at M = 3 (whole chunks: 1 stage), 0.76x at K = 256, 0.89x at M = 2 (whole chunks at 2 stages) |
    | the same with h at every sub-chunk where the walk applies T | one sub-chunk a step, 2 stages | offline sm_90a at the headline: 74 KiB of shared memory against 131.6 for whole token chunks, two programs per SM; the op's forward + backward 0.96x at the headline, 0.97x at M = 3 and at K = 256 |
    | the same (narrowed, 16-bit), applying T, padded K <= 128 | the state carried transposed (``transposed``) | the walk applying T 0.83x on B1 T65536 H16 (16 columns), 0.92x on B2 T32768 H16 (32), 0.96x at M = 3; at 64 columns 1.03x (B4 T16384 H16 and the headline) and at K = 256 1.64x (B1 T32768 H16, 32 columns), so neither takes it; transposed at 32 columns instead of 16 on B1 T65536 H16 1.15x (1.38x at M = 3) |
    | ... applying T at padded K = 256, chunk 64 | 32 value columns, 4 warps | the walk applying T 0.77x of 64 columns at M = 2, 0.86x at M = 1; with h at every sub-chunk too 0.80x / 0.81x of 64 columns at 8 warps (at 4 warps 64 columns spill) |
    | ... at padded K = 256 otherwise, 64 value columns, h at every sub-chunk | 8 warps | offline 4 warps spill about 1 KB; that walk 0.91x on B2 T16384 H16 (chunk 64, before the 32-column row) |
    | other 16-bit dots, a step <= TWO_STAGE_STEP_BYTES | 2 stages | the next step's loads overlap this one's dots: 0.50-0.86x the time (0.56-0.86x also storing h at every sub-chunk); one sub-chunk a step took the op's forward to 1.06x at K = 64, and the walk to 1.18x at M = 2 and 1.02x at M = 3 with h at every sub-chunk |
    | larger steps, float32 dots | 1 stage | 2 stages overflow shared memory (larger steps) or run 1.9x slower (float32 dots) |
    """
    itemsize = jnp.dtype(dot_dtype).itemsize
    if itemsize != 2:
        return BlockSizes(num_stages=1)
    block_v = value_block(value_dim, walks, steps)
    narrow = None if block_v == min(tile_width(value_dim), 64) else block_v
    transposed = narrow is not None and applies_inverse and tile_width(key_dim) <= 128
    second = chunk_size if applies_inverse else tile_width(key_dim)     # T's row or w's
    row_bytes = (tile_width(key_dim) + second + block_v) * itemsize
    # whether a step of that many chunks (each num_householder rows a position) fits two stages
    two_stages = lambda chunks: chunk_size * chunks * num_householder * row_bytes <= TWO_STAGE_STEP_BYTES
    two = two_stages(subchunks)
    if narrow is not None and two:
        return BlockSizes(block_v=narrow, num_stages=2, transposed=transposed)
    if (subchunks > 1 and (applies_inverse or not every_chunk_too) and tile_width(key_dim) >= 128
            and two_stages(1)):
        if (narrow is None and applies_inverse and chunk_size == 64 and tile_width(key_dim) >= 256
                and tile_width(value_dim) > 32):
            narrow = 32
        warps = 8 if every_chunk_too and narrow is None and tile_width(key_dim) >= 256 else 4
        return BlockSizes(block_v=narrow, num_warps=warps, num_stages=2, chunks_per_step=1)
    return BlockSizes(block_v=narrow, num_stages=2 if two else 1)


def decay_and_run_operands(g, runs, pad_tokens: int):
    """((g, runs), (g_spec, runs_spec)) for the walk kernels: g [B, T, H] and runs [B, T] edge-padded
    by ``pad_tokens`` (padding neither decays nor starts a segment), float32 / int32, one whole row
    per program of a (value block, head, batch) grid; None (with a None spec) where absent."""
    if g is not None:
        g = jnp.pad(g.astype(jnp.float32), ((0, 0), (0, pad_tokens), (0, 0)), mode="edge")
    if runs is not None:
        runs = jnp.pad(runs.astype(jnp.int32), ((0, 0), (0, pad_tokens)), mode="edge")
    specs = (None if g is None else pl.BlockSpec((None, g.shape[1], None), lambda vb, hd, b: (b, 0, hd)),
             None if runs is None else pl.BlockSpec((None, runs.shape[1]), lambda vb, hd, b: (b, 0)))
    return (g, runs), specs


def _chunk_h_kernel(k_ref, w_ref, u_ref, g_ref, runs_ref, h0_ref, key_scale_ref, beta_ref, h_ref,
                    v_new_ref, final_ref, h_every_ref, *, num_householder: int, chunk_size: int,
                    num_chunks: int, subchunks: int, chunks_per_step: int, dot_dtype,
                    transposed: bool = False):
    """With ``beta_ref`` (``chunk_h_pallas``'s ``inverse``) w_ref holds T and u_ref v: v_new is
    T (beta (v - live 2^gamma s (k h))), live, gamma and the key factors s per row as the WY
    kernel's w."""
    key_dim, block_v = final_ref.shape[-2], final_ref.shape[-1]
    has_g, has_segments = g_ref is not None, runs_ref is not None
    if h0_ref is not None:
        state = h0_ref[...].astype(jnp.float32)
    else:
        state = jnp.zeros((key_dim, block_v), jnp.float32)
    # transposed: the state is carried as h^T [BV, K], so that every dot of the chain takes the
    # previous one's result as its left operand (registers) and only loaded tiles on the right.
    if transposed:
        state = state.T
    as_h = (lambda x: x.T) if transposed else (lambda x: x)

    def one_chunk(c, state, h_index, store_h=None):
        first = c * chunk_size
        last = first + chunk_size - 1                   # padding repeats the last real token
        rows = pl.ds(first, chunk_size)
        # Loaded first, so that the loads are in flight before the dots, not after them.
        key_scales = (None if key_scale_ref is None
                      else [key_scale_ref[rows, m] for m in range(num_householder)])
        if has_segments:
            run = runs_ref[rows]                        # [BT] run numbers
            run_first, run_last = runs_ref[first], runs_ref[last]
            run_before = runs_ref[jnp.maximum(first - 1, 0)]
            reset = (c > 0) & (run_first != run_before)
            state = jnp.where(reset, 0.0, state)
        if h_ref is None or h_index is None:
            pass                                        # h not stored apart, or not this step
        elif store_h is None:
            h_ref[h_index] = as_h(state).astype(h_ref.dtype)
        else:
            @pl.when(store_h)
            def _():
                h_ref[h_index] = as_h(state).astype(h_ref.dtype)
        if h_every_ref is not None:
            h_every_ref[c] = as_h(state).astype(h_every_ref.dtype)
        if has_g:
            g = g_ref[rows]                             # [BT] chunk-local log2 decays
            g_last = g_ref[last]
            coeff = jnp.exp2(g_last - g)                # <= 1
            carry_in = jnp.exp2(g_last)
        else:
            coeff = jnp.ones((chunk_size,), jnp.float32)
            carry_in = jnp.float32(1.0)
        if has_segments:
            coeff = jnp.where(run == run_last, coeff, 0.0)          # only the last segment carries
            carry_in = jnp.where(run_first == run_last, carry_in, 0.0)
        # The keys' normalisation factors (use_qk_l2norm) join the decay weights.
        row_coeffs = ([coeff] * num_householder if key_scales is None
                      else [coeff * key_scale for key_scale in key_scales])
        update = jnp.zeros(state.shape, jnp.float32)
        state_operand = state.astype(dot_dtype)

        def w_row_weights(m):   # from T: beta, w's row weights (beta live 2^gamma s), as the WY kernel's
            beta = beta_ref[rows].astype(jnp.float32)
            row_w = beta * (jnp.exp2(g) if has_g else 1.0)
            if key_scales is not None:
                row_w = row_w * key_scales[m]
            if has_segments:
                row_w = jnp.where(run == run_first, row_w, 0.0)
            return beta, row_w

        if transposed:
            for m in range(num_householder):
                k = k_ref[rows, m, :].astype(dot_dtype)                  # [BT, K]
                u_t = u_ref[rows, m, :].astype(jnp.float32).T            # [BV, BT]
                beta, row_w = w_row_weights(m)
                kh_t = plgpu.dot(state_operand, k, trans_b=True)         # [BV, BT]
                x_t = beta[None, :] * u_t - row_w[None, :] * kh_t
                v_new_t = plgpu.dot(x_t.astype(dot_dtype),
                                    w_ref[rows, m, :].astype(dot_dtype), trans_b=True)
                v_new_ref[rows, m, :] = v_new_t.T.astype(v_new_ref.dtype)
                v_decayed_t = (v_new_t * row_coeffs[m][None, :]).astype(dot_dtype)
                update += plgpu.dot(v_decayed_t, k)                      # [BV, K] f32
            return carry_in * state + update
        for m in range(num_householder):
            if beta_ref is None:
                w = w_ref[rows, m, :].astype(dot_dtype)             # [BT, K]
                u = u_ref[rows, m, :].astype(jnp.float32)           # [BT, BV]
                v_new = u - plgpu.dot(w, state_operand)             # [BT, BV] f32
            else:   # the WY stage's w h and u, from T ([BT, BT]) and v: one dot more, w, u not read
                beta, row_w = w_row_weights(m)
                k = k_ref[rows, m, :].astype(dot_dtype)
                kh = plgpu.dot(k, state_operand)
                x = beta[:, None] * u_ref[rows, m, :].astype(jnp.float32) - row_w[:, None] * kh
                v_new = plgpu.dot(w_ref[rows, m, :].astype(dot_dtype), x.astype(dot_dtype))
            v_new_ref[rows, m, :] = v_new.astype(v_new_ref.dtype)
            # The decay weights scale v_new's rows ([BT, BV]) rather than k's ([BT, K]): same
            # product, fewer multiplies, and k goes to the dot as loaded.
            v_decayed = (v_new * row_coeffs[m][:, None]).astype(dot_dtype)
            if beta_ref is None:
                k = k_ref[rows, m, :].astype(dot_dtype)
            update += plgpu.dot(k, v_decayed, trans_a=True)         # [K, BV] f32
        return carry_in * state + update

    def one_stored_chunk(c, state):      # h is stored before the first of every `subchunks` chunks
        for e in range(subchunks):
            state = one_chunk(c * subchunks + e, state, c if e == 0 else None)
        return state

    def one_step(s, state):              # chunks_per_step of them; h stored where c % subchunks == 0
        for e in range(chunks_per_step):
            c = s * chunks_per_step + e
            n = jnp.int32(subchunks)    # lax's integer ops: jnp's % lowers to a select that Triton rejects
            state = one_chunk(c, state, jax.lax.div(c, n) if e == 0 else None,
                              store_h=jax.lax.rem(c, n) == 0 if e == 0 else None)
        return state

    if chunks_per_step == subchunks:
        final = jax.lax.fori_loop(0, num_chunks // subchunks, one_stored_chunk, state)
    else:
        final = jax.lax.fori_loop(0, num_chunks // chunks_per_step, one_step, state)
    final_ref[...] = as_h(final).astype(final_ref.dtype)


def chunk_h_pallas(k, w, u, g, runs, initial_state, *, chunk_size: int, num_householder: int,
                   subchunks: int = 1, h_dtype=jnp.float32, v_new_dtype=jnp.float32,
                   dot_dtype=jnp.float32, every_chunk_too: bool = False,
                   key_scale: Optional[jax.Array] = None, inverse: Optional[jax.Array] = None,
                   beta: Optional[jax.Array] = None, interpret: bool = False,
                   block_sizes: Optional[BlockSizes] = None, boundary_states: bool = True):
    """(h [B, NT, H, K, V] in ``h_dtype``, v_new [B, T*M, H, V] in ``v_new_dtype``, final_state
    [B, H, K, V] float32); both dtypes default to float32.

    Same arguments as ``chunk_h.xla.chunk_h_xla``: k, w [B, T*M, H, K]; u [B, T*M, H, V]; g [B, T, H]
    chunk-local log2 decays or None; runs [B, T] int32 or None; initial_state [B, H, K, V] or None.
    T is padded to a whole number of chunks (padding: zero keys, w and u; decays and runs repeat
    the last token, so padding changes nothing) and K, V to Triton tile widths, cut back after.

    ``subchunks`` > 1 is the full op's finer grid (``wy.pallas_fwd``): the arrays are the expanded
    stream itself (num_householder 1, "tokens" = positions, chunk_size = the sub-chunk), the walk
    takes sub-chunks, and h is stored only before every ``subchunks``-th one (the token-chunk
    boundaries), so h has ceil(chunks / subchunks) entries. There g must already be sub-chunk-local
    and padded to whole token chunks with zero gates, so fully padded sub-chunks do not decay the
    final state. The state is carried in float32; ``dot_dtype`` is what the two dots' operands (w
    and the state; k and the decayed v_new) are rounded to, with float32 accumulation.
    ``every_chunk_too`` also returns the state before every chunk, [B, num_chunks, H, K, V] in
    ``h_dtype``, as a fourth result (the full op's backward keeps it); with ``boundary_states``
    False, h is not stored apart and comes back as None (its states are every ``subchunks``-th
    of the fourth result). ``key_scale`` [B, T*M, H]
    float32, or None: factors the keys are multiplied by as they enter the state (use_qk_l2norm's
    normalisation of raw keys; w is taken as given).

    ``inverse`` (the WY kernel's T [B, P, H, chunk_size], ``w_and_u=False``) with ``beta``
    [B, P, H]: the walk applies T itself, w is None and u is v [B, P, H, V]; v_new =
    T (beta (v - live 2^g s (k h))) per chunk, as ``wy.pallas_fwd``'s u - w h, with one dot more
    and w, u never written. Only on the sub-chunk grid (num_householder 1), g there sub-chunk-local.
    """
    batch, positions, heads, key_dim = k.shape
    value_dim = u.shape[-1]
    m = num_householder
    if (inverse is None) != (beta is None) or (inverse is None) == (w is None):
        raise ValueError("chunk_h_pallas: give w, or inverse and beta (not both)")
    if inverse is not None and (m != 1 or inverse.shape[-1] != chunk_size):
        raise ValueError(f"chunk_h_pallas: inverse needs num_householder 1 and T's last axis = "
                         f"chunk_size {chunk_size}; got {m} and {inverse.shape}")
    tokens = positions // m
    num_chunks = -(-tokens // (chunk_size * subchunks)) * subchunks
    pad_t = num_chunks * chunk_size - tokens
    kp, vp = tile_width(key_dim), tile_width(value_dim)
    f32 = jnp.float32
    sizes = block_sizes or default_block_sizes(key_dim, value_dim, chunk_size, subchunks, m,
                                               dot_dtype, every_chunk_too, walks=batch * heads,
                                               steps=num_chunks, applies_inverse=inverse is not None)
    block_v = sizes.block_v or min(vp, 64)
    chunks_per_step = sizes.chunks_per_step or subchunks
    if chunks_per_step < 1 or subchunks % chunks_per_step:
        raise ValueError(f"chunk_h_pallas: chunks_per_step must divide subchunks = {subchunks}; "
                         f"got {chunks_per_step}")
    if sizes.transposed and inverse is None:
        raise ValueError("chunk_h_pallas: BlockSizes(transposed=True) needs inverse and beta (the "
                         "walk applying T); got w")
    t_pad = tokens + pad_t
    key_stream = pl.BlockSpec((None, t_pad, m, None, kp), lambda vb, hd, b: (b, 0, 0, hd, 0))
    value_stream = pl.BlockSpec((None, t_pad, m, None, block_v), lambda vb, hd, b: (b, 0, 0, hd, vb))
    one_state = pl.BlockSpec((None, None, kp, block_v), lambda vb, hd, b: (b, hd, 0, vb))
    (g_p, runs_p), (g_spec, runs_spec) = decay_and_run_operands(g, runs, pad_t)
    h0 = None if initial_state is None else pad_state(initial_state.astype(f32), kp, vp)
    if key_scale is not None:   # [B, T*M, H] -> [B, H, T + pad_t, M], zeros past T: one head's
        # factors contiguous, so that a step's load is one 256-byte row, not 64 strided words
        key_scale = jnp.pad(key_scale.astype(f32), ((0, 0), (0, pad_t * m), (0, 0)))
        key_scale = jnp.swapaxes(key_scale, 1, 2).reshape(batch, heads, t_pad, m)
    if inverse is None:
        first = (stream_layout(w, kp, pad_t, m), key_stream)
        beta_p = beta_spec = None
    else:
        first = (stream_layout(inverse, chunk_size, pad_t, m),
                 pl.BlockSpec((None, t_pad, m, None, chunk_size), lambda vb, hd, b: (b, 0, 0, hd, 0)))
        beta_p = jnp.pad(beta, ((0, 0), (0, pad_t), (0, 0)))
        beta_spec = pl.BlockSpec((None, t_pad, None), lambda vb, hd, b: (b, 0, hd))
    operands = (stream_layout(k, kp, pad_t, m), first[0],
                stream_layout(u, vp, pad_t, m), g_p, runs_p, h0, key_scale, beta_p)
    in_specs = (key_stream, first[1], value_stream, g_spec, runs_spec,
                None if h0 is None else one_state,
                None if key_scale is None else pl.BlockSpec((None, None, t_pad, m),
                                                            lambda vb, hd, b: (b, hd, 0, 0)),
                beta_spec)
    states_spec = lambda count: pl.BlockSpec((None, count, None, kp, block_v),
                                             lambda vb, hd, b: (b, 0, hd, 0, vb))
    stored = num_chunks // subchunks
    # With one sub-chunk a token chunk, the state before every chunk is h itself: stored once.
    store_every = every_chunk_too and subchunks > 1
    store_h = boundary_states or not store_every
    out_shape = (jax.ShapeDtypeStruct((batch, stored, heads, kp, vp), h_dtype) if store_h else None,
                 jax.ShapeDtypeStruct((batch, t_pad, m, heads, vp), v_new_dtype),
                 jax.ShapeDtypeStruct((batch, heads, kp, vp), f32),
                 jax.ShapeDtypeStruct((batch, num_chunks, heads, kp, vp), h_dtype)
                 if store_every else None)
    out_specs = (states_spec(stored) if store_h else None, value_stream, one_state,
                 states_spec(num_chunks) if store_every else None)
    kernel = functools.partial(
        _chunk_h_kernel, num_householder=m, chunk_size=chunk_size, num_chunks=num_chunks,
        subchunks=subchunks, chunks_per_step=chunks_per_step, dot_dtype=jnp.dtype(dot_dtype),
        transposed=sizes.transposed)
    h, v_new, final_state, h_every = triton_call(
        kernel, *operands, name="gdp_chunk_h_fwd", grid=(vp // block_v, heads, batch),
        in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        num_warps=sizes.num_warps, num_stages=sizes.num_stages, interpret=interpret)
    v_new = v_new.reshape(batch, t_pad * m, heads, vp)[:, :positions, :, :value_dim]
    results = (None if h is None else h[..., :key_dim, :value_dim], v_new,
               final_state[..., :key_dim, :value_dim])
    if not every_chunk_too:
        return results
    return results + ((h_every if store_every else h)[..., :key_dim, :value_dim],)
