"""Pallas kernel (Triton lowering) for the chunk-output stage of Gated DeltaProduct.

One program computes one (value block, chunk, batch*head) tile of SPEC's chunked form:

    o[t] = scale * ( [same(t, c0)] * 2^g[t] * q[t]·h[c]
                     + sum_{s in [c0, t], same(s, t)} sum_{m < M} 2^(g[t]-g[s]) (q[t]·k[s*M+m]) v_new[s*M+m] )

The query tile is loaded once and reused for the carried-state term and for all M Householder
copies. The M copies of k and v are read straight from the caller's [B, T*M, H, *] arrays: viewed as
[B, T, M*H, *] (a free reshape), copy m of head h is "head" m*H + h, so each copy is one strided
BlockSpec over the same buffer and nothing is transposed or copied in HBM.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Padding rows of the last partial chunk load this run number, which never equals a real one.
_PAD_RUN = jnp.iinfo(jnp.int32).max


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters; chosen per shape by ``kernel_config``."""
    block_v: int
    num_warps: int
    num_stages: int


def kernel_config(key_dim: int, value_dim: int, chunk_size: int, num_householder: int) -> KernelConfig:
    """Block and launch sizes for padded (power-of-two) K and V.

    A whole value row per program when it fits (V <= 128), so q and k are read once per chunk;
    wider V is split to keep the h tile [K, block_v] within one program's registers.
    """
    block_v = value_dim if value_dim * key_dim <= 128 * 128 else max(16, (128 * 64) // key_dim)
    block_v = min(block_v, value_dim)
    tile = chunk_size * max(key_dim, block_v)
    num_warps = 4 if tile <= 64 * 64 else 8
    return KernelConfig(block_v=block_v, num_warps=num_warps, num_stages=2)


def _load_rows(ref, row_valid, other=0):
    """Masked load of a [rows, ...] tile; rows past the end of the sequence read ``other``."""
    mask = row_valid.reshape(row_valid.shape + (1,) * (len(ref.shape) - 1))
    return plgpu.load(ref, mask=mask, other=other)


def _chunk_o_kernel(*refs, num_householder: int, scale: float, chunk_size: int, tokens: int,
                    has_g: bool, has_segments: bool):
    q_ref, *refs = refs
    k_refs, refs = refs[:num_householder], refs[num_householder:]
    v_refs, refs = refs[:num_householder], refs[num_householder:]
    h_ref, *refs = refs
    g_ref = refs.pop(0) if has_g else None
    runs_ref = refs.pop(0) if has_segments else None
    (o_ref,) = refs

    chunk = pl.program_id(1)
    t_in_chunk = jax.lax.broadcasted_iota(jnp.int32, (chunk_size,), 0)
    row_valid = chunk * chunk_size + t_in_chunk < tokens           # last chunk may be partial

    q = _load_rows(q_ref, row_valid)                                # [BT, K], read once
    state = h_ref[...]                                              # [K, BV]
    dot_dtype = jnp.promote_types(q.dtype, state.dtype)

    # Carried-state term: [same(t, c0)] * 2^g[t] * q[t]·h[c], the row weight applied in f32.
    o = plgpu.dot(q.astype(dot_dtype), state.astype(dot_dtype))       # [BT, BV] f32
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 1)
    pair_mask = cols <= rows                                        # s <= t, diagonal included
    row_weight = None
    if has_g:
        g = _load_rows(g_ref, row_valid)                            # [BT] f32 log2 decays
        row_weight = jnp.exp2(g)
    if has_segments:
        run = _load_rows(runs_ref, row_valid, other=_PAD_RUN)       # [BT] run numbers
        pair_mask &= run[:, None] == run[None, :]                   # same(s, t)
        live_at_c0 = run == jnp.min(run)                            # runs never decrease along T
        row_weight = (jnp.where(live_at_c0, row_weight, 0.0) if has_g
                      else live_at_c0.astype(jnp.float32))
    if row_weight is not None:
        o = o * row_weight[:, None]

    # Intra-chunk term, all M Householder copies against the one query tile.
    if has_g:
        pair_weight = jnp.where(pair_mask, jnp.exp2(g[:, None] - g[None, :]), 0.0)
    for k_ref, v_ref in zip(k_refs, v_refs):
        k = _load_rows(k_ref, row_valid)                            # [BT, K]
        v = _load_rows(v_ref, row_valid)                            # [BT, BV]
        scores = plgpu.dot(q, k, trans_b=True)                         # [BT, BT] f32, q[t]·k[s]
        scores = scores * pair_weight if has_g else jnp.where(pair_mask, scores, 0.0)
        o += plgpu.dot(scores.astype(v.dtype), v)

    plgpu.store(o_ref, (scale * o).astype(o_ref.dtype), mask=row_valid[:, None])


def chunk_o_pallas(q, k, v, h, g, runs, *, scale: float, chunk_size: int, num_householder: int,
                   interpret: bool = False) -> jax.Array:
    """o [B, T, H, V] from validated inputs; K and V must be powers of two >= 16.

    q [B, T, H, K]; k [B, T*M, H, K]; v [B, T*M, H, V] (same dtype as q and k); h [B, NT, H, K, V];
    g [B, T, H] float32 or None; runs [B, T] int32 segment run numbers or None.
    """
    batch, tokens, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    m = num_householder
    num_chunks = h.shape[1]
    cfg = kernel_config(key_dim, value_dim, chunk_size, m)
    block_v = cfg.block_v
    grid = (pl.cdiv(value_dim, block_v), num_chunks, batch * heads)  # value blocks vary fastest

    def token_spec(block_width, copy=0, blocked_width=True):
        # A [BT, block_width] tile of a [B, T, M*H, width] array: copy `copy` of head h is
        # "head" copy*H + h. Only value-width operands are split into value blocks.
        return pl.BlockSpec((None, chunk_size, None, block_width),
                            lambda vb, c, bh: (bh // heads, c, copy * heads + bh % heads,
                                               vb if blocked_width else 0))

    k_copies = k.reshape(batch, tokens, m * heads, key_dim)
    v_copies = v.reshape(batch, tokens, m * heads, value_dim)
    operands = [q] + [k_copies] * m + [v_copies] * m + [h]
    in_specs = ([token_spec(key_dim, blocked_width=False)]
                + [token_spec(key_dim, i, blocked_width=False) for i in range(m)]
                + [token_spec(block_v, i) for i in range(m)]
                + [pl.BlockSpec((None, None, None, key_dim, block_v),
                                lambda vb, c, bh: (bh // heads, c, bh % heads, 0, vb))])
    if g is not None:
        operands.append(g)
        in_specs.append(pl.BlockSpec((None, chunk_size, None), lambda vb, c, bh: (bh // heads, c, bh % heads)))
    if runs is not None:
        operands.append(runs)
        in_specs.append(pl.BlockSpec((None, chunk_size), lambda vb, c, bh: (bh // heads, c)))

    kernel = functools.partial(
        _chunk_o_kernel, num_householder=m, scale=scale, chunk_size=chunk_size, tokens=tokens,
        has_g=g is not None, has_segments=runs is not None)
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, tokens, heads, value_dim), v.dtype),
        grid=grid,
        in_specs=in_specs,
        out_specs=token_spec(block_v),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="gdp_chunk_o_fwd",
    )
    with warnings.catch_warnings():
        # jax >= 0.11 flags the Triton backend as deprecated; it is the backend this kernel targets.
        # Filtered here only, around our own call (see README, "Warnings").
        warnings.filterwarnings("ignore", message=r".*[Tt]riton.*", category=DeprecationWarning)
        return call(*operands)
