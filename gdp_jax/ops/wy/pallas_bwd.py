"""Pallas kernel (Triton lowering): the exact VJP of the WY stage on sub-chunks (``wy.pallas_fwd``).

Forward, per batch row, head and sub-chunk of S positions (S in {16, 32, 64}; see ``wy.pallas_fwd``):

    A[j, i] = beta_j D[j, i] G[j, i],    G = K K^T (gram),
    D[j, i] = 2^(gamma_j - gamma_i) if i < j and run_i == run_j, else 0         (the mask)
    live_j  = [run_j == run_first]        (run_first: the run of the sub-chunk's first position)
    T = (I + A)^{-1},   Rw = beta live 2^gamma k,   Ru = beta v,   w = T Rw,   u = T Ru.

This is ``wy.xla.wy_xla(k, v, beta, gamma, runs, chunk_size=S, num_householder=1)`` when gamma holds
the sub-chunk-local cumulative log2 decays (``cumsum.expanded_log2_decays``): with P a multiple of S,
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

Kernel structure. The inverse T is the forward kernel's own (``wy_pallas(..., return_inverse=True)``
keeps it as [B, P, H, S], row j holding T[j, :] of its sub-chunk; float32, or the 16-bit operand
dtype, which loses nothing: the dots round T to it anyway), so nothing serial is redone here and
every step is a whole-tile dot on tensor cores. Per program (one sub-chunk):

  1. value columns (``block_cols`` wide): M = du Ru^T, dRu = T^T du, dv = beta dRu, sums v·dRu;
  2. key columns: M += dw Rw^T;
  3. dA = -mask ∘ (T^T (M T^T)), F = dA ∘ D (D rebuilt from gamma and the runs);
  4. key columns again: dRw = T^T dw, P1 = F K, P2 = F^T (beta K), dk, sums k·dRw, k·P1, k·P2;
     then dbeta and dgamma.

With ``key_factor`` (the keys are l2norm's rows of raw keys, whose cotangent dk becomes) step 4
must know k_j·dk_j before it writes a block: step 2 also sums the gram G = K K^T, k·dRw and k·(each
share), step 3 reads k_j·P1_j = sum_i F_ji G_ji and k_i·P2_i = sum_j F_ji beta_j G_ji off F ∘ G,
and step 4 writes r (dk - k (k·dk)) with no row sums of its own. Where one block holds every key
column (K <= ``block_cols``), step 4 forms the whole dk tile before it writes it and takes k·dk off
that tile, so step 2 sums nothing extra (K = 64: the op's forward + backward 0.96-0.97x; at
K = 128 one 128-column block spills at 4 warps and takes a whole SM at 8, both slower; RESULTS.md,
"WY backward").

Given dRw and dRu instead of dw and du (``rhs_cotangents``), steps 1-2 form T^T M = dRw Rw^T +
dRu Ru^T directly and step 3 needs one dot: dA = -mask ∘ ((T^T M) T^T).

Every dot takes float32 operands at ``precision`` (None: TF32 tensor cores; ``TF32X3``: three TF32
passes, float32-level products, run as HIGHEST by the interpreter; HIGHEST: IEEE float32, FMA loops
that spill when compiled), or, with ``operand_dtype``, operands rounded to that 16-bit dtype with
float32 accumulation, as fla's WY backward does (``_src.dispatch.wy_bwd_dots`` picks per input dtype).

Grid (H, sub-chunks, B), heads fastest; each program owns one sub-chunk and writes only its rows.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gdp_jax._src.layout import tile_width
from gdp_jax._src.pallas import plgpu, HIGHEST, LN2, TF32X3, triton_call


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Launch parameters of the WY backward (one program per sub-chunk); RESULTS.md, "WY backward"."""
    block_cols: int = 64      # width of the column blocks the K and V passes step through
    num_warps: int = 4
    num_stages: int = 1


