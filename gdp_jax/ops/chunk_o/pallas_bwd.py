"""Pallas kernels (Triton lowering): the backward of chunk_gdp_fwd_o.

The exact VJP of SPEC's chunked form, derived here so the kernel can be checked against it line by line.

Forward, per chunk c (first token c0 = c*BT), batch row and head; t, s index the chunk's tokens,
m < M the Householder copies (k_m[s] = k[s*M + m], v_m[s] = v[s*M + m]); h = h[c] is [K, V]:

    w[t]      = [same(t, c0)] * 2^g[t]                                row weight of the carried state
    P[t, s]   = [s <= t, same(s, t)] * 2^(g[t] - g[s])                 intra-chunk decay mask
    A_m[t, s] = q[t]·k_m[s]                                            scores, recomputed in the backward
    o[t]      = scale * ( w[t] (q[t] @ h) + sum_m sum_s P[t, s] A_m[t, s] v_m[s] )

o is linear in h, in each v_m, and bilinear in (q, k_m) through A_m, so with do = dL/do [BT, V]:

    dh     = scale * (w ⊙ q)^T @ do                                    [K, V]
    dv_m   = scale * (P ⊙ A_m)^T @ do                                  [BT, V]
    dA_m   = scale * P ⊙ (do @ v_m^T)                                  [BT, BT], dL/dA_m
    dq     = scale * w ⊙ (do @ h^T) + sum_m dA_m @ k_m                 [BT, K]
    dk_m   = dA_m^T @ q                                                [BT, K]

g enters only through powers of two, d(2^x)/dx = ln2 * 2^x: w[t] through g[t], P[t, s] through
g[t] - g[s]. So dL = sum_t ln2 w[t] (dL/dw[t]) dg[t] + sum_{t,s} ln2 P[t, s] (dL/dP[t, s]) (dg[t] - dg[s]),
where dL/dw[t] = scale * do[t]·(q[t] @ h) and dL/dP[t, s] = scale * sum_m A_m[t, s] (do[t]·v_m[s]).
With Z[t, s] = P[t, s] dL/dP[t, s] (= sum_m A_m ⊙ dA_m) and dpv_m = do @ v_m^T:

    Z[t, s] = scale * sum_m (P ⊙ A_m)[t, s] dpv_m[t, s]
    dg[t]   = ln2 * ( scale * w[t] * (do[t]·(q[t] @ h))  +  sum_s Z[t, s]  -  sum_t' Z[t', t] )

The diagonal s = t contributes to both sums and cancels, as it must (2^(g[t]-g[t]) = 1); the kernel
drops it from Z before summing, which is exact and spares dg a cancellation of two large terms when the
decays are strong (dg then is small next to Z[t, t]). The first term is also q[t]·(do @ h^T)[t], which
reuses the dq product instead of forming q @ h.

Structure of the fused kernel. One program per (head, chunk, batch row): grid (H, NT, B), heads varying fastest, no
atomics; each program reads its chunk's inputs and writes its chunk's cotangents, nothing else. K and V
are walked in static blocks of ``block_k`` / ``block_v`` columns (one block each for K, V <= 128).
Tiles are loaded where they are used: q and do are read again by later dots (from L1/L2, as the program
just read them) rather than held, which keeps them out of shared memory in between (Triton otherwise
keeps one shared copy per operand layout alive for the whole kernel, too much for float32 at K = 256).
With w, P and the masks formed from g and the segment start rows (``segments.segment_start_rows``):

    carried state, per (key, value) block:  dh[kb, vb] = scale * (w ⊙ q[:, kb])^T @ do[:, vb]   (stored)
                                            dq[:, kb] += do[:, vb] @ h[kb, vb]^T        [BT, BK] f32
                                            dq = scale * w ⊙ dq,  dg = rowsum(q ⊙ dq)
    then a loop over copies m < M:          S_m = P ⊙ sum_kb q[:, kb] @ k_m[:, kb]^T    [BT, BT] f32
      per value block:                      dv_m[:, vb] = scale * S_m^T @ do[:, vb]     (stored)
                                            dpv_m      += do[:, vb] @ v_m[:, vb]^T      [BT, BT] f32
                                            dA_m = scale * P ⊙ dpv_m
      per key block:                        dq[:, kb] += dA_m @ k_m[:, kb]
                                            dk_m[:, kb] = dA_m^T @ q[:, kb]             (stored)
                                            Z += S_m ⊙ scale * dpv_m
    finally                                 dq stored;  dg = ln2 * (dg + rowsum(Z) - colsum(Z)), Z
                                            strictly below the diagonal.

The copy loop is a real loop (lax.fori_loop, carrying dq and Z), not unrolled, so the compiler cannot
hoist later copies' loads and hold several copies' tiles at once. All accumulation is float32; dot
operands are cast to the primal dtype (as the forward does), so bf16 inputs run bf16 tensor-core dots
and float32 inputs tf32 ones.

Layouts: the caller's native arrays, no transposes or copies in HBM. k, v, dk and dv ([B, T*M, H, *])
are viewed as [B, T, M, H, *] (a free reshape): a program's block is [BT, M, width] and copy m is the
[BT, width] tile at index m of the M axis (the forward's M-BlockSpecs trick works for inputs only, as a
program owns exactly one block of each output).

The last chunk may be partial: rows past T load zeros (start row 0) and are never stored, and
the pair mask also requires row t to be real, so P is nonzero only for real pairs with s <= t (a
padding row has g = 0 and 2^(0 - g[s]) could overflow; the mask's select drops it before any
product, so no inf * 0 leaks NaN into real columns of dv and dk).

The split kernel divides one chunk's work among three programs, launched side by side (grid
(3, H, NT, B), the role fastest) so their common inputs come from L2 rather than HBM:

    role 0, dh:   dh = scale (w ⊙ q)^T do                                       reads q, do
    role 1, dq:   dq = scale w ⊙ (do @ h^T) + sum_m dA_m @ k_m;  dg += q·(state term)
                                                                            reads q, k, v, h, do
    role 2, dkv:  dv_m = scale S_m^T @ do,  dk_m = dA_m^T @ q;  dg += rowsum(Z) - colsum(Z)
                                                                            reads q, k, v, do

Roles are ``pl.when`` branches of one kernel; roles 1 and 2 each form dpv_m and dA_m. Their dg
parts go to two slots of a [2, B, T, H] float32 array that the caller sums. The lighter programs
hold fewer registers than the fused one (which spills), so more of them run per SM. The same sums
in float32 as the fused kernel, up to summation order: Z is kept as its row and column sums, and
tiles are loaded where they are used (from L1/L2).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gdp_jax._src.pallas import (plgpu, LN2, apply_pair_weight, chunk_weights, index, load_rows,
                                 row_validity, triton_call)
from gdp_jax._src.layout import chunk_state_index, compact_state_shape
from gdp_jax._src.segments import segment_start_rows


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Launch parameters of the backward; ``default_block_sizes`` picks them per shape."""
    block_k: int          # key columns per static block
    block_v: int          # value columns per static block
    num_warps: int
    num_stages: int = 1
    split: bool = False   # three programs per chunk (dh | dq | dk, dv) instead of the fused one

    def check(self, key_dim: int, value_dim: int) -> None:
        for name, block, width in (("block_k", self.block_k, key_dim),
                                   ("block_v", self.block_v, value_dim)):
            if width % block or block < 16 or block & (block - 1):
                raise ValueError(f"{name} must be a power of two >= 16 dividing {width}; got {block}")


