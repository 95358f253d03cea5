"""Pallas kernel (Triton lowering): stage 2 of Gated DeltaProduct, the WY representation per sub-chunk.

The GPU path solves the intra-chunk triangular system on *sub-chunks* of S positions of the expanded
stream (S = min(chunk_size, 64), ``cumsum.sub_chunk_size``), not on whole token chunks of M*BT
positions, so the system a program inverts is at most 64 x 64 whatever M is. The state walk
(``chunk_h.pallas_fwd``, ``subchunks`` > 1) then steps
through the sub-chunks in order and stores h only at token-chunk boundaries. This is the same recurrence
with a finer chunk grid, so h, v_new and the final state are those of SPEC; only the intermediate w, u
differ from ``wy.xla.wy_xla``'s (they are relative to the sub-chunk's start).

Sub-chunk decays live on the expanded stream: the gate of token t acts just before its first copy, so
position j = t*M + m carries log2(e) g_t when m = 0 and 0 otherwise; gamma_j is their cumulative sum from
the sub-chunk's first position (``cumsum.expanded_log2_decays``). With live_j = [same(j, first position)] and

    A[j, i] = beta_j 2^(gamma_j - gamma_i) (k_j·k_i)   for i < j in one segment, else 0   (S x S)

the sub-chunk's corrected values are v_new = u - w h_in with

    u = (I + A)^{-1} (beta v),        w = (I + A)^{-1} (beta live 2^gamma k).

Inverse. (I + A)^{-1} is lower block-triangular over 16-row blocks. Each diagonal block is inverted by
forward substitution (row i of T = e_i - sum_{c<i} A[i, c] T[c, :], exact in float32): for float32
inputs over the whole 16 x 16 tile (15 steps); for 16-bit inputs over its four 4 x 4 diagonal
sub-blocks at once (3 steps), the rest of the block then following by dots in two doublings (8 x 8,
then 16 x 16: a 2 x 2 block-triangular inverse has T_21 = -T_22 A_21 T_11). The blocks below the
diagonal follow from T_il = -T_ii sum_{l<=j<i} A_ij T_jl. The inverse is never
formed at more than 16 x 16 granularity: w and u are accumulated block row by block row as
sum_l T_il rhs_l.

Precision, by input dtype (RESULTS.md, "Dtype rules of the full op"):

| | float32 inputs | 16-bit inputs |
|---|---|---|
| gram blocks k_i k_l^T | IEEE float32 | 16-bit operands, float32 accumulation (exact products) |
| diagonal blocks' substitution | float32, whole blocks | float32, 4 x 4 sub-blocks |
| the rest of the diagonal blocks, blocks of T below the diagonal | IEEE float32 (errors in T multiply every later value) | TF32 tensor-core dots (T is rounded to 16 bits before it is applied) |
| applying T to the right-hand sides | IEEE float32 | T and the right-hand sides rounded to 16 bits, float32 accumulation, as fla does (w and u are stored in 16 bits) |

Grid (H, sub-chunks / sub_chunks_per_program, B), heads fastest; no program reads another's output.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gdp_jax._src.layout import l2norm_scale
from gdp_jax._src.pallas import plgpu, HIGHEST, triton_call

_BLOCK = 16          # rows per diagonal block (Triton's smallest dot tile)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Launch parameters of the WY kernel. The program's serial part, the substitution steps,
    favours small programs (None: ``default_num_warps``). ``substituted_rows``: the diagonal
    sub-blocks inverted by substitution, 16, 8, 4 or 2 rows (None: ``default_substituted_rows``).
    ``sub_chunks_per_program``: a program loops over that many consecutive sub-chunks, and at
    ``num_stages`` 2 Triton loads the next one's rows while it solves this one (None for either:
    ``default_sub_chunks_per_program``, with 2 stages where it loops and 1 where it does not)."""
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    substituted_rows: Optional[int] = None
    sub_chunks_per_program: Optional[int] = None