def _wy_bwd_kernel(k_ref, v_ref, beta_ref, gamma_ref, runs_ref, inverse_ref, dw_ref, du_ref,
                   dk_in_refs, key_factor_ref, dk_ref, dv_ref, dbeta_ref, dgamma_ref, *, sub_chunk: int,
                   block_cols: int, precision, operand_dtype, rhs_cotangents: bool,
                   walk_share_gates: bool):
    f32 = jnp.float32
    has_g, has_segments = gamma_ref is not None, runs_ref is not None
    if operand_dtype is None:
        dot = functools.partial(plgpu.dot, precision=precision)
    else:   # 16-bit operands (float32 accumulation): T, M, F and the scaled tiles rounded once more
        dot = lambda a, b, **kw: plgpu.dot(a.astype(operand_dtype), b.astype(operand_dtype), **kw)

    def column_loop(ref, body, init):
        """fori_loop over ref's last axis in ``block_cols``-wide blocks: body(cols, carry) -> carry.
        A real loop: unrolled, the compiler hoists every block's loads and keeps them live."""
        width = min(block_cols, ref.shape[-1])
        step = lambda c, carry: body(pl.ds(pl.multiple_of(c * width, width), width), carry)
        return jax.lax.fori_loop(0, ref.shape[-1] // width, step, init)

    beta = beta_ref[...].astype(f32)                                  # [S]
    live_decay = jnp.exp2(gamma_ref[...]) if has_g else jnp.ones((sub_chunk,), f32)
    if has_segments:
        runs = runs_ref[...]
        live_decay = jnp.where(runs == runs_ref[0], live_decay, 0.0)   # live_j 2^gamma_j
    scale_w = beta * live_decay                                       # Rw_j = scale_w_j k_j
    t_inv = inverse_ref[...].astype(f32)                              # T [S, S], lower

    # 1-2. M = du Ru^T + dw Rw^T; on the way, dRu = T^T du gives dv and v·dRu. With
    # rhs_cotangents du, dw are dRu, dRw already and M is T^T M.
    def value_block(cols, carry):
        m, v_dot_dru = carry
        values, cot = v_ref[:, cols].astype(f32), du_ref[:, cols].astype(f32)
        d_rhs = cot if rhs_cotangents else dot(t_inv, cot, trans_a=True)   # dRu = T^T du
        dv_ref[:, cols] = (beta[:, None] * d_rhs).astype(dv_ref.dtype)
        m = m + dot(cot, values * beta[:, None], trans_b=True)
        return m, v_dot_dru + jnp.sum(values * d_rhs, axis=1)

    zeros = jnp.zeros((sub_chunk,), f32)
    m, v_dot_dru = column_loop(v_ref, value_block, (jnp.zeros((sub_chunk, sub_chunk), f32), zeros))

    def add_key_outer(cols, m):
        keys, cot = k_ref[:, cols].astype(f32), dw_ref[:, cols].astype(f32)
        return m + dot(cot, keys * scale_w[:, None], trans_b=True)

    normalized = key_factor_ref is not None
    # several key blocks: the row sums k·dk come from this pass and the gram (one block: off the
    # dk tile in step 4)
    sums_from_gram = normalized and k_ref.shape[-1] > block_cols
    if sums_from_gram:
        # l2norm's VJP needs the row sums k_j·dk_j before the first dk block is written, so they
        # come from this pass: the gram G = K K^T (k·P1 and k·P2 are sums of F ∘ G, step 3),
        # k·dRw (directly, or as colsum(T ∘ dW K^T)) and k·(each share).
        def add_key_outer_and_sums(cols, carry):
            m, gram, drw_part, share_sums = carry
            keys, cot = k_ref[:, cols].astype(f32), dw_ref[:, cols].astype(f32)
            m = m + dot(cot, keys * scale_w[:, None], trans_b=True)
            gram = gram + dot(keys, keys, trans_b=True)
            if rhs_cotangents:
                drw_part = drw_part + jnp.sum(keys * cot, axis=1)
            else:
                drw_part = drw_part + dot(cot, keys, trans_b=True)        # X_ij = dw_i·k_j
            share_sums = tuple(acc + jnp.sum(keys * ref[:, cols].astype(f32), axis=1)
                               for acc, ref in zip(share_sums, dk_in_refs))
            return m, gram, drw_part, share_sums

        square = jnp.zeros((sub_chunk, sub_chunk), f32)
        m, gram, drw_part, share_sums = column_loop(
            k_ref, add_key_outer_and_sums,
            (m, square, zeros if rhs_cotangents else square, (zeros,) * len(dk_in_refs)))
        k_dot_drw = drw_part if rhs_cotangents else jnp.sum(t_inv * drw_part, axis=0)
    else:
        m = column_loop(k_ref, add_key_outer, m)

    # 3. dA = -(T^T M T^T) on the mask; F = dA ∘ D, with D_ji = 2^(gamma_j - gamma_i) there.
    row = jax.lax.broadcasted_iota(jnp.int32, (sub_chunk, 1), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (1, sub_chunk), 1)
    mask = row > col
    if has_segments:
        mask &= runs[:, None] == runs[None, :]
    decay = mask.astype(f32)
    if has_g:  # mask the exponent first: above the diagonal it would be positive
        gamma = gamma_ref[...]
        decay = jnp.where(mask, jnp.exp2(jnp.where(mask, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
    m_t = dot(m, t_inv, trans_b=True)
    f = -(m_t if rhs_cotangents else dot(t_inv, m_t, trans_a=True)) * decay

    # 4. Key columns: dRw = T^T dw, P1 = F K, P2 = F^T (beta K); dk = scale_w dRw + beta P1 + P2
    # (+ the other shares); with walk_share_gates also k·(the first share).
    gates_of_share = walk_share_gates and has_g

    if sums_from_gram:   # dk_raw = r (dk - k (k·dk)), the row sums from steps 2-3
        weighted = f * gram
        k_dot_p1 = jnp.sum(weighted, axis=1)                   # k_j·P1_j = sum_i F_ji G_ji
        k_dot_p2 = jnp.sum(weighted * beta[:, None], axis=0)   # k_i·P2_i = sum_j F_ji beta_j G_ji
        k_dot_dk = scale_w * k_dot_drw + beta * k_dot_p1 + k_dot_p2 + sum(share_sums)
        factor = key_factor_ref[...]

        def projected_key_block(cols, carry):
            keys, cot = k_ref[:, cols].astype(f32), dw_ref[:, cols].astype(f32)
            d_rhs = cot if rhs_cotangents else dot(t_inv, cot, trans_a=True)
            dk = (scale_w[:, None] * d_rhs + beta[:, None] * dot(f, keys)
                  + dot(f, keys * beta[:, None], trans_a=True))
            for dk_in_ref in dk_in_refs:
                dk += dk_in_ref[:, cols].astype(f32)
            dk = factor[:, None] * (dk - keys * k_dot_dk[:, None])
            dk_ref[:, cols] = dk.astype(dk_ref.dtype)
            return carry

        column_loop(k_ref, projected_key_block, 0)
        k_dot_share = share_sums[:1] if gates_of_share else []
        _write_row_terms(dbeta_ref, dgamma_ref, beta, live_decay, scale_w, k_dot_p1, k_dot_p2,
                         k_dot_drw, v_dot_dru, k_dot_share, has_g, sub_chunk)
        return

    def key_block(cols, sums):
        k_dot_drw, k_dot_p1, k_dot_p2, *k_dot_share = sums
        keys, cot = k_ref[:, cols].astype(f32), dw_ref[:, cols].astype(f32)
        d_rhs = cot if rhs_cotangents else dot(t_inv, cot, trans_a=True)   # dRw = T^T dw
        p1 = dot(f, keys)
        p2 = dot(f, keys * beta[:, None], trans_a=True)
        dk = scale_w[:, None] * d_rhs + beta[:, None] * p1 + p2
        for i, dk_in_ref in enumerate(dk_in_refs):
            share = dk_in_ref[:, cols].astype(f32)
            dk += share
            if i == 0 and gates_of_share:
                k_dot_share = [k_dot_share[0] + jnp.sum(keys * share, axis=1)]
        if normalized:   # one key block: the row sums k·dk come off the dk tile itself
            dk = key_factor_ref[...][:, None] * (dk - keys * jnp.sum(keys * dk, axis=1)[:, None])
        dk_ref[:, cols] = dk.astype(dk_ref.dtype)
        return (k_dot_drw + jnp.sum(keys * d_rhs, axis=1), k_dot_p1 + jnp.sum(keys * p1, axis=1),
                k_dot_p2 + jnp.sum(keys * p2, axis=1), *k_dot_share)

    k_dot_drw, k_dot_p1, k_dot_p2, *k_dot_share = column_loop(
        k_ref, key_block, (zeros,) * (4 if gates_of_share else 3))
    _write_row_terms(dbeta_ref, dgamma_ref, beta, live_decay, scale_w, k_dot_p1, k_dot_p2,
                     k_dot_drw, v_dot_dru, k_dot_share, has_g, sub_chunk)


def _write_row_terms(dbeta_ref, dgamma_ref, beta, live_decay, scale_w, k_dot_p1, k_dot_p2,
                     k_dot_drw, v_dot_dru, k_dot_share, has_g: bool, sub_chunk: int):
    """dbeta and dgamma from the row sums (k_dot_share: [k·(the walk's share)] or [])."""
    dbeta_ref[...] = k_dot_p1 + v_dot_dru + live_decay * k_dot_drw
    if has_g:
        dgamma = beta * k_dot_p1 - k_dot_p2 + scale_w * k_dot_drw
        if k_dot_share:   # the walk's share: -k_j·dk_j, and their sum at the last position
            is_last = jax.lax.broadcasted_iota(jnp.int32, (sub_chunk,), 0) == sub_chunk - 1
            dgamma += jnp.where(is_last, jnp.sum(k_dot_share[0]), 0.0) - k_dot_share[0]
        dgamma_ref[...] = LN2 * dgamma


def wy_bwd_pallas(k, v, beta, gamma, runs, inverse, dw, du, *, sub_chunk: int, precision=HIGHEST,
                  operand_dtype=None, dk_accumulate: Sequence[jax.Array] = (),
                  out_dtype=jnp.float32, rhs_cotangents: bool = False,
                  walk_share_gates: bool = False, key_factor: Optional[jax.Array] = None,
                  interpret: bool = False, block_sizes: Optional[BlockSizes] = None):
    """(dk [B, P, H, K], dv [B, P, H, V], dbeta [B, P, H], dgamma [B, P, H] or None): the VJP of
    wy_pallas's (w, u) in (k, v, beta, gamma), given cotangents dw, du. dk and dv come in
    ``out_dtype``, dbeta and dgamma in float32.

    k [B, P, H, K], v [B, P, H, V] (one dtype), beta [B, P, H]; gamma [B, P, H] sub-chunk-local
    log2 decays or None (then dgamma is None); runs [B, P] int32 run numbers or None; inverse
    [B, P, H, S] the forward's (I + A)^{-1} per sub-chunk (row j holds T[j, :]); dw [B, P, H, K],
    du [B, P, H, V] in any float dtype. P must be a multiple of ``sub_chunk`` (16, 32 or 64); K and
    V powers of two >= 16 (the caller pads with zeros, as for wy_pallas).

    ``precision`` / ``operand_dtype``: the dots, see the module docstring. ``dk_accumulate``:
    [B, P, H, K] arrays (any float dtype) added to dk in float32 before it is rounded to
    ``out_dtype``, so that the op's other shares of dk cost no separate pass over HBM.
    ``rhs_cotangents``: dw and du are already T^T dw and T^T du, the cotangents of the right-hand
    sides Rw and Ru (the reverse walk that works from T makes them): dA = -mask ∘ ((dRw Rw^T +
    dRu Ru^T) T^T), and five of the fourteen S x S x 64 dots a program at K = V = 128 (T^T du and
    T^T dw over two column blocks each, the outer T^T) are not needed.
    ``walk_share_gates``: the first of ``dk_accumulate`` is the reverse walk's share of dk, whose
    keys enter the carried state weighted by a_j = 2^(gamma_last - gamma_j) (gamma_last: the
    sub-chunk's last position), dk_j = a_j dkd_j; its gate terms, -ln2 k_j·dk_j at j and their
    sum at the last position, are then added to dgamma here, from tiles this kernel loads anyway
    (``chunk_h_bwd_pallas(key_gate_terms=False)`` leaves them out).
    ``key_factor``: [B, P, H] float32 l2norm factors r_j = (|x_j|^2 + eps)^(-1/2) of raw keys x,
    k being their normalised rows k_j = r_j x_j (use_qk_l2norm): dk then comes as the cotangent
    of x, r_j (dk_j - k_j (k_j·dk_j)) with dk_j every share's sum, so that the normalisation's
    VJP costs no pass over HBM of its own. The row sums k_j·dk_j come from the first pass over the
    key columns (the gram K K^T gives k·P1 and k·P2), before any dk block is written.
    """
    batch, positions, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    sizes = block_sizes or BlockSizes()
    if sub_chunk not in (16, 32, 64) or positions % sub_chunk:
        raise ValueError(f"wy_bwd_pallas: sub_chunk must be 16, 32 or 64 and divide P = {positions}; "
                         f"got {sub_chunk}")
    widths = dict(K=key_dim, V=value_dim, block_cols=sizes.block_cols)
    if any(tile_width(n) != n for n in widths.values()):   # powers of two >= 16
        raise ValueError(f"wy_bwd_pallas: {widths} must all be powers of two >= 16")
    if v.dtype != k.dtype or dw.shape != k.shape or du.shape != v.shape:
        raise ValueError("wy_bwd_pallas: k and v must share a dtype, dw match k's shape, du v's")
    dk_accumulate = tuple(dk_accumulate)
    for extra in dk_accumulate:
        if extra.shape != k.shape:
            raise ValueError(f"wy_bwd_pallas: dk_accumulate must match k's shape {k.shape}; "
                             f"got {extra.shape}")
    if walk_share_gates and not dk_accumulate:
        raise ValueError("wy_bwd_pallas: walk_share_gates needs the walk's share of dk as "
                         "dk_accumulate[0]; got no dk_accumulate")
    if key_factor is not None and key_factor.shape != (batch, positions, heads):
        raise ValueError(f"wy_bwd_pallas: key_factor must be [B, P, H] = {(batch, positions, heads)}; "
                         f"got {key_factor.shape}")
    if inverse.shape != (batch, positions, heads, sub_chunk):
        raise ValueError(f"wy_bwd_pallas: inverse must be [B, P, H, S] = "
                         f"{(batch, positions, heads, sub_chunk)}; got {inverse.shape}")
    f32 = jnp.float32
    rows = lambda width: pl.BlockSpec((None, sub_chunk, None, width), lambda hd, s, b: (b, s, hd, 0))
    per_position = pl.BlockSpec((None, sub_chunk, None), lambda hd, s, b: (b, s, hd))
    operands = (k, v, beta, None if gamma is None else gamma.astype(f32),
                None if runs is None else runs.astype(jnp.int32), inverse, dw, du, dk_accumulate,
                None if key_factor is None else key_factor.astype(f32))
    in_specs = (rows(key_dim), rows(value_dim), per_position,
                None if gamma is None else per_position,
                None if runs is None else pl.BlockSpec((None, sub_chunk), lambda hd, s, b: (b, s)),
                rows(sub_chunk), rows(key_dim), rows(value_dim),
                tuple(rows(key_dim) for _ in dk_accumulate),
                None if key_factor is None else per_position)
    out_shape = (jax.ShapeDtypeStruct((batch, positions, heads, key_dim), out_dtype),
                 jax.ShapeDtypeStruct((batch, positions, heads, value_dim), out_dtype),
                 jax.ShapeDtypeStruct((batch, positions, heads), f32),
                 None if gamma is None else jax.ShapeDtypeStruct((batch, positions, heads), f32))
    out_specs = (rows(key_dim), rows(value_dim), per_position,
                 None if gamma is None else per_position)
    if precision == TF32X3 and interpret:
        precision = HIGHEST
    kernel = functools.partial(
        _wy_bwd_kernel, sub_chunk=sub_chunk, block_cols=sizes.block_cols, precision=precision,
        operand_dtype=None if operand_dtype is None else jnp.dtype(operand_dtype),
        rhs_cotangents=rhs_cotangents, walk_share_gates=walk_share_gates)
    return triton_call(kernel, *operands, name="gdp_wy_bwd", grid=(heads, positions // sub_chunk, batch),
                       in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                       num_warps=sizes.num_warps, num_stages=sizes.num_stages, interpret=interpret)