def default_block_sizes(key_dim: int, value_dim: int, chunk_size: int,
                        itemsize: int = 2, gated: bool = True) -> BlockSizes:
    """The launch table for padded (power-of-two) K and V, inputs of ``itemsize`` bytes and g given
    (``gated``) or None; M only changes a loop count. RESULTS.md, "chunk_o backward launch table":

    | shape class | choice | why |
    |---|---|---|
    | 16-bit, chunk 64, K, V <= 64 | fused, 4 warps | the split launch was slower there |
    | 16-bit, chunk <= 64, otherwise | split, 4 warps | the fused program spills; lighter programs run two per SM |
    | the same at chunk 64, K = 256, gated | 64-wide key blocks | 0.94x the 128-wide ones (ungated 1.22x: not there) |
    | float32 or chunk 128 | fused, 8 warps at chunk >= 64 | not timed; 4 warps quadruple the spills offline |

    Blocks: at most 128 columns (64 values when K = 256; 64 of each for float32 at chunk 128), from
    the kernels' shared memory in offline sm_90a builds.
    """
    block_k, block_v = min(key_dim, 128), min(value_dim, 128 if key_dim <= 128 else 64)
    if itemsize >= 4 and chunk_size >= 128:
        block_k, block_v = min(key_dim, 64), min(value_dim, 64)
    if itemsize == 2 and chunk_size <= 64:
        small = key_dim <= 64 and value_dim <= 64 and chunk_size == 64
        if key_dim > 128 and chunk_size == 64 and gated:
            block_k = 64
        return BlockSizes(block_k, block_v, num_warps=4, split=not small)
    return BlockSizes(block_k, block_v, num_warps=8 if chunk_size >= 64 else 4)