def default_num_warps(w_and_u: bool) -> int:
    """Warps a program, by what the kernel writes (RESULTS.md, "WY kernel"):

    | writes | warps | why |
    |---|---|---|
    | w and u | 2 | 4 and 8 warps 1.5x and 3.1x the time; the substitution is serial |
    | T alone | 1 | one sub-chunk a program 0.58x the time of 2 warps alone; with the default loop the op's forward 0.88-0.96x |
    """
    return 2 if w_and_u else 1


def default_substituted_rows(dtype, key_dim: int, value_dim: int) -> int:
    """Rows of the diagonal sub-blocks inverted by substitution, for the inputs' dtype and the
    padded K, V (RESULTS.md, "WY kernel"):

    | case | rows | why |
    |---|---|---|
    | 16-bit inputs, K, V <= 128 | 4 | 3 serial steps and 4 dots a block: 0.88x the time of 16 (8: 0.93x, 2: 0.90x) |
    | 16-bit inputs, K or V = 256 | 16 | the kernel spills there; 4 took the op's forward to 1.19x |
    | float32 inputs | 16 | the extra dots would be IEEE float32 FMA loops |
    """
    if jnp.dtype(dtype).itemsize == 2 and max(key_dim, value_dim) <= 128:
        return 4
    return _BLOCK


def default_sub_chunks_per_program(dtype, key_dim: int, value_dim: int, sub_chunks: int,
                                   w_and_u: bool = True) -> int:
    """Sub-chunks per program for the padded K, V, the number of sub-chunks in a row and what the
    kernel writes (RESULTS.md, "WY kernel", sub-chunks per program); the same for every input
    dtype:

    | case | per program | why |
    |---|---|---|
    | w and u, K, V <= 128, sub-chunks a multiple of 4 | 4 | the next sub-chunks' loads hide under the substitution: 0.91x at bf16 M = 2 and 3, 0.69x at K = 64, 0.68x for float32 |
    | the same, sub-chunks a multiple of 2 | 2 | 0.93-0.95x at bf16 K = 128, 0.69x at K = 64, 0.71x for float32 |
    | w and u, K or V = 256 | 1 | the loop takes 1.8-1.9x there (the kernel already spills) |
    | T alone, K <= 128 | 1 | 0.86x the loop of 4 at the headline (offline sm_90a: the loop spills 52-60 B at one warp, one sub-chunk none) |
    | T alone, K = 256, sub-chunks a multiple of 2 | 2 | 0.79x one sub-chunk a program |
    | otherwise | 1 | a lone sub-chunk has nothing to overlap |

    For float32 the loop also lengthens the compile (offline sm_90a: 25.9 s against 23.3 s).
    """
    del dtype   # measured alike for float32, float16 and bfloat16
    if not w_and_u:
        return 2 if key_dim > 128 and sub_chunks % 2 == 0 else 1
    if max(key_dim, value_dim) <= 128:
        for n in (4, 2):
            if sub_chunks % n == 0:
                return n
    return 1


def _wy_kernel(*refs, sub_chunk: int, substituted_rows: int, sub_chunks_per_program: int):
    solve = functools.partial(_wy_sub_chunk, *refs, sub_chunk=sub_chunk,
                              substituted_rows=substituted_rows)
    if sub_chunks_per_program == 1:
        solve(0, unroll=False)
        return

    def one(j, carry):
        solve(pl.multiple_of(j * sub_chunk, sub_chunk), unroll=True)
        return carry

    jax.lax.fori_loop(0, sub_chunks_per_program, one, 0)


