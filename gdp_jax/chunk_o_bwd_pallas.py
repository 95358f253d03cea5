"""Pallas kernel (Triton lowering) for the backward pass of the chunk-output stage.

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

Structure. One program per (head, chunk, batch row): grid (H, NT, B), heads varying fastest, no
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
the pair mask also requires row t to be real, so 2^(g[t]-g[s]) is only ever formed for real pairs with
s <= t (the exponent is masked before exp2: a padding row has g = 0 and 2^(0 - g[s]) could overflow,
and inf * 0 would leak NaN into real columns of dv and dk).

Variants (``BwdKernelConfig.variant``; one jitted call each, all exact and under the same masking
rules; the others live in ``chunk_o_bwd_pallas_split``, whose docstring has the details):

* ``"fused"`` (this kernel; the default for float32, K or V = 256 and chunk 128, where nothing else
  has been timed; ``bwd_kernel_config`` picks ``"roles"`` elsewhere): one program per chunk does
  everything. Measured on an H200 (bf16, B8 T4096 H16 K=V=128 M2): 1.44 ms, 4.7x the forward, 33 % of
  its bandwidth floor. Compiled offline for sm_90 it needs 255 registers and spills (one 8-warp
  program per SM), mostly for what the copy loop keeps live: hoisted address tensors, P, dq.
* ``"roles"``: one call, several programs per chunk (one per *role*, a subset of the tasks dh, dq,
  dkv; dkv optionally one program per copy, so no copy loop), launched side by side so their common
  inputs come from L2: fused HBM traffic, lighter programs ("dh|dq|dkv/m": 231 registers, no spill at
  4 warps offline, i.e. two programs per SM like the forward).
* ``"split"``: dh in its own call (grid over dh_block_k x dh_block_v blocks), the rest in a roles
  call; q and do are read from HBM twice (+13 %). Issue 3's idea (a) with the dh-only first kernel.
* ``"split_state"``: dh and the carried-state term of dq (float32 [B, T, H, K]) in a first call, the
  copy loop in a second that reads no h (+40 % traffic). Issue 3's idea (a) as first stated.

``benchmarks/tune_chunk_o_bwd.py`` sweeps the variants, roles, warps and stages on a GPU.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gdp_jax._triton_warning import triton_backend_warning_filtered
from gdp_jax.chunk_o_bwd_pallas_split import chunk_o_bwd_split
from gdp_jax.chunk_o_pallas import _load_rows
from gdp_jax.segments import segment_start_rows

_LN2 = math.log(2.0)


VARIANTS = ("fused", "roles", "split", "split_state")


@dataclasses.dataclass(frozen=True)
class BwdKernelConfig:
    """Launch parameters; chosen per shape by ``bwd_kernel_config``.

    ``variant`` picks the structure (module docstring, "Variants"); ``roles`` divides the tasks of
    the "roles" variant, or of the second call of "split" / "split_state", among programs (syntax in
    ``chunk_o_bwd_pallas_split``; "" means the variant's default). block_k, block_v, num_warps and
    num_stages are those of the fused kernel, or of the roles kernel; the ``dh_*`` fields are the
    dh task's blocks and, for split variants, the launch of their dh kernel (0: the field without
    the prefix).
    """
    block_k: int
    block_v: int
    num_warps: int
    num_stages: int
    variant: str = "fused"
    dh_block_k: int = 0
    dh_block_v: int = 0
    dh_num_warps: int = 0
    dh_num_stages: int = 0
    roles: str = ""

    def resolved_roles(self) -> str:
        return self.roles or _DEFAULT_ROLES.get(self.variant, "")


_DEFAULT_ROLES = {"roles": "dh|dq|dkv/m", "split": "dq|dkv/m", "split_state": "dq|dkv/m"}


def bwd_kernel_config(key_dim: int, value_dim: int, chunk_size: int, num_householder: int,
                      itemsize: int = 2) -> BwdKernelConfig:
    """Block and launch sizes for padded (power-of-two) K and V and inputs of ``itemsize`` bytes.

    Block sizes and the fused kernel's launch were not measured on a GPU: they come from compiling
    the kernel's Triton IR offline (pip triton 3.9, sm_90): blocks of at most 128 columns (64 values
    when K = 256; 64 of each for float32 at chunk size 128) keep shared memory within an H200's
    227 KiB, e.g. 48 KiB for bf16 K = V = 128 and 160 KiB for float32 K = V = 256 at chunk 64.
    float32 at chunk 128 with K = 256 still needs ~288 KiB (the forward ~256 KiB there), so
    chunk_o._compiled_kernels_fit sends those calls to the jnp path and they never get here. The
    untimed "fused" cases use 8 warps at chunk >= 64: at 4 warps its register spills roughly
    quadruple at K = V = 128 (offline). The copy loop is not pipelined.

    Variant, measured on an H200 (benchmarks/tune_chunk_o_bwd.py, bf16, chunk 64; RESULTS.md):
    - B=8 T=4096 H=16 K=V=128 M=2: "roles" with roles "dh|dq|dkv" at 4 warps, 1 stage 0.916 ms,
      against 1.445 ms for "fused" at 8 warps (the former default), 0.96-0.98 ms for "dh|dq|dkv/m"
      and 1.02-1.06 ms for "split".
    - B=2 T=16384 H=16 K=V=256 M=2: the same "roles" launch 3.04 ms, against 5.12 ms for "fused"
      at 8 warps (the former default there) and 3.13-3.30 ms for "dh|dq|dkv/m" and "split".
    - B=4 T=8192 H=32 K=V=64 M=2: "fused" at 4 warps, 1 stage 0.93 ms, against 1.13 ms for the
      "roles" launch above and 0.99 ms for "dh+dq|dkv" at 2 stages.
    So 16-bit inputs at chunk <= 64 take "roles" (K or V above 64, up to 256), or the 4-warp
    "fused" kernel when K, V <= 64 at chunk 64; M only changes a loop count. float32 inputs and
    chunk 128 keep "fused" (not timed).
    """
    del num_householder  # copies are processed one after another; M does not change the tiles
    block_k, block_v = min(key_dim, 128), min(value_dim, 128 if key_dim <= 128 else 64)
    if itemsize >= 4 and chunk_size >= 128:
        block_k, block_v = min(key_dim, 64), min(value_dim, 64)
    if itemsize == 2 and chunk_size <= 64:
        if key_dim <= 64 and value_dim <= 64 and chunk_size == 64:
            return BwdKernelConfig(block_k=block_k, block_v=block_v, num_warps=4, num_stages=1)
        return BwdKernelConfig(block_k=block_k, block_v=block_v, num_warps=4, num_stages=1,
                               variant="roles", roles="dh|dq|dkv")
    num_warps = 8 if chunk_size >= 64 else 4
    return BwdKernelConfig(block_k=block_k, block_v=block_v, num_warps=num_warps, num_stages=1)


def _chunk_o_bwd_kernel(*refs, num_householder: int, scale: float, chunk_size: int, tokens: int,
                        block_k: int, block_v: int, has_g: bool, has_segments: bool):
    q_ref, k_ref, v_ref, h_ref, *refs = refs
    g_ref = refs.pop(0) if has_g else None
    start_rows_ref = refs.pop(0) if has_segments else None
    do_ref, dq_ref, dk_ref, dv_ref, dh_ref, *refs = refs
    dg_ref = refs.pop(0) if has_g else None
    assert not refs

    chunk = pl.program_id(1)                                         # grid (H, NT, B)
    t_in_chunk = jax.lax.broadcasted_iota(jnp.int32, (chunk_size,), 0)
    row_valid = chunk * chunk_size + t_in_chunk < tokens            # last chunk may be partial

    key_dim, value_dim = h_ref.shape
    key_blocks = [pl.ds(start, block_k) for start in range(0, key_dim, block_k)]
    value_blocks = [pl.ds(start, block_v) for start in range(0, value_dim, block_v)]
    load_q = lambda kb: _load_rows(q_ref.at[:, kb], row_valid)
    load_do = lambda vb: _load_rows(do_ref.at[:, vb], row_valid)
    dtype = q_ref.dtype                                              # q, k, v and do share it

    # Masks and weights, as in the forward, plus "row t is real" in the pair mask (see docstring).
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 1)
    pair_mask = (cols <= rows) & row_valid[:, None]                  # [t, s]: s <= t, t < T
    row_weight = None                                                # w[t]; None means all ones
    if has_g:
        g = _load_rows(g_ref, row_valid)                             # [BT] f32 log2 decays
        row_weight = jnp.exp2(g)
    if has_segments:
        start_row = _load_rows(start_rows_ref, row_valid)            # [BT] where t's segment begins
        pair_mask &= cols >= start_row[:, None]                      # same(s, t), given s <= t
        live_at_c0 = start_row == 0
        row_weight = (jnp.where(live_at_c0, row_weight, 0.0) if has_g
                      else live_at_c0.astype(jnp.float32))
    if has_g:
        exponent = jnp.where(pair_mask, g[:, None] - g[None, :], 0.0)
        pair_weight = jnp.where(pair_mask, jnp.exp2(exponent), 0.0)  # P [t, s]

    def apply_p(x):                                                  # P ⊙ x for a [BT, BT] tile
        return x * pair_weight if has_g else jnp.where(pair_mask, x, 0.0)

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
    dqs = [scale * dq if row_weight is None else (scale * row_weight)[:, None] * dq for dq in dqs]
    if has_g:                                                        # scale * w[t] * q[t]·(do @ h^T)[t]
        dg = sum(jnp.sum(load_q(kb).astype(jnp.float32) * dq, axis=1) for kb, dq in zip(key_blocks, dqs))

    # Intra-chunk term, one Householder copy per loop step (see the module docstring).
    def one_copy(i, carry):
        dqs, z = carry
        ks = [_load_rows(k_ref.at[:, i, kb], row_valid) for kb in key_blocks]  # [BT, BK] each
        scores = sum(plgpu.dot(load_q(kb), k, trans_b=True) for kb, k in zip(key_blocks, ks))
        scores = apply_p(scores)                                     # S_m = P ⊙ A_m, f32
        scores_lo = scores.astype(dtype)
        dpv = None                                                   # do @ v_m^T, [BT, BT] f32
        for vb in value_blocks:
            do = load_do(vb)
            v = _load_rows(v_ref.at[:, i, vb], row_valid)            # [BT, BV]
            dv = scale * plgpu.dot(scores_lo, do, trans_a=True)      # [BT, BV]
            plgpu.store(dv_ref.at[:, i, vb], dv.astype(dv_ref.dtype), mask=row_valid[:, None])
            term = plgpu.dot(do, v, trans_b=True)                    # [t, s] = do[t]·v_m[s]
            dpv = term if dpv is None else dpv + term
        d_scores = scale * apply_p(dpv)                              # dA_m [t, s]
        d_scores_lo = d_scores.astype(dtype)
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
        z = jnp.where(cols < rows, z, 0.0)                           # Z[t, t] cancels: drop it exactly
        dg = _LN2 * (dg + jnp.sum(z, axis=1) - jnp.sum(z, axis=0))
        plgpu.store(dg_ref, dg, mask=row_valid)


def chunk_o_bwd_pallas(q, k, v, h, g, runs, do, *, scale: float, chunk_size: int,
                       num_householder: int, interpret: bool = False,
                       config: Optional[BwdKernelConfig] = None):
    """(dq, dk, dv, dh, dg): the VJP of ``chunk_o_pallas`` at (q, k, v, h, g) for cotangent ``do``.

    Inputs as for ``chunk_o_pallas`` (validated; K and V powers of two >= 16): q [B, T, H, K];
    k [B, T*M, H, K]; v [B, T*M, H, V] (one dtype for q, k, v); h [B, NT, H, K, V]; g [B, T, H]
    float32 or None; runs [B, T] int32 segment run numbers or None; do [B, T, H, V] in v's dtype.

    Returns dq [B, T, H, K], dk [B, T*M, H, K], dv [B, T*M, H, V] in the dtypes of q, k, v;
    dh [B, NT, H, K, V] in h's dtype; dg [B, T, H] float32, or None when g is None.

    ``config`` overrides ``bwd_kernel_config`` (for tuning and tests); block_v must divide V.
    """
    batch, tokens, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    m = num_householder
    num_chunks = h.shape[1]
    if do.shape != (batch, tokens, heads, value_dim):
        raise ValueError(f"do must have shape {(batch, tokens, heads, value_dim)}; got {do.shape}")
    do = do.astype(v.dtype)
    cfg = config or bwd_kernel_config(key_dim, value_dim, chunk_size, m, jnp.dtype(q.dtype).itemsize)
    if cfg.variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}; got {cfg.variant!r}")
    blocks = [("block_k", cfg.block_k, key_dim), ("block_v", cfg.block_v, value_dim)]
    if cfg.variant != "fused":
        blocks += [("dh_block_k", cfg.dh_block_k or cfg.block_k, key_dim),
                   ("dh_block_v", cfg.dh_block_v or cfg.block_v, value_dim)]
    for name, block, width in blocks:
        if width % block or block < 16 or block & (block - 1):
            raise ValueError(f"{name} must be a power of two >= 16 dividing {width}; got {block}")
    # Segments reach the kernels as each token's start row within its chunk, as in the forward:
    # one value per row makes every mask.
    start_rows = None if runs is None else segment_start_rows(runs, chunk_size)
    if cfg.variant != "fused":
        return chunk_o_bwd_split(
            q, k, v, h, g, start_rows, do, scale=scale, chunk_size=chunk_size, num_householder=m,
            interpret=interpret, variant=cfg.variant, roles=cfg.resolved_roles(),
            block_k=cfg.block_k, block_v=cfg.block_v,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            dh_block_k=cfg.dh_block_k or cfg.block_k, dh_block_v=cfg.dh_block_v or cfg.block_v,
            dh_num_warps=cfg.dh_num_warps or cfg.num_warps,
            dh_num_stages=cfg.dh_num_stages or cfg.num_stages)
    # Heads vary fastest in launch order, so neighbouring programs read neighbouring head slices of
    # the same [BT, H, *] rows (the forward measured this order faster on an H200).
    grid = (heads, num_chunks, batch)

    def token_spec(width):
        # A [BT, width] tile of a [B, T, H, width] array.
        return pl.BlockSpec((None, chunk_size, None, width), lambda hd, c, b: (b, c, hd, 0))

    def copies_spec(width):
        # A [BT, M, width] tile of a [B, T, M, H, width] array (= [B, T*M, H, width] in memory).
        return pl.BlockSpec((None, chunk_size, m, None, width), lambda hd, c, b: (b, c, 0, hd, 0))

    per_token_spec = pl.BlockSpec((None, chunk_size, None), lambda hd, c, b: (b, c, hd))
    state_spec = pl.BlockSpec((None, None, None, key_dim, value_dim), lambda hd, c, b: (b, c, hd, 0, 0))

    operands = [q, k.reshape(batch, tokens, m, heads, key_dim),
                v.reshape(batch, tokens, m, heads, value_dim), h]
    in_specs = [token_spec(key_dim), copies_spec(key_dim), copies_spec(value_dim), state_spec]
    if g is not None:
        operands.append(g)
        in_specs.append(per_token_spec)
    if start_rows is not None:
        operands.append(start_rows)
        in_specs.append(pl.BlockSpec((None, chunk_size), lambda hd, c, b: (b, c)))
    operands.append(do)
    in_specs.append(token_spec(value_dim))

    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, tokens, m, heads, key_dim), k.dtype),
                 jax.ShapeDtypeStruct((batch, tokens, m, heads, value_dim), v.dtype),
                 jax.ShapeDtypeStruct(h.shape, h.dtype)]
    out_specs = [token_spec(key_dim), copies_spec(key_dim), copies_spec(value_dim), state_spec]
    if g is not None:
        out_shape.append(jax.ShapeDtypeStruct((batch, tokens, heads), jnp.float32))
        out_specs.append(per_token_spec)

    kernel = functools.partial(
        _chunk_o_bwd_kernel, num_householder=m, scale=scale, chunk_size=chunk_size, tokens=tokens,
        block_k=cfg.block_k, block_v=cfg.block_v, has_g=g is not None, has_segments=runs is not None)
    call = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="gdp_chunk_o_bwd",
    )
    with triton_backend_warning_filtered():
        outs = call(*operands)
    dq, dk, dv, dh = outs[:4]
    dg = outs[4] if g is not None else None
    return (dq, dk.reshape(batch, tokens * m, heads, key_dim),
            dv.reshape(batch, tokens * m, heads, value_dim), dh, dg)