def _blocks(width: int, block: int):
    return [pl.ds(start, block) for start in range(0, width, block)]


def _fused_kernel(q_ref, k_ref, v_ref, h_ref, g_ref, start_rows_ref, do_ref,
                  dq_ref, dk_ref, dv_ref, dh_ref, dg_ref, *, num_householder: int, scale: float,
                  chunk_size: int, tokens: int, block_k: int, block_v: int):
    row_valid = row_validity(pl.program_id(1), chunk_size, tokens)     # grid (H, NT, B)
    key_dim, value_dim = h_ref.shape
    key_blocks, value_blocks = _blocks(key_dim, block_k), _blocks(value_dim, block_v)
    load_q = lambda kb: load_rows(q_ref.at[:, kb], row_valid)
    load_do = lambda vb: load_rows(do_ref.at[:, vb], row_valid)
    dtype = q_ref.dtype                                              # q, k, v and do share it
    has_g = g_ref is not None
    row_weight, pair_mask, pair_weight = chunk_weights(
        None if g_ref is None else load_rows(g_ref, row_valid),
        None if start_rows_ref is None else load_rows(start_rows_ref, row_valid),
        chunk_size, row_valid)
    apply_p = lambda x: apply_pair_weight(x, pair_mask, pair_weight)

    # Carried-state term: dh = scale (w ⊙ q)^T do; dq and dg get scale * w ⊙ (do @ h^T).
    state_dtype = jnp.promote_types(dtype, h_ref.dtype)
    dqs = [None] * len(key_blocks)                                   # do @ h^T, [BT, BK] f32 each
    for vb in value_blocks:
        do = load_do(vb)
        for j, kb in enumerate(key_blocks):
            q = load_q(kb)
            wq = q if row_weight is None else (q * row_weight[:, None]).astype(dtype)
            dh = scale * plgpu.dot(wq, do, trans_a=True)             # [BK, BV]
            plgpu.store(dh_ref.at[kb, vb], dh.astype(dh_ref.dtype))
            state = h_ref[kb, vb].astype(state_dtype)                # [BK, BV]
            term = plgpu.dot(do.astype(state_dtype), state, trans_b=True)
            dqs[j] = term if dqs[j] is None else dqs[j] + term
    dqs = [_weighted(dq, row_weight, scale) for dq in dqs]
    if has_g:                                                        # scale w[t] q[t]·(do @ h^T)[t]
        dg = sum(jnp.sum(load_q(kb).astype(jnp.float32) * dq, axis=1) for kb, dq in zip(key_blocks, dqs))

    def one_copy(i, carry):
        dqs, z = carry
        ks = [load_rows(k_ref.at[:, i, kb], row_valid) for kb in key_blocks]   # [BT, BK] each
        scores = apply_p(sum(plgpu.dot(load_q(kb), k, trans_b=True)
                             for kb, k in zip(key_blocks, ks)))      # S_m = P ⊙ A_m, f32
        scores_lo = scores.astype(dtype)
        dpv = None                                                   # do @ v_m^T, [BT, BT] f32
        for vb in value_blocks:
            do = load_do(vb)
            v = load_rows(v_ref.at[:, i, vb], row_valid)             # [BT, BV]
            dv = scale * plgpu.dot(scores_lo, do, trans_a=True)      # [BT, BV]
            plgpu.store(dv_ref.at[:, i, vb], dv.astype(dv_ref.dtype), mask=row_valid[:, None])
            term = plgpu.dot(do, v, trans_b=True)                    # [t, s] = do[t]·v_m[s]
            dpv = term if dpv is None else dpv + term
        d_scores_lo = (scale * apply_p(dpv)).astype(dtype)           # dA_m [t, s]
        new_dqs = []
        for j, kb in enumerate(key_blocks):
            new_dqs.append(dqs[j] + plgpu.dot(d_scores_lo, ks[j]))  # [BT, BK]
            dk = plgpu.dot(d_scores_lo, load_q(kb), trans_a=True)    # [BT, BK]
            plgpu.store(dk_ref.at[:, i, kb], dk.astype(dk_ref.dtype), mask=row_valid[:, None])
        if has_g:
            z = z + scores * (scale * dpv)                           # S_m ⊙ scale (do @ v_m^T)
        return tuple(new_dqs), z

    z = jnp.zeros((chunk_size, chunk_size), jnp.float32) if has_g else None
    carry = (tuple(dqs), z)
    if num_householder == 1:
        dqs, z = one_copy(jnp.int32(0), carry)
    else:
        dqs, z = jax.lax.fori_loop(0, num_householder, one_copy, carry)

    for kb, dq in zip(key_blocks, dqs):
        plgpu.store(dq_ref.at[:, kb], dq.astype(dq_ref.dtype), mask=row_valid[:, None])
    if has_g:
        rows = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 0)
        cols = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 1)
        z = jnp.where(cols < rows, z, 0.0)                           # Z[t, t] cancels: drop it exactly
        dg = LN2 * (dg + jnp.sum(z, axis=1) - jnp.sum(z, axis=0))
        plgpu.store(dg_ref, dg, mask=row_valid)