def _wy_sub_chunk(k_ref, v_ref, beta_ref, gamma_ref, runs_ref, w_ref, u_ref, inverse_ref,
                  key_scale_ref, base, *, sub_chunk: int, substituted_rows: int, unroll: bool):
    """One sub-chunk: the rows base .. base + sub_chunk of the refs. ``unroll``: the substitution
    steps as straight code (inside the sub-chunk loop, so that the loop has no inner loop)."""
    f32 = jnp.float32
    sixteen_bit = jnp.dtype(k_ref.dtype).itemsize == 2
    nb = sub_chunk // _BLOCK
    gram_precision = None if sixteen_bit else HIGHEST
    rows_of = lambda i: pl.ds(base + i * _BLOCK, _BLOCK)
    has_g, has_segments = gamma_ref is not None, runs_ref is not None

    beta = [beta_ref[rows_of(i)].astype(f32) for i in range(nb)]
    gamma = [gamma_ref[rows_of(i)] for i in range(nb)] if has_g else None
    run = [runs_ref[rows_of(i)] for i in range(nb)] if has_segments else None
    keys = [k_ref[rows_of(i), :] for i in range(nb)]                      # inputs' dtype, [16, K]
    r16 = jax.lax.broadcasted_iota(jnp.int32, (_BLOCK, _BLOCK), 0)
    c16 = jax.lax.broadcasted_iota(jnp.int32, (_BLOCK, _BLOCK), 1)
    gram_of = lambda i, l: plgpu.dot(keys[i], keys[l], trans_b=True, precision=gram_precision)
    grams = {}                                # [16, 16] float32 k_i k_l^T
    # use_qk_l2norm: the keys' factors s = (|k|^2 + eps)^(-1/2) from the diagonals of the
    # diagonal gram blocks, as rows and as columns. They scale A (s_j s_i) and w's right-hand side
    # (s_j) and go to the walk; the key tiles stay as loaded (normalised copies of them spill at
    # K = 256 and with segments: RESULTS.md, "use_qk_l2norm").
    scale_rows = scale_cols = None
    if key_scale_ref is not None:
        scale_rows, scale_cols = [], []
        for i in range(nb):
            grams[i, i] = gram_of(i, i)
            diagonal = jnp.where(r16 == c16, grams[i, i], 0.0)
            scale_rows.append(l2norm_scale(jnp.sum(diagonal, axis=1)))
            scale_cols.append(l2norm_scale(jnp.sum(diagonal, axis=0)))
            key_scale_ref[rows_of(i)] = scale_rows[i]

    def a_block(i, l):                        # A[rows of block i, columns of block l], l <= i
        gram = grams[i, l] if (i, l) in grams else gram_of(i, l)
        mask = (r16 > c16) if i == l else jnp.ones((_BLOCK, _BLOCK), bool)
        if has_segments:
            mask &= run[i][:, None] == run[l][None, :]
        if scale_rows is None:
            coeff = beta[i][:, None] * jnp.ones((1, _BLOCK), f32)
        else:
            coeff = (beta[i] * scale_rows[i])[:, None] * scale_cols[l][None, :]
        if has_g:  # mask the exponent first: above the diagonal it would be positive
            coeff *= jnp.exp2(jnp.where(mask, gamma[i][:, None] - gamma[l][None, :], 0.0))
        return jnp.where(mask, coeff * gram, 0.0)

    a = {(i, l): a_block(i, l) for i in range(nb) for l in range(i + 1)}

    # The nb diagonal blocks are substituted together, as one [nb, 16, 16] array: each step is one
    # row extraction and one reduction for all blocks rather than one per block.
    stacked = (nb, _BLOCK, _BLOCK)
    block_of = jax.lax.broadcasted_iota(jnp.int32, stacked, 0)
    r3 = jax.lax.broadcasted_iota(jnp.int32, stacked, 1)
    c3 = jax.lax.broadcasted_iota(jnp.int32, stacked, 2)
    a_diag = jnp.zeros(stacked, f32)
    for i in range(nb):
        a_diag = jnp.where(block_of == i, a[i, i][None, :, :], a_diag)

    hdot = functools.partial(plgpu.dot, precision=HIGHEST)
    inverse_dot = functools.partial(plgpu.dot, precision=None) if sixteen_bit else hdot
    # The diagonal blocks' sub-blocks of `sub` rows are substituted together (sub - 1 steps); the
    # rest of each block follows by dots, doubling the inverted width: T = T_h - T_h L T_h, T_h the
    # inverse of the two halves, L the lower-left quarter (a 2 x 2 block-triangular inverse).
    sub = substituted_rows
    same_sub = (r3 // sub) == (c3 // sub)
    a_subs = jnp.where(same_sub, a_diag, 0.0)

    def substitute(step, t_diag):   # row `step` of every sub-block's inverse
        rows = (r3 % sub) == step
        # The sub-blocks' rows `step` share one vector per block: their nonzero columns are disjoint.
        a_row = jnp.sum(jnp.where(rows, a_subs, 0.0), axis=1)              # [nb, 16]
        new_row = -jnp.sum(a_row[:, :, None] * t_diag, axis=1)             # -sum_c A[step, c] T[c, :]
        return t_diag + jnp.where(rows & same_sub, new_row[:, None, :], 0.0)

    t_diag = (r3 == c3).astype(f32)
    if unroll:
        for step in range(1, sub):
            t_diag = substitute(step, t_diag)
    else:
        t_diag = jax.lax.fori_loop(1, sub, substitute, t_diag)
    t = {(i, i): jnp.sum(jnp.where(block_of == i, t_diag, 0.0), axis=0) for i in range(nb)}
    width = sub
    while width < _BLOCK:
        lower_left = ((r16 // (2 * width)) == (c16 // (2 * width))) & (r16 % (2 * width) >= width) \
            & (c16 % (2 * width) < width)
        for i in range(nb):
            quarter = inverse_dot(jnp.where(lower_left, a[i, i], 0.0), t[i, i])
            t[i, i] = t[i, i] - inverse_dot(t[i, i], quarter)
        width *= 2
    for i in range(1, nb):
        for l in range(i - 1, -1, -1):
            acc = sum(inverse_dot(a[i, j], t[j, l]) for j in range(l, i))
            t[i, l] = -inverse_dot(t[i, i], acc)
    if inverse_ref is not None:   # T for the backward (wy.pallas_bwd), zero above the diagonal blocks
        for i in range(nb):
            for l in range(nb):
                block = t[i, l] if l <= i else jnp.zeros((_BLOCK, _BLOCK), jnp.float32)
                inverse_ref[rows_of(i), pl.ds(l * _BLOCK, _BLOCK)] = block.astype(inverse_ref.dtype)

    if w_ref is None:             # T alone: the walk applies it (chunk_h.pallas_fwd, `inverse`)
        return
    # Right-hand sides, block by block: beta v and beta live 2^gamma k.
    if has_segments:
        first_run = runs_ref[base]
    for i in range(nb):
        u_acc = None
        w_acc = None
        for l in range(i + 1):
            scale_u = beta[l]
            scale_w = beta[l] if scale_rows is None else beta[l] * scale_rows[l]
            if has_g:
                scale_w = scale_w * jnp.exp2(gamma[l])
            if has_segments:
                scale_w = jnp.where(run[l] == first_run, scale_w, 0.0)
            rhs_u = v_ref[rows_of(l), :].astype(f32) * scale_u[:, None]
            rhs_w = keys[l].astype(f32) * scale_w[:, None]
            if sixteen_bit:   # T and the right-hand sides rounded to the inputs' 16-bit dtype
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
              return_inverse: bool = False, inverse_dtype=jnp.float32, normalize_keys: bool = False,
              w_and_u: bool = True, block_sizes: Optional[BlockSizes] = None):
    """(w [B, P, H, K], u [B, P, H, V]) in ``out_dtype``, per sub-chunk of ``sub_chunk`` positions;
    with ``return_inverse`` also T = (I + A)^{-1} [B, P, H, S] in ``inverse_dtype`` (row j:
    T[j, :] of its sub-chunk, zero above the diagonal), which the backward (``wy.pallas_bwd``)
    reuses.

    k [B, P, H, K], v [B, P, H, V] (one dtype: float32, bfloat16 or float16), beta [B, P, H];
    gamma [B, P, H] float32 sub-chunk-local log2 decays (``cumsum.expanded_log2_decays``) or None;
    runs [B, P] int32 run numbers per position or None. P must be a multiple of ``sub_chunk`` (a
    multiple of 16, at most 64) and K, V powers of two >= 16: the caller pads (zero keys, values and
    betas; padding positions change nothing). ``normalize_keys``: w and u are those of k
    L2-normalised per position (``layout.l2norm``'s formula, the squares summed by the gram's
    diagonal), as if the caller had normalised it, and the factors (sum_d k_d^2 + eps)^(-1/2)
    come back last, [B, P, H] float32.

    ``w_and_u=False`` (with ``return_inverse``): T alone, for a walk that applies it itself
    (``chunk_h.pallas_fwd.chunk_h_pallas``'s ``inverse``); v is not read (None allowed) and the
    results are (T,) and the factors where asked.
    """
    batch, positions, heads, key_dim = k.shape
    if not w_and_u and not return_inverse:
        raise ValueError("wy_pallas: w_and_u=False needs return_inverse=True (T is its only result)")
    if not w_and_u:
        v = None
    value_dim = key_dim if v is None else v.shape[-1]
    sizes = block_sizes or BlockSizes()
    num_warps = sizes.num_warps or default_num_warps(w_and_u)
    substituted_rows = sizes.substituted_rows or default_substituted_rows(k.dtype, key_dim, value_dim)
    if substituted_rows not in (2, 4, 8, 16):
        raise ValueError(f"wy_pallas: substituted_rows must be 2, 4, 8 or 16; got {substituted_rows}")
    if positions % sub_chunk or sub_chunk % _BLOCK or sub_chunk > 64:
        raise ValueError(f"wy_pallas: positions {positions} must be a multiple of sub_chunk {sub_chunk}, "
                         f"itself a multiple of {_BLOCK} and at most 64")
    n = sizes.sub_chunks_per_program or default_sub_chunks_per_program(
        k.dtype, key_dim, value_dim, positions // sub_chunk, w_and_u)
    num_stages = sizes.num_stages or (2 if n > 1 else 1)
    if n < 1 or positions % (n * sub_chunk):
        raise ValueError(f"wy_pallas: sub_chunks_per_program must divide the {positions // sub_chunk} "
                         f"sub-chunks; got {n}")
    block = n * sub_chunk
    rows = lambda width: pl.BlockSpec((None, block, None, width), lambda hd, s, b: (b, s, hd, 0))
    per_position = pl.BlockSpec((None, block, None), lambda hd, s, b: (b, s, hd))
    operands = (k, v, beta, None if gamma is None else gamma.astype(jnp.float32),
                None if runs is None else runs.astype(jnp.int32))
    in_specs = (rows(key_dim), None if v is None else rows(value_dim), per_position,
                None if gamma is None else per_position,
                None if runs is None else pl.BlockSpec((None, block), lambda hd, s, b: (b, s)))
    out_shape = (jax.ShapeDtypeStruct((batch, positions, heads, key_dim), out_dtype) if w_and_u else None,
                 jax.ShapeDtypeStruct((batch, positions, heads, value_dim), out_dtype) if w_and_u else None,
                 jax.ShapeDtypeStruct((batch, positions, heads, sub_chunk), inverse_dtype)
                 if return_inverse else None,
                 jax.ShapeDtypeStruct((batch, positions, heads), jnp.float32)
                 if normalize_keys else None)
    out_specs = (rows(key_dim) if w_and_u else None, rows(value_dim) if w_and_u else None,
                 rows(sub_chunk) if return_inverse else None,
                 per_position if normalize_keys else None)
    kernel = functools.partial(_wy_kernel, sub_chunk=sub_chunk, substituted_rows=substituted_rows,
                               sub_chunks_per_program=n)
    w, u, inverse, key_scale = triton_call(
        kernel, *operands, name="gdp_wy_fwd",
        grid=(heads, positions // block, batch), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, num_warps=num_warps, num_stages=num_stages,
        interpret=interpret)
    return (((w, u) if w_and_u else ()) + ((inverse,) if return_inverse else ())
            + ((key_scale,) if normalize_keys else ()))
