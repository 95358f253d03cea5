"""Pallas kernel (Triton lowering) for stage 3 of Gated DeltaProduct: the chunk-state walk.

One program owns one (value block, head, batch) and walks the row's chunks in order with a
``lax.fori_loop``, carrying the [K, BV] float32 state in registers (see chunk_h.py for the math):

    h[c] = state (zeroed at a segment start exactly on c0, c > 0)
    v_new[chunk] = u - w h[c]
    state <- d h[c] + sum_j kd[j] v_new[j]^T

The M Householder copies are read and written through a [B, T, M, H, *] view of the caller's
[B, T*M, H, *] arrays (a free reshape), indexing the copy axis inside the kernel.

Status: compiled and checked on an H200 (tests/test_chunk_gpu.py, against the float64 recurrence,
both grids). The full op's GPU path (chunk.py) runs it on the sub-chunk grid (``subchunks``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gdp_jax._chunking import tile_width
from gdp_jax._triton_warning import triton_backend_warning_filtered

def stream_layout(x, padded_width: int, pad_tokens: int, num_householder: int):
    """[B, T*M, H, X] -> [B, T + pad_tokens, M, H, padded_width]: zero rows past T and zero columns
    past X, in x's dtype (the walk kernels upcast what they load, so no extra pass over HBM)."""
    batch, positions, heads, width = x.shape
    m = num_householder
    x = jnp.pad(x, ((0, 0), (0, pad_tokens * m), (0, 0), (0, padded_width - width)))
    return x.reshape(batch, positions // m + pad_tokens, m, heads, padded_width)


def decay_and_run_operands(g, runs, pad_tokens: int):
    """(operands, in_specs) for the walk kernels' optional g [B, T, H] and runs [B, T]: edge-padded
    by ``pad_tokens`` (padding neither decays nor starts a segment), float32 / int32, one whole row
    per program of a (value block, head, batch) grid."""
    operands, specs = [], []
    if g is not None:
        g = jnp.pad(g.astype(jnp.float32), ((0, 0), (0, pad_tokens), (0, 0)), mode="edge")
        operands.append(g)
        specs.append(pl.BlockSpec((None, g.shape[1], None), lambda vb, hd, b: (b, 0, hd)))
    if runs is not None:
        runs = jnp.pad(runs.astype(jnp.int32), ((0, 0), (0, pad_tokens)), mode="edge")
        operands.append(runs)
        specs.append(pl.BlockSpec((None, runs.shape[1]), lambda vb, hd, b: (b, 0)))
    return operands, specs


def _chunk_h_kernel(*refs, num_householder: int, chunk_size: int, num_chunks: int, has_g: bool,
                    has_segments: bool, has_initial_state: bool, subchunks: int, dot_dtype,
                    every_chunk_too: bool):
    k_ref, w_ref, u_ref, *refs = refs
    g_ref = refs.pop(0) if has_g else None
    runs_ref = refs.pop(0) if has_segments else None
    h0_ref = refs.pop(0) if has_initial_state else None
    h_ref, v_new_ref, final_ref, *refs = refs
    h_every_ref = refs.pop(0) if every_chunk_too else None
    assert not refs
    key_dim, block_v = h_ref.shape[-2], h_ref.shape[-1]

    if has_initial_state:
        state = h0_ref[...].astype(jnp.float32)
    else:
        state = jnp.zeros((key_dim, block_v), jnp.float32)

    def one_chunk(c, state, h_index):
        first = c * chunk_size
        last = first + chunk_size - 1                   # padding repeats the last real token
        rows = pl.ds(first, chunk_size)
        if has_segments:
            run = runs_ref[rows]                        # [BT] run numbers
            run_first, run_last = runs_ref[first], runs_ref[last]
            run_before = runs_ref[jnp.maximum(first - 1, 0)]
            reset = (c > 0) & (run_first != run_before)
            state = jnp.where(reset, 0.0, state)
        if h_index is not None:
            h_ref[h_index] = state.astype(h_ref.dtype)
        if every_chunk_too:
            h_every_ref[c] = state.astype(h_every_ref.dtype)
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
        update = jnp.zeros((key_dim, block_v), jnp.float32)
        state_operand = state.astype(dot_dtype)
        for m in range(num_householder):
            w = w_ref[rows, m, :].astype(dot_dtype)                 # [BT, K]
            u = u_ref[rows, m, :].astype(jnp.float32)               # [BT, BV]
            v_new = u - plgpu.dot(w, state_operand)                 # [BT, BV] f32
            v_new_ref[rows, m, :] = v_new.astype(v_new_ref.dtype)
            # The decay weights scale v_new's rows ([BT, BV]) rather than k's ([BT, K]): same
            # product, fewer multiplies, and k goes to the dot as loaded.
            v_decayed = (v_new * coeff[:, None]).astype(dot_dtype)
            k = k_ref[rows, m, :].astype(dot_dtype)
            update += plgpu.dot(k, v_decayed, trans_a=True)         # [K, BV] f32
        return carry_in * state + update

    def one_stored_chunk(c, state):      # h is stored before the first of every `subchunks` chunks
        for e in range(subchunks):
            state = one_chunk(c * subchunks + e, state, c if e == 0 else None)
        return state

    final = jax.lax.fori_loop(0, num_chunks // subchunks, one_stored_chunk, state)
    final_ref[...] = final.astype(final_ref.dtype)


def chunk_h_pallas(k, w, u, g, runs, initial_state, *, chunk_size: int, num_householder: int,
                   interpret: bool = False, block_v: int | None = None, num_warps: int = 4,
                   num_stages: int = 1, subchunks: int = 1, h_dtype=jnp.float32,
                   v_new_dtype=jnp.float32, dot_dtype=jnp.float32, every_chunk_too: bool = False):
    """(h [B, NT, H, K, V] in ``h_dtype``, v_new [B, T*M, H, V] in ``v_new_dtype``, final_state
    [B, H, K, V] float32); both dtypes default to float32.

    Same arguments as ``chunk_h.chunk_h_xla``: k, w [B, T*M, H, K]; u [B, T*M, H, V]; g [B, T, H]
    chunk-local log2 decays or None; runs [B, T] int32 or None; initial_state [B, H, K, V] or None.
    T is padded to a whole number of chunks (padding: zero keys, w and u; decays and runs repeat
    the last token, so padding changes nothing) and K, V to Triton tile widths, cut back after.

    ``subchunks`` > 1 is the GPU path's finer grid (wy_pallas.py): the arrays are the expanded stream
    itself (num_householder 1, "tokens" = positions, chunk_size = the sub-chunk), the walk takes
    sub-chunks, and h is stored only before every ``subchunks``-th one (the token-chunk boundaries),
    so h has ceil(chunks / subchunks) entries. There g must already be sub-chunk-local and padded to
    whole token chunks with zero gates, so fully padded sub-chunks do not decay the final state.
    h and v_new are written in ``h_dtype`` and ``v_new_dtype``; the state is carried in float32.
    ``dot_dtype`` is what the two dots' operands (w and the state; k and the decayed v_new) are
    rounded to, with float32 accumulation: float32 (TF32 on the GPU) by default.
    ``every_chunk_too`` also returns the state before every chunk, [B, num_chunks, H, K, V] in
    ``h_dtype``, as a fourth result (the full op's backward keeps it; with ``subchunks`` > 1, h is
    then every ``subchunks``-th entry of it, written by the kernel rather than sliced out).
    """
    batch, positions, heads, key_dim = k.shape
    value_dim = u.shape[-1]
    m = num_householder
    tokens = positions // m
    num_chunks = -(-tokens // (chunk_size * subchunks)) * subchunks
    pad_t = num_chunks * chunk_size - tokens
    kp, vp = tile_width(key_dim), tile_width(value_dim)
    f32 = jnp.float32

    # Measured on an H200 (tune_states.py, sub-chunk walk, B=8 T=4096 H=16 K=V=128 M=2 bf16):
    # block_v 64 with 4 warps 0.505 ms with bf16 dots (0.733 TF32); block_v 32: 0.734 / 0.687
    # (2 / 4 warps, bf16 dots), 0.99 / 1.11 (TF32); block_v 16 (TF32): >= 1.6.
    block_v = block_v or min(vp, 64)
    operands = [stream_layout(x, width, pad_t, m) for x, width in ((k, kp), (w, kp), (u, vp))]
    t_pad = tokens + pad_t
    in_specs = [pl.BlockSpec((None, t_pad, m, None, kp), lambda vb, hd, b: (b, 0, 0, hd, 0)),
                pl.BlockSpec((None, t_pad, m, None, kp), lambda vb, hd, b: (b, 0, 0, hd, 0)),
                pl.BlockSpec((None, t_pad, m, None, block_v), lambda vb, hd, b: (b, 0, 0, hd, vb))]
    row_operands, row_specs = decay_and_run_operands(g, runs, pad_t)
    operands += row_operands
    in_specs += row_specs
    if initial_state is not None:
        operands.append(jnp.pad(initial_state.astype(f32),
                                ((0, 0), (0, 0), (0, kp - key_dim), (0, vp - value_dim))))
        in_specs.append(pl.BlockSpec((None, None, kp, block_v), lambda vb, hd, b: (b, hd, 0, vb)))

    kernel = functools.partial(
        _chunk_h_kernel, num_householder=m, chunk_size=chunk_size, num_chunks=num_chunks,
        has_g=g is not None, has_segments=runs is not None,
        has_initial_state=initial_state is not None, subchunks=subchunks,
        dot_dtype=jnp.dtype(dot_dtype), every_chunk_too=every_chunk_too)
    states_spec = lambda count: pl.BlockSpec((None, count, None, kp, block_v),
                                             lambda vb, hd, b: (b, 0, hd, 0, vb))
    out_shape = [jax.ShapeDtypeStruct((batch, num_chunks // subchunks, heads, kp, vp), h_dtype),
                 jax.ShapeDtypeStruct((batch, t_pad, m, heads, vp), v_new_dtype),
                 jax.ShapeDtypeStruct((batch, heads, kp, vp), f32)]
    out_specs = [states_spec(num_chunks // subchunks),
                 pl.BlockSpec((None, t_pad, m, None, block_v), lambda vb, hd, b: (b, 0, 0, hd, vb)),
                 pl.BlockSpec((None, None, kp, block_v), lambda vb, hd, b: (b, hd, 0, vb))]
    if every_chunk_too:
        out_shape.append(jax.ShapeDtypeStruct((batch, num_chunks, heads, kp, vp), h_dtype))
        out_specs.append(states_spec(num_chunks))
    call = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(vp // block_v, heads, batch),
        in_specs=in_specs,
        out_specs=tuple(out_specs),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="gdp_chunk_h_fwd",
    )
    with triton_backend_warning_filtered():
        h, v_new, final_state, *h_every = call(*operands)
    v_new = v_new.reshape(batch, t_pad * m, heads, vp)[:, :positions, :, :value_dim]
    results = (h[..., :key_dim, :value_dim], v_new, final_state[..., :key_dim, :value_dim])
    return results + (h_every[0][..., :key_dim, :value_dim],) if every_chunk_too else results