def _weighted(x, row_weight, scale):
    """scale * w[:, None] * x, float32."""
    return scale * x if row_weight is None else (scale * row_weight)[:, None] * x


def _split_kernel(q_ref, k_ref, v_ref, h_ref, g_ref, start_rows_ref, do_ref,
                  dq_ref, dk_ref, dv_ref, dh_ref, dg_ref, *, num_householder: int, scale: float,
                  chunk_size: int, tokens: int, block_k: int, block_v: int):
    """One (role, head, chunk, batch) program; dg_ref is this role's [BT] slot (roles 1 and 2)."""
    row_valid = row_validity(pl.program_id(2), chunk_size, tokens)     # grid (3, H, NT, B)
    traced_zero = index(0 * pl.program_id(0))                        # formed outside any branch
    key_dim, value_dim = q_ref.shape[-1], do_ref.shape[-1]
    key_blocks, value_blocks = _blocks(key_dim, block_k), _blocks(value_dim, block_v)
    load_q = lambda kb: load_rows(q_ref.at[:, kb], row_valid)
    load_do = lambda vb: load_rows(do_ref.at[:, vb], row_valid)
    dtype = q_ref.dtype                                              # q, k, v and do share it
    row_mask = row_valid[:, None]
    has_g = g_ref is not None
    load_g = lambda: None if g_ref is None else load_rows(g_ref, row_valid)
    load_start = lambda: None if start_rows_ref is None else load_rows(start_rows_ref, row_valid)

    def copy_loop(do_dq: bool, dqs):
        """The loop over copies m for role dq (do_dq) or dkv; returns (dq blocks, Z row sums,
        Z column sums)."""
        _, pair_mask, pair_weight = chunk_weights(load_g(), load_start(), chunk_size, row_valid)
        apply_p = lambda x: apply_pair_weight(x, pair_mask, pair_weight)
        with_z = not do_dq and has_g
        if with_z:
            rows = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 0)
            cols = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 1)
            strictly_lower = cols < rows

        def one_copy(i, carry):
            dqs, z_row, z_col = carry
            load_k = lambda kb: load_rows(k_ref.at[:, i, kb], row_valid)
            dpv = None                                               # do @ v_m^T [BT, BT] f32
            for vb in value_blocks:
                term = plgpu.dot(load_do(vb), load_rows(v_ref.at[:, i, vb], row_valid), trans_b=True)
                dpv = term if dpv is None else dpv + term
            if not do_dq:
                scores = apply_p(sum(plgpu.dot(load_q(kb), load_k(kb), trans_b=True)
                                     for kb in key_blocks))          # S_m
                if with_z:                                           # Z_m, strictly below the diagonal
                    z = jnp.where(strictly_lower, scores * (scale * dpv), 0.0)
                    z_row = z_row + jnp.sum(z, axis=1)
                    z_col = z_col + jnp.sum(z, axis=0)
                scores_lo = scores.astype(dtype)
            d_scores_lo = (scale * apply_p(dpv)).astype(dtype)       # dA_m
            if do_dq:
                return tuple(dq + plgpu.dot(d_scores_lo, load_k(kb))
                             for kb, dq in zip(key_blocks, dqs)), z_row, z_col
            for vb in value_blocks:
                dv = scale * plgpu.dot(scores_lo, load_do(vb), trans_a=True)        # [BT, BV]
                plgpu.store(dv_ref.at[:, i, vb], dv.astype(dv_ref.dtype), mask=row_mask)
            for kb in key_blocks:
                dk = plgpu.dot(d_scores_lo, load_q(kb), trans_a=True)               # [BT, BK]
                plgpu.store(dk_ref.at[:, i, kb], dk.astype(dk_ref.dtype), mask=row_mask)
            return dqs, z_row, z_col

        zeros = jnp.zeros((chunk_size,), jnp.float32) if with_z else None
        carry = (tuple(dqs) if do_dq else (), zeros, zeros)
        if num_householder == 1:
            # A static copy index as a traced scalar: a literal index inside a pl.when branch
            # trips the interpreter; on the GPU the zero folds away.
            return one_copy(traced_zero, carry)
        return jax.lax.fori_loop(0, num_householder, one_copy, carry)

    def dh_role():
        row_weight, _, _ = chunk_weights(load_g(), load_start(), chunk_size)
        for kb in key_blocks:
            q = load_q(kb)
            wq = q if row_weight is None else (q * row_weight[:, None]).astype(dtype)
            for vb in value_blocks:
                dh = scale * plgpu.dot(wq, load_do(vb), trans_a=True)             # [BK, BV]
                plgpu.store(dh_ref.at[kb, vb], dh.astype(dh_ref.dtype))

    def dq_role():
        row_weight, _, _ = chunk_weights(load_g(), load_start(), chunk_size)
        state_dtype = jnp.promote_types(dtype, h_ref.dtype)
        dqs = [None] * len(key_blocks)
        for vb in value_blocks:
            do = load_do(vb).astype(state_dtype)
            for j, kb in enumerate(key_blocks):
                term = plgpu.dot(do, h_ref[kb, vb].astype(state_dtype), trans_b=True)
                dqs[j] = term if dqs[j] is None else dqs[j] + term
        dqs = [_weighted(dq, row_weight, scale) for dq in dqs]       # scale w ⊙ (do @ h^T)
        if has_g:
            dg = sum(jnp.sum(load_q(kb).astype(jnp.float32) * dq, axis=1)
                     for kb, dq in zip(key_blocks, dqs))
        dqs, _, _ = copy_loop(True, dqs)
        for kb, dq in zip(key_blocks, dqs):
            plgpu.store(dq_ref.at[:, kb], dq.astype(dq_ref.dtype), mask=row_mask)
        if has_g:
            plgpu.store(dg_ref, LN2 * dg, mask=row_valid)

    def dkv_role():
        _, z_row, z_col = copy_loop(False, None)
        if has_g:
            plgpu.store(dg_ref, LN2 * (z_row - z_col), mask=row_valid)

    role = pl.program_id(0)
    for r, body in enumerate((dh_role, dq_role, dkv_role)):
        pl.when(role == r)(body)


