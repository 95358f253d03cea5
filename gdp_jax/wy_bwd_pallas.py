"""Pallas kernel (Triton lowering): the exact VJP of the WY stage on sub-chunks (wy_pallas.py).

Forward, per batch row, head and sub-chunk of S positions (S in {16, 32, 64}; see wy_pallas.py):

    A[j, i] = beta_j D[j, i] G[j, i],    G = K K^T (gram),
    D[j, i] = 2^(gamma_j - gamma_i) if i < j and run_i == run_j, else 0         (the mask)
    live_j  = [run_j == run_first]        (run_first: the run of the sub-chunk's first position)
    T = (I + A)^{-1},   Rw = beta live 2^gamma k,   Ru = beta v,   w = T Rw,   u = T Ru.

This is wy.wy_xla(k, v, beta, gamma, runs, chunk_size=S, num_householder=1) when gamma holds the
sub-chunk-local cumulative log2 decays (wy_pallas.expanded_log2_decays): with P a multiple of S,
wy_xla's edge padding never applies. Without gamma, D is the mask itself; without runs, every
position is live and the mask is i < j.

Backward, with cotangents dw [S, K], du [S, V]. For X = T R: dR = T^T dX, and since
dT = -T dA T, dA = -T^T dX R^T T^T = -T^T dX X^T (summed over the pairs (w, Rw) and (u, Ru)),
kept only where A is not structurally zero (on the mask; A's other entries are constants):

    dRw = T^T dw,   dRu = T^T du,
    dA  = -mask ∘ (T^T M T^T),   M = dw Rw^T + du Ru^T                           (S x S)

(M T^T = dw w^T + du u^T, so this is the -(dRw w^T + dRu u^T) form without recomputing w and u.)
Through A = beta_j D_ji G_ji, with d 2^x = ln2 2^x dx and Z = dA ∘ A:

    dG = dA ∘ beta_j D;  dk_j += sum_i dG_ji k_i + sum_i dG_ij k_i           (G = K K^T)
    dbeta_j  += sum_i dA_ji D_ji G_ji
    dgamma_j += ln2 sum_i Z_ji,    dgamma_i -= ln2 sum_j Z_ji;
through Ru = beta v:
    dv_j = beta_j dRu_j,   dbeta_j += v_j·dRu_j;
through Rw = beta live 2^gamma k:
    dk_j += beta_j live_j 2^gamma_j dRw_j,   dbeta_j += live_j 2^gamma_j (k_j·dRw_j),
    dgamma_j += ln2 beta_j live_j 2^gamma_j (k_j·dRw_j).

The kernel never forms G after A: with F = dA ∘ D (masked, as D is), P1 = F K and
P2 = F^T (beta K), the terms through A are dk = beta P1 + P2, dbeta_j += k_j·P1_j and
sum_i Z_ji = beta_j k_j·P1_j, sum_j Z_ji = k_i·P2_i, so one pass over the key columns gives them
all. Nothing divides by beta (padding positions have beta = 0).

Kernel structure. Every S x S matrix is held as a dict of [BS, BS] float32 blocks (BS =
``block_rows``, 16 by default), lower block triangle only: A, D, T, F are lower triangular, and
dA_ji = -sum_{a >= j, b <= i} T_aj M_ab T_ib touches M only at a >= j > i >= b, so M's upper
blocks are never needed. Tiles are never concatenated; every dot is at least 16 wide.

  1. G and M accumulate over K and V in ``contract_cols``-wide column blocks;
  2. T is rebuilt as the forward kernel builds it: its diagonal blocks by BS - 1 steps of forward
     substitution, all at once, then T_il = -T_ii sum_{l <= j < i} A_ij T_jl;
  3. N_pi = sum_{q <= i} M_pq T_iq^T, dA_ji = -sum_{p >= j} T_pj^T N_pi, F = dA ∘ D (D rebuilt);
  4. one pass over the key columns (``block_cols`` wide) writes dk and sums k·dRw, k·P1, k·P2;
     one over the value columns writes dv and sums v·dRu; then dbeta and dgamma are written.

Each column pass is a lax.fori_loop, not a Python loop: unrolled, the compiler hoists every column
block's loads and address tiles to the top and keeps them live.

Precision: float32 throughout from A on, with ``precision`` (default HIGHEST: IEEE float32 on the
GPU, which Triton runs as FMA loops, not tensor cores) for every dot with float32 operands; the
gram blocks k_i k_l^T run in the inputs' dtype with float32 accumulation (exact products for
16-bit inputs; ``precision`` for float32 ones), as in the forward kernel.

Registers (why the blocks are small). Triton's FMA dot keeps, per thread, its rows of the left
operand and its columns of the right one over the whole contraction, so IEEE float32 dots are
register-hungry: one [64, 64] x [64, 64] dot alone spills at 4 warps. Measured by lowering this
kernel to Triton IR on CPU (jax 0.10.2) and compiling it offline for sm_90a (pip triton 3.9,
ptxas -v), S = 64, K = V = 128, bf16 inputs, gamma and runs given (registers per thread / bytes
of spill stores):
  whole [64, 64] tiles:              4 warps 255/14 KB, 8 warps 255/8.8 KB
  ... with column passes as loops:   4 warps 255/8.4 KB, 8 warps 255/1.3 KB
  blocks of 32 (columns of 16/32):   4 warps 255/460,   8 warps 255/96
  blocks of 16, columns of 16:       4 warps 255/0,     8 warps 242/0   (f32 inputs: 255/8, 243/0)
  the same, S = 32: 188/0 and 105/0;  S = 16: 94/0 and 67/0;  K = V = 256, S = 64: 255/0 and 242/0.
The default is 8 warps for S = 64 (no spills, at some cost in occupancy) and 4 below. The
``precision`` DotAlgorithmPreset.TF32_TF32_F32_X3 (three tensor-core TF32 products, about float32
accuracy; the CPU interpreter rejects it) spilled more than HIGHEST in every layout tried (blocks
of 16: 255/3.8 KB at 4 and at 8 warps).

Status: exact in the interpreter (tests/test_wy_bwd_pallas.py, which also has the GPU test), not yet run
on a GPU in this layout, and not yet used by the op: chunk.py's backward runs wy.wy_bwd_xla
(9.2 ms on an H200 at B=8 T=4096 H=16 K=V=128 M=2 bf16) until this kernel is timed against it.
An earlier layout (whole 64 x 64 tiles, spilling as above) took about 40 ms there.

Grid (H, sub-chunks, B), heads fastest; each program owns one sub-chunk and writes only its rows.
"""
from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_HIGHEST = jax.lax.Precision.HIGHEST
_LN2 = math.log(2.0)


