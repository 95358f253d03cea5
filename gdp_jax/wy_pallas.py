"""Pallas kernel (Triton lowering) for stage 2 of Gated DeltaProduct: the WY representation, per sub-chunk.

The GPU path solves the intra-chunk triangular system on *sub-chunks* of S positions of the expanded
stream (S = min(chunk_size, 64)), not on whole token chunks of M*BT positions, so the system a program
inverts is at most 64 x 64 whatever M is. The state walk (chunk_h_pallas, ``subchunks`` > 1) then steps
through the sub-chunks in order and stores h only at token-chunk boundaries. This is the same recurrence
with a finer chunk grid, so h, v_new and the final state are those of SPEC; only the intermediate w, u
differ from wy.wy_xla's (they are relative to the sub-chunk's start).

Sub-chunk decays live on the expanded stream: the gate of token t acts just before its first copy, so
position j = t*M + m carries log2(e) g_t when m = 0 and 0 otherwise; gamma_j is their cumulative sum from
the sub-chunk's first position (``expanded_log2_decays``). With live_j = [same(j, first position)] and

    A[j, i] = beta_j 2^(gamma_j - gamma_i) (k_j·k_i)   for i < j in one segment, else 0   (S x S)

the sub-chunk's corrected values are v_new = u - w h_in with

    u = (I + A)^{-1} (beta v),        w = (I + A)^{-1} (beta live 2^gamma k).

Inverse. (I + A)^{-1} is lower block-triangular over 16-row blocks. Each diagonal block is inverted by
forward substitution (row i of T = e_i - sum_{c<i} A[i, c] T[c, :], 15 steps on a 16 x 16 tile, exact
in float32), and the blocks below the diagonal follow from T_il = -T_ii sum_{l<=j<i} A_ij T_jl. The
inverse is never formed at more than 16 x 16 granularity: w and u are accumulated block row by block
row as sum_l T_il rhs_l. For float32 inputs the dots that build the inverse run in IEEE float32
("highest" precision) because errors in T multiply every later value; for 16-bit inputs the op
asks for TF32 tensor-core dots there (``tf32_inverse``): T is rounded to 16 bits before it is
applied anyway, and on an H200 (B=8 T=4096 H=16 K=V=128 M=2 bf16) the kernel went from 1.05 to
0.84 ms while w and u moved by 1.5e-4 relative (float32 outputs), against bf16's 3.9e-3 rounding.
The diagonal blocks' substitution is float32 either way. The gram blocks k_i k_l^T run in the inputs'
dtype with float32 accumulation (exact products for bf16 and fp16, as the other kernels do). Applying
T runs in float32 for float32 inputs; for 16-bit inputs (``half_apply``, the default) T and the
right-hand sides are rounded to 16 bits for tensor-core dots with float32 accumulation, as fla does:
w and u are stored in 16 bits anyway, and it is 2.5x faster on an H200.

Grid (H, sub-chunks, B), heads fastest; no program reads another's output.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gdp_jax._triton_warning import triton_backend_warning_filtered

_HIGHEST = jax.lax.Precision.HIGHEST
_BLOCK = 16          # rows per diagonal block (Triton's smallest dot tile)
LOG2_E = math.log2(math.e)


def sub_chunk_size(chunk_size: int) -> int:
    """Positions per sub-chunk: it divides chunk_size * M for every M, and the system stays <= 64."""
    return min(chunk_size, 64)


def expanded_log2_decays(g_raw, num_householder: int, positions_padded: int, sub_chunk: int):
    """[B, T, H] natural-log gates -> [B, P_pad, H] float32 sub-chunk-local cumulative log2 decays on
    the expanded stream (the gate at each token's first copy, 0 elsewhere and in padding)."""
    batch, tokens, heads = g_raw.shape
    m = num_householder
    gate = jnp.zeros((batch, tokens, m, heads), jnp.float32)
    gate = gate.at[:, :, 0].set(g_raw.astype(jnp.float32) * LOG2_E).reshape(batch, tokens * m, heads)
    gate = jnp.pad(gate, ((0, 0), (0, positions_padded - tokens * m), (0, 0)))
    cum = jnp.cumsum(gate.reshape(batch, positions_padded // sub_chunk, sub_chunk, heads), axis=2)
    return cum.reshape(batch, positions_padded, heads)


def _wy_kernel(*refs, sub_chunk: int, has_g: bool, has_segments: bool, f32_inputs: bool,
               half_apply: bool, return_inverse: bool, tf32_inverse: bool):
    k_ref, v_ref, beta_ref, *refs = refs
    gamma_ref = refs.pop(0) if has_g else None
    runs_ref = refs.pop(0) if has_segments else None
    w_ref, u_ref, *refs = refs
    inverse_ref = refs.pop(0) if return_inverse else None
    assert not refs
    f32 = jnp.float32
    nb = sub_chunk // _BLOCK
    gram_precision = _HIGHEST if f32_inputs else None
    rows_of = lambda i: pl.ds(i * _BLOCK, _BLOCK)

    beta = [beta_ref[rows_of(i)].astype(f32) for i in range(nb)]
    gamma = [gamma_ref[rows_of(i)] for i in range(nb)] if has_g else None
    run = [runs_ref[rows_of(i)] for i in range(nb)] if has_segments else None
    keys = [k_ref[rows_of(i), :] for i in range(nb)]                      # inputs' dtype, [16, K]
    r16 = jax.lax.broadcasted_iota(jnp.int32, (_BLOCK, _BLOCK), 0)
    c16 = jax.lax.broadcasted_iota(jnp.int32, (_BLOCK, _BLOCK), 1)

    def a_block(i, l):                        # A[rows of block i, columns of block l], l <= i
        gram = plgpu.dot(keys[i], keys[l], trans_b=True, precision=gram_precision)   # [16, 16] f32
        mask = (r16 > c16) if i == l else jnp.ones((_BLOCK, _BLOCK), bool)
        if has_segments:
            mask &= run[i][:, None] == run[l][None, :]
        coeff = beta[i][:, None] * jnp.ones((1, _BLOCK), f32)
        if has_g:  # mask the exponent first: above the diagonal it would be positive
            coeff *= jnp.exp2(jnp.where(mask, gamma[i][:, None] - gamma[l][None, :], 0.0))
        return jnp.where(mask, coeff * gram, 0.0)

    a = {(i, l): a_block(i, l) for i in range(nb) for l in range(i + 1)}

    # The nb diagonal blocks are substituted together, as one [nb, 16, 16] array: each step is one
    # row extraction and one reduction for all blocks rather than one per block (on an H200 at
    # B=8 T=4096 H=16 K=V=128 M=2 bf16, 0.829 -> 0.742 ms; benchmarks/exp_wy_variants.py).
    stacked = (nb, _BLOCK, _BLOCK)
    block_of = jax.lax.broadcasted_iota(jnp.int32, stacked, 0)
    r3 = jax.lax.broadcasted_iota(jnp.int32, stacked, 1)
    c3 = jax.lax.broadcasted_iota(jnp.int32, stacked, 2)
    a_diag = jnp.zeros(stacked, f32)
    for i in range(nb):
        a_diag = jnp.where(block_of == i, a[i, i][None, :, :], a_diag)

    def substitute(step, t_diag):             # row `step` of every diagonal block's inverse
        a_row = jnp.sum(jnp.where(r3 == step, a_diag, 0.0), axis=1)        # A_ii[step, :], [nb, 16]
        new_row = -jnp.sum(a_row[:, :, None] * t_diag, axis=1)             # -sum_c A[step, c] T[c, :]
        return t_diag + jnp.where(r3 == step, new_row[:, None, :], 0.0)

    t_diag = jax.lax.fori_loop(1, _BLOCK, substitute, (r3 == c3).astype(f32))
    t = {(i, i): jnp.sum(jnp.where(block_of == i, t_diag, 0.0), axis=0) for i in range(nb)}
    hdot = functools.partial(plgpu.dot, precision=_HIGHEST)
    inverse_dot = functools.partial(plgpu.dot, precision=None) if tf32_inverse else hdot
    for i in range(1, nb):
        for l in range(i - 1, -1, -1):
            acc = sum(inverse_dot(a[i, j], t[j, l]) for j in range(l, i))
            t[i, l] = -inverse_dot(t[i, i], acc)
    if return_inverse:   # T for the backward (wy_bwd_pallas), zero above the diagonal blocks
        for i in range(nb):
            for l in range(nb):
                block = t[i, l] if l <= i else jnp.zeros((_BLOCK, _BLOCK), jnp.float32)
                inverse_ref[rows_of(i), rows_of(l)] = block.astype(inverse_ref.dtype)

    # Right-hand sides, block by block: beta v and beta live 2^gamma k.
    if has_segments:
        first_run = runs_ref[0]
    for i in range(nb):
        u_acc = None
        w_acc = None
        for l in range(i + 1):
            scale_u = beta[l]
            scale_w = beta[l]
            if has_g:
                scale_w = scale_w * jnp.exp2(gamma[l])
            if has_segments:
                scale_w = jnp.where(run[l] == first_run, scale_w, 0.0)
            rhs_u = v_ref[rows_of(l), :].astype(f32) * scale_u[:, None]
            rhs_w = keys[l].astype(f32) * scale_w[:, None]
            if half_apply:   # T and the right-hand sides rounded to the inputs' 16-bit dtype
                t_il = t[i, l].astype(k_ref.dtype)
                du = plgpu.dot(t_il, rhs_u.astype(k_ref.dtype))
                dw = plgpu.dot(t_il, rhs_w.astype(k_ref.dtype))
            else:
                du = hdot(t[i, l], rhs_u)
                dw = hdot(t[i, l], rhs_w)
            u_acc = du if u_acc is None else u_acc + du
            w_acc = dw if w_acc is None else w_acc + dw
        u_ref[rows_of(i), :] = u_acc.astype(u_ref.dtype)
        w_ref[rows_of(i), :] = w_acc.astype(w_ref.dtype)


def wy_pallas(k, v, beta, gamma, runs, *, sub_chunk: int, out_dtype, interpret: bool = False,
              num_warps: int = 2, num_stages: int = 1, half_apply: bool = True,
              return_inverse: bool = False, tf32_inverse: bool = False):
    """(w [B, P, H, K], u [B, P, H, V]) in ``out_dtype``, per sub-chunk of ``sub_chunk`` positions;
    with ``return_inverse`` also T = (I + A)^{-1} [B, P, H, S] float32 (row j: T[j, :] of its
    sub-chunk, zero above the diagonal), which the backward (wy_bwd_pallas) reuses.

    k [B, P, H, K], v [B, P, H, V] (same dtype), beta [B, P, H]; gamma [B, P, H] float32 sub-chunk-
    local log2 decays (``expanded_log2_decays``) or None; runs [B, P] int32 run numbers per position or
    None. P must be a multiple of ``sub_chunk`` (a multiple of 16, at most 64) and K, V powers of two
    >= 16: the caller pads (zero keys, values and betas; padding positions change nothing).
    ``half_apply`` (16-bit inputs only) applies the inverse with 16-bit tensor-core dots, as fla does,
    instead of float32 ones (w and u are stored in 16 bits anyway). ``tf32_inverse`` builds the
    blocks of T below the diagonal with TF32 tensor-core dots instead of IEEE float32 (the op's
    choice for 16-bit inputs; see the module docstring).

    Defaults measured on an H200 (benchmarks/tune_states.py, B=8 T=4096 H=16 K=V=128 M=2 bf16):
    2 warps with half_apply 1.07 ms; 4 warps 1.63 ms; float32 apply 2.66 ms (4 warps) to 4.75 ms
    (2 warps). The program's serial part (the 15 substitution steps) favours small programs. With
    the TF32 inverse and the stacked substitution since, 2 warps take 0.74 ms.
    """
    batch, positions, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    if positions % sub_chunk or sub_chunk % _BLOCK or sub_chunk > 64:
        raise ValueError(f"wy_pallas: positions {positions} must be a multiple of sub_chunk {sub_chunk}, "
                         f"itself a multiple of {_BLOCK} and at most 64")
    grid = (heads, positions // sub_chunk, batch)
    rows = lambda width: pl.BlockSpec((None, sub_chunk, None, width), lambda hd, s, b: (b, s, hd, 0))
    per_position = pl.BlockSpec((None, sub_chunk, None), lambda hd, s, b: (b, s, hd))
    operands = [k, v, beta]
    in_specs = [rows(key_dim), rows(value_dim), per_position]
    if gamma is not None:
        operands.append(gamma.astype(jnp.float32))
        in_specs.append(per_position)
    if runs is not None:
        operands.append(runs.astype(jnp.int32))
        in_specs.append(pl.BlockSpec((None, sub_chunk), lambda hd, s, b: (b, s)))
    kernel = functools.partial(_wy_kernel, sub_chunk=sub_chunk, has_g=gamma is not None,
                               has_segments=runs is not None,
                               f32_inputs=jnp.dtype(k.dtype) == jnp.float32,
                               half_apply=half_apply and jnp.dtype(k.dtype).itemsize == 2,
                               return_inverse=return_inverse, tf32_inverse=tf32_inverse)
    out_shape = [jax.ShapeDtypeStruct((batch, positions, heads, key_dim), out_dtype),
                 jax.ShapeDtypeStruct((batch, positions, heads, value_dim), out_dtype)]
    out_specs = [rows(key_dim), rows(value_dim)]
    if return_inverse:
        out_shape.append(jax.ShapeDtypeStruct((batch, positions, heads, sub_chunk), jnp.float32))
        out_specs.append(rows(sub_chunk))
    call = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=grid,
        in_specs=in_specs,
        out_specs=tuple(out_specs),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="gdp_wy_fwd",
    )
    with triton_backend_warning_filtered():
        return call(*operands)