def chunk_o_bwd_pallas(q, k, v, h, g, runs, do, *, scale: float, chunk_size: int,
                       num_householder: int, interpret: bool = False,
                       block_sizes: Optional[BlockSizes] = None):
    """(dq, dk, dv, dh, dg): the VJP of ``chunk_o_fwd_pallas`` at (q, k, v, h, g) for cotangent do.

    Inputs as for ``chunk_o_fwd_pallas`` (validated; K and V powers of two >= 16): q [B, T, H, K];
    k [B, T*M, H, K]; v [B, T*M, H, V] (one dtype for q, k, v); h [B, NT, H, K, V] or its
    [B, NT, S, H, K, V] view (``layout.chunk_state_index``); g [B, T, H]
    float32 or None; runs [B, T] int32 segment run numbers or None; do [B, T, H, V].

    Returns dq [B, T, H, K], dk [B, T*M, H, K], dv [B, T*M, H, V] in the dtypes of q, k, v;
    dh [B, NT, H, K, V] in h's dtype; dg [B, T, H] float32, or None when g is None.
    ``block_sizes`` overrides the launch table (``default_block_sizes``), for tuning.
    """
    batch, tokens, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    m = num_householder
    num_chunks = h.shape[1]
    if do.shape != (batch, tokens, heads, value_dim):
        raise ValueError(f"do must have shape {(batch, tokens, heads, value_dim)}; got {do.shape}")
    do = do.astype(v.dtype)
    sizes = block_sizes or default_block_sizes(key_dim, value_dim, chunk_size,
                                               jnp.dtype(q.dtype).itemsize, gated=g is not None)
    sizes.check(key_dim, value_dim)
    start_rows = None if runs is None else segment_start_rows(runs, chunk_size)

    # Heads vary fastest in launch order (after the role, in the split kernel), so neighbouring
    # programs read neighbouring head slices of the same [BT, H, *] rows.
    roles = (3,) if sizes.split else ()
    grid = roles + (heads, num_chunks, batch)
    skip_role = (lambda f: lambda r, hd, c, b: f(hd, c, b)) if sizes.split else (lambda f: f)
    spec = lambda shape, f: pl.BlockSpec(shape, skip_role(f))
    token_spec = lambda width: spec((None, chunk_size, None, width), lambda hd, c, b: (b, c, hd, 0))
    # A [BT, M, width] tile of a [B, T, M, H, width] array (= [B, T*M, H, width] in memory).
    copies_spec = lambda width: spec((None, chunk_size, m, None, width),
                                     lambda hd, c, b: (b, c, 0, hd, 0))
    per_token_spec = spec((None, chunk_size, None), lambda hd, c, b: (b, c, hd))
    state_spec = spec((None, None, None, key_dim, value_dim), lambda hd, c, b: (b, c, hd, 0, 0))
    h_spec = spec((None,) * (h.ndim - 2) + (key_dim, value_dim),
                  lambda hd, c, b: chunk_state_index(h.ndim, b, c, hd) + (0, 0))

    operands = (q, k.reshape(batch, tokens, m, heads, key_dim),
                v.reshape(batch, tokens, m, heads, value_dim), h, g, start_rows, do)
    in_specs = (token_spec(key_dim), copies_spec(key_dim), copies_spec(value_dim), h_spec,
                None if g is None else per_token_spec,
                None if runs is None else spec((None, chunk_size), lambda hd, c, b: (b, c)),
                token_spec(value_dim))
    if g is None:
        dg_shape = dg_spec = None
    elif sizes.split:   # one slot per role that writes dg (dq, dkv); dh maps onto slot 0, unwritten
        dg_shape = jax.ShapeDtypeStruct((2, batch, tokens, heads), jnp.float32)
        dg_spec = pl.BlockSpec((None, None, chunk_size, None),
                               lambda r, hd, c, b: (jnp.maximum(r - 1, 0), b, c, hd))
    else:
        dg_shape = jax.ShapeDtypeStruct((batch, tokens, heads), jnp.float32)
        dg_spec = per_token_spec
    out_shape = (jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, tokens, m, heads, key_dim), k.dtype),
                 jax.ShapeDtypeStruct((batch, tokens, m, heads, value_dim), v.dtype),
                 jax.ShapeDtypeStruct(compact_state_shape(h), h.dtype), dg_shape)
    out_specs = (token_spec(key_dim), copies_spec(key_dim), copies_spec(value_dim), state_spec,
                 dg_spec)
    kernel = functools.partial(
        _split_kernel if sizes.split else _fused_kernel, num_householder=m, scale=scale,
        chunk_size=chunk_size, tokens=tokens, block_k=sizes.block_k, block_v=sizes.block_v)
    dq, dk, dv, dh, dg = triton_call(
        kernel, *operands, name="gdp_chunk_o_bwd_split" if sizes.split else "gdp_chunk_o_bwd",
        grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        num_warps=sizes.num_warps, num_stages=sizes.num_stages, interpret=interpret)
    if dg is not None and sizes.split:
        dg = jnp.sum(dg, axis=0)
    return (dq, dk.reshape(batch, tokens * m, heads, key_dim),
            dv.reshape(batch, tokens * m, heads, value_dim), dh, dg)