def _wy_bwd_kernel(*refs, sub_chunk: int, block_rows: int, block_cols: int, contract_cols: int,
                   has_g: bool, has_segments: bool, f32_inputs: bool, precision):
    k_ref, v_ref, beta_ref, *refs = refs
    gamma_ref = refs.pop(0) if has_g else None
    runs_ref = refs.pop(0) if has_segments else None
    dw_ref, du_ref, dk_ref, dv_ref, dbeta_ref, *refs = refs
    dgamma_ref = refs.pop(0) if has_g else None
    assert not refs
    f32 = jnp.float32
    bs = block_rows
    nb = sub_chunk // bs
    rows_of = lambda i: pl.ds(i * bs, bs)
    lower = [(i, l) for i in range(nb) for l in range(i + 1)]       # blocks (row, column), l <= i
    fdot = functools.partial(plgpu.dot, precision=precision)          # float32 operands

    def column_loop(ref, body, init, width):
        """fori_loop over ref's last axis in blocks of ``width`` columns: body(cols, carry) ->
        carry. A real loop, not unrolled: unrolled, the compiler hoists every block's loads and
        address tiles and keeps them live."""
        width = min(width, ref.shape[-1])
        step = lambda c, carry: body(pl.ds(pl.multiple_of(c * width, width), width), carry)
        return jax.lax.fori_loop(0, ref.shape[-1] // width, step, init)

    def load_rows(ref, cols):          # the row blocks of ref[:, cols], as float32
        return [ref[rows_of(i), cols].astype(f32) for i in range(nb)]

    # Per-position vectors, one [bs] vector per row block.
    beta = [beta_ref[rows_of(i)].astype(f32) for i in range(nb)]
    run = [runs_ref[rows_of(i)] for i in range(nb)] if has_segments else None
    live_decay = [jnp.exp2(gamma_ref[rows_of(i)]) if has_g else jnp.ones((bs,), f32)
                  for i in range(nb)]                                 # live_j 2^gamma_j
    if has_segments:
        first_run = runs_ref[0]
        live_decay = [jnp.where(run[i] == first_run, live_decay[i], 0.0) for i in range(nb)]
    scale_w = [beta[i] * live_decay[i] for i in range(nb)]            # Rw_j = scale_w_j k_j

    # Index vectors, not [bs, bs] index tiles: comparisons broadcast them.
    row_index = jax.lax.broadcasted_iota(jnp.int32, (bs, 1), 0)
    col_index = jax.lax.broadcasted_iota(jnp.int32, (1, bs), 1)

    def decay_blocks():
        """D_il: 2^(gamma_j - gamma_i) where A may be nonzero (i < j, one run), else 0. Built
        twice (for A, then for F) from gamma loaded again: cheap, and nothing keeps D between."""
        gamma = [gamma_ref[rows_of(i)] for i in range(nb)] if has_g else None
        out = {}
        for i, l in lower:
            mask = (row_index > col_index) if i == l else jnp.ones((bs, bs), bool)
            if has_segments:
                mask &= run[i][:, None] == run[l][None, :]
            if has_g:  # mask the exponent first: above the diagonal it would be positive
                out[i, l] = jnp.where(
                    mask, jnp.exp2(jnp.where(mask, gamma[i][:, None] - gamma[l][None, :], 0.0)), 0.0)
            else:
                out[i, l] = mask.astype(f32)
        return out

    zero_blocks = tuple(jnp.zeros((bs, bs), f32) for _ in lower)

    # 1. A = beta_j D G with the gram G = K K^T (inputs' dtype, float32 sums).
    gram_precision = precision if f32_inputs else None

    def add_gram(cols, gram):
        keys = [k_ref[rows_of(i), cols] for i in range(nb)]
        return tuple(g + plgpu.dot(keys[i], keys[l], trans_b=True, precision=gram_precision)
                     for g, (i, l) in zip(gram, lower))

    gram = dict(zip(lower, column_loop(k_ref, add_gram, zero_blocks, contract_cols)))
    decay = decay_blocks()
    a = {(i, l): beta[i][:, None] * decay[i, l] * gram[i, l] for i, l in lower}

    # 2. T = (I + A)^{-1} (lower block triangular) as the forward kernel builds it: the diagonal
    #    blocks by forward substitution, all at once (row r of T_ii is e_r - sum_{c < r} A_ii[r, c]
    #    T_ii[c, :]; rows below r are still identity rows), then T_il = -T_ii sum_{l <= j < i}
    #    A_ij T_jl. All float32.
    def substitute(step, diag):
        is_step = row_index == step
        out = []
        for i, t_ii in enumerate(diag):
            a_row = jnp.sum(jnp.where(is_step, a[i, i], 0.0), axis=0)     # A_ii[step, :]
            new_row = -jnp.sum(a_row[:, None] * t_ii, axis=0)     # -sum_c A_ii[step, c] T_ii[c, :]
            out.append(t_ii + jnp.where(is_step, new_row[None, :], 0.0))  # row `step` was e_step
        return tuple(out)

    eye = (row_index == col_index).astype(f32)
    diag = jax.lax.fori_loop(1, bs, substitute, tuple(eye for _ in range(nb)))
    t = {(i, i): diag[i] for i in range(nb)}
    for i in range(1, nb):
        for l in range(i - 1, -1, -1):
            t[i, l] = -fdot(t[i, i], _total(fdot(a[i, j], t[j, l]) for j in range(l, i)))

    # 3. M = dw Rw^T + du Ru^T (lower block triangle) with Rw = scale_w k, Ru = beta v: the row
    #    scalings of R become column scalings of the [bs, bs] products.
    def add_m(ref, grad_ref, scale):
        def body(cols, m):
            rhs, cot = load_rows(ref, cols), load_rows(grad_ref, cols)
            return tuple(m_pq + fdot(cot[p], rhs[q], trans_b=True) * scale[q][None, :]
                         for m_pq, (p, q) in zip(m, lower))
        return body

    m = column_loop(k_ref, add_m(k_ref, dw_ref, scale_w), zero_blocks, contract_cols)
    m = dict(zip(lower, column_loop(v_ref, add_m(v_ref, du_ref, beta), m, contract_cols)))

    #    dA = -(T^T M T^T) on the mask, blockwise: N_pi = sum_{q <= i} M_pq T_iq^T (p >= i),
    #    dA_ji = -sum_{p >= j} T_pj^T N_pi (j >= i). F = dA ∘ D (D vanishes off the mask, so F is
    #    masked too) is all that A's inputs need.
    n = {(p, i): _total(fdot(m[p, q], t[i, q], trans_b=True) for q in range(i + 1)) for p, i in lower}
    decay = decay_blocks()
    f = {(j, i): -_total(fdot(t[p, j], n[p, i], trans_a=True) for p in range(j, nb)) * decay[j, i]
         for j, i in lower}

    # 4. Key columns. With P1 = F K and P2 = F^T (beta K) (dG = beta_j F, G symmetric):
    #    dk = scale_w dRw + beta P1 + P2, dbeta_j gets k_j·P1_j (= sum_i dA_ji D_ji G_ji), and
    #    sum_i Z_ji = beta_j k_j·P1_j, sum_j Z_ji = k_i·P2_i for Z = dA ∘ A.
    def key_block(cols, sums):
        keys, cot = load_rows(k_ref, cols), load_rows(dw_ref, cols)
        beta_keys = [beta[i][:, None] * keys[i] for i in range(nb)]
        out = []
        for j in range(nb):
            d_rhs = _total(fdot(t[p, j], cot[p], trans_a=True) for p in range(j, nb))   # dRw = T^T dw
            p1 = _total(fdot(f[j, i], keys[i]) for i in range(j + 1))
            p2 = _total(fdot(f[i, j], beta_keys[i], trans_a=True) for i in range(j, nb))
            dk_ref[rows_of(j), cols] = scale_w[j][:, None] * d_rhs + beta[j][:, None] * p1 + p2
            k_dot_drw, k_dot_p1, k_dot_p2 = sums[3 * j:3 * j + 3]
            out += [k_dot_drw + jnp.sum(keys[j] * d_rhs, axis=1),
                    k_dot_p1 + jnp.sum(keys[j] * p1, axis=1),
                    k_dot_p2 + jnp.sum(keys[j] * p2, axis=1)]
        return tuple(out)

    zeros = jnp.zeros((bs,), f32)
    key_sums = column_loop(k_ref, key_block, tuple(zeros for _ in range(3 * nb)), block_cols)

    # 5. Value columns: dRu = T^T du, dv = beta dRu, dbeta_j gets v_j·dRu_j.
    def value_block(cols, sums):
        values, cot = load_rows(v_ref, cols), load_rows(du_ref, cols)
        out = []
        for j in range(nb):
            d_rhs = _total(fdot(t[p, j], cot[p], trans_a=True) for p in range(j, nb))
            dv_ref[rows_of(j), cols] = beta[j][:, None] * d_rhs
            out.append(sums[j] + jnp.sum(values[j] * d_rhs, axis=1))
        return tuple(out)

    value_sums = column_loop(v_ref, value_block, tuple(zeros for _ in range(nb)), block_cols)

    for j in range(nb):
        k_dot_drw, k_dot_p1, k_dot_p2 = key_sums[3 * j:3 * j + 3]
        dbeta_ref[rows_of(j)] = k_dot_p1 + value_sums[j] + live_decay[j] * k_dot_drw
        if has_g:
            dgamma_ref[rows_of(j)] = _LN2 * (beta[j] * k_dot_p1 - k_dot_p2 + scale_w[j] * k_dot_drw)


def _total(terms):
    """Sum of a non-empty sequence of tiles, without a leading 0 +."""
    terms = iter(terms)
    total = next(terms)
    for term in terms:
        total = total + term
    return total


def _is_tile_width(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def wy_bwd_pallas(k, v, beta, gamma, runs, dw, du, *, sub_chunk: int, interpret: bool = False,
                  num_warps: int | None = None, num_stages: int = 1, block_rows: int = 16,
                  block_cols: int = 16, contract_cols: int = 16, precision=_HIGHEST):
    """(dk [B, P, H, K], dv [B, P, H, V], dbeta [B, P, H], dgamma [B, P, H] or None), float32:
    the VJP of wy_pallas's (w, u) in (k, v, beta, gamma), given cotangents dw, du.

    k [B, P, H, K], v [B, P, H, V] (one dtype: float32, bfloat16 or float16), beta [B, P, H];
    gamma [B, P, H] sub-chunk-local log2 decays (``wy_pallas.expanded_log2_decays``) or None (then
    dgamma is None); runs [B, P] int32 run numbers or None; dw [B, P, H, K], du [B, P, H, V] in any
    float dtype. P must be a multiple of ``sub_chunk`` (16, 32 or 64); K and V powers of two >= 16
    (the caller pads with zeros, as for wy_pallas).

    Launch parameters (see the module docstring): ``num_warps`` None picks 8 for sub_chunk 64 and
    4 below; ``block_rows`` (16 or 32, dividing sub_chunk) is the side of the S x S blocks;
    ``block_cols`` and ``contract_cols`` (powers of two >= 16) are the column widths of the
    dk/dv passes and of the G/M accumulation; ``precision`` is that of the float32 dots.
    """
    batch, positions, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    if sub_chunk not in (16, 32, 64) or positions % sub_chunk:
        raise ValueError(f"wy_bwd_pallas: sub_chunk must be 16, 32 or 64 and divide P = {positions}; "
                         f"got {sub_chunk}")
    widths = dict(K=key_dim, V=value_dim, block_cols=block_cols, contract_cols=contract_cols)
    if not all(_is_tile_width(n) for n in widths.values()):
        raise ValueError(f"wy_bwd_pallas: {widths} must all be powers of two >= 16")
    if block_rows not in (16, 32) or sub_chunk % block_rows:
        raise ValueError(f"wy_bwd_pallas: block_rows must be 16 or 32 and divide sub_chunk "
                         f"{sub_chunk}; got {block_rows}")
    if v.dtype != k.dtype or dw.shape != k.shape or du.shape != v.shape:
        raise ValueError("wy_bwd_pallas: k and v must share a dtype, dw match k's shape, du v's")
    f32 = jnp.float32
    rows = lambda width: pl.BlockSpec((None, sub_chunk, None, width), lambda hd, s, b: (b, s, hd, 0))
    per_position = pl.BlockSpec((None, sub_chunk, None), lambda hd, s, b: (b, s, hd))
    operands = [k, v, beta]
    in_specs = [rows(key_dim), rows(value_dim), per_position]
    if gamma is not None:
        operands.append(gamma.astype(f32))
        in_specs.append(per_position)
    if runs is not None:
        operands.append(runs.astype(jnp.int32))
        in_specs.append(pl.BlockSpec((None, sub_chunk), lambda hd, s, b: (b, s)))
    operands += [dw, du]
    in_specs += [rows(key_dim), rows(value_dim)]
    out_shape = [jax.ShapeDtypeStruct((batch, positions, heads, key_dim), f32),
                 jax.ShapeDtypeStruct((batch, positions, heads, value_dim), f32),
                 jax.ShapeDtypeStruct((batch, positions, heads), f32)]
    out_specs = [rows(key_dim), rows(value_dim), per_position]
    if gamma is not None:
        out_shape.append(jax.ShapeDtypeStruct((batch, positions, heads), f32))
        out_specs.append(per_position)
    kernel = functools.partial(_wy_bwd_kernel, sub_chunk=sub_chunk, block_rows=block_rows,
                               block_cols=block_cols, contract_cols=contract_cols,
                               has_g=gamma is not None, has_segments=runs is not None,
                               f32_inputs=jnp.dtype(k.dtype) == jnp.float32, precision=precision)
    call = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(heads, positions // sub_chunk, batch),
        in_specs=in_specs,
        out_specs=tuple(out_specs),
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or (8 if sub_chunk == 64 else 4), num_stages=num_stages),
        interpret=interpret,
        name="gdp_wy_bwd",
    )
    with warnings.catch_warnings():
        # jax >= 0.11 flags the Triton backend as deprecated; it is the backend this kernel targets.
        warnings.filterwarnings("ignore", message=r".*[Tt]riton.*", category=DeprecationWarning)
        outs = call(*operands)
    dk, dv, dbeta = outs[:3]
    return dk, dv, dbeta, (outs[3] if gamma is not None else None)
