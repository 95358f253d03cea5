"""chunk_gdp_fwd_o: the chunk-output stage of Gated DeltaProduct (SPEC.md, "Chunked form").

Public function, its ``jax.custom_vjp`` and the pure-jnp ("xla") path live here; the Pallas kernels
are in ``chunk_o_pallas.py`` (forward) and ``chunk_o_bwd_pallas.py`` (backward). One custom_vjp
covers every implementation: "xla" differentiates the jnp path, "pallas" and "interpret" run the
fused backward kernel, and both compute the exact VJP of SPEC's chunked form.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from gdp_jax import _validation as val
from gdp_jax._chunking import kernel_dtype_supported, kernel_widths_supported, tile_width
from gdp_jax.chunk_o_bwd_pallas import chunk_o_bwd_pallas
from gdp_jax.chunk_o_pallas import chunk_o_pallas
from gdp_jax.segments import segment_runs


def chunk_gdp_fwd_o(q: jax.Array, k: jax.Array, v: jax.Array, h: jax.Array,
                    g: Optional[jax.Array] = None, *, segment_ids: Optional[jax.Array] = None,
                    scale: Optional[float] = None, chunk_size: int = 64,
                    num_householder: Optional[int] = None,
                    implementation: Optional[str] = None) -> jax.Array:
    """Outputs of Gated DeltaProduct from chunk-boundary states and corrected values.

    For token t in chunk c (first token c0 = c*chunk_size), with same(a, b) true when a and b lie
    in one segment::

        o[t] = scale * ( [same(t, c0)] 2^g[t] q[t]·h[c]
                         + sum_{s in [c0, t], same(s, t)} sum_{m<M} 2^(g[t]-g[s]) (q[t]·k[sM+m]) v[sM+m] )

    Args:
      q: [B, T, H, K] queries, on the token stream.
      k: [B, T*M, H, K] keys on the Householder-expanded stream (position t*M + m is step m of t).
      v: [B, T*M, H, V] corrected values v_new, same dtype as q and k.
      h: [B, NT, H, K, V] state before each chunk's first token, NT = ceil(T / chunk_size);
        any float dtype.
      g: [B, T, H] chunk-local cumulative log2 decays (computed in float32), or None for no decay.
      segment_ids: [B, T] integer packing ids, or None; a new segment starts wherever the id
        changes. Not differentiable.
      scale: query scale, default K ** -0.5.
      chunk_size: power of two in [16, 128]; the fixed chunk grid of h and g.
      num_householder: M; inferred from k.shape[1] // T when None, checked when given.
      implementation: "pallas" (Triton kernel on GPU), "xla" (pure jnp, any backend), "interpret"
        (the Pallas kernel in Pallas' interpreter, for CPU tests), or None for "pallas" on a GPU
        backend and "xla" elsewhere. "pallas" runs the jnp path where the compiled kernels' tiles
        would not fit shared memory: K or V above 256, or float32 inputs with K above 128 at
        chunk_size 128.

    Returns:
      o: [B, T, H, V] in v's dtype, accumulated in float32. Differentiable in q, k, v, h and g.
    """
    batch, tokens, heads, key_dim = val.check_float_array("q", q, 4, "B, T, H, K")
    k_positions = val.check_float_array("k", k, 4, "B, T*M, H, K")[1]
    value_dim = val.check_float_array("v", v, 4, "B, T*M, H, V")[3]
    m = val.infer_num_householder(num_householder, tokens, k_positions)
    chunk_size = val.check_chunk_size(chunk_size)
    num_chunks = -(-tokens // chunk_size)
    val.check_shape("k", k, (batch, tokens * m, heads, key_dim), "B, T*M, H, K")
    val.check_shape("v", v, (batch, tokens * m, heads, value_dim), "B, T*M, H, V")
    val.check_float_shape("h", h, (batch, num_chunks, heads, key_dim, value_dim),
                          f"B, NT = ceil(T / chunk_size) = ceil({tokens} / {chunk_size}), H, K, V")
    if g is not None:
        val.check_float_shape("g", g, (batch, tokens, heads), "B, T, H")
    if segment_ids is not None:
        val.check_segment_ids(segment_ids, batch, tokens)
    val.check_same_dtype(q=q, k=k, v=v)
    config = _Config(scale=val.check_scale(scale, key_dim), chunk_size=chunk_size,
                     num_householder=m, implementation=val.resolve_implementation(implementation))
    runs = None if segment_ids is None else segment_runs(jnp.asarray(segment_ids))
    return _chunk_o(q, k, v, h, g, runs, config)


def chunk_o_from_runs(q, k, v, h, g, runs, *, scale: float, chunk_size: int, num_householder: int,
                      implementation: str) -> jax.Array:
    """chunk_gdp_fwd_o for a caller that has already checked its inputs, resolved ``implementation``
    and ``scale``, and turned segment ids into run numbers (``segments.segment_runs``): the full op.
    No checks here; the same custom_vjp."""
    return _chunk_o(q, k, v, h, g, runs, _Config(scale=scale, chunk_size=chunk_size,
                                                  num_householder=num_householder,
                                                  implementation=implementation))


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    chunk_size: int
    num_householder: int
    implementation: str


def _compiled_kernels_fit(dtype, key_dim: int, value_dim: int, chunk_size: int) -> bool:
    """Whether the compiled kernels' tiles fit a GPU's shared memory (an H200's 227 KiB).

    K and V must be within _chunking.KERNEL_MAX_WIDTH (256). And 4-byte inputs with K padded to
    256 at chunk size 128 do not fit: the [128, 256] float32 query and key tiles alone are
    256 KiB; the forward asks for 256 KiB, the backward 288 KiB (their Triton IR compiled offline
    for sm_90a, benchmarks/codegen.py; every other combination of K, V <= 256, chunk size and 2-
    or 4-byte inputs needs at most 192 KiB there). Such calls run the jnp path instead, forward
    and backward, so they return correct results rather than fail at launch. The interpreter has
    no such limit and runs the kernels for every 2- and 4-byte input."""
    if not kernel_widths_supported(key_dim, value_dim):
        return False
    return not (jnp.dtype(dtype).itemsize >= 4 and tile_width(key_dim) > 128 and chunk_size >= 128)


def _resolved(config: _Config, q, v) -> str:
    """config.implementation, with "pallas" turned into "xla" where the kernels do not fit, and
    "pallas" or "interpret" into "xla" for float64 inputs (``kernel_dtype_supported``)."""
    if not kernel_dtype_supported(q.dtype):
        return "xla"
    if config.implementation == "pallas" and not _compiled_kernels_fit(
            q.dtype, q.shape[-1], v.shape[-1], config.chunk_size):
        return "xla"
    return config.implementation


def _forward(q, k, v, h, g, runs, config: _Config):
    g = None if g is None else g.astype(jnp.float32)
    kwargs = dict(scale=config.scale, chunk_size=config.chunk_size,
                  num_householder=config.num_householder)
    if _resolved(config, q, v) == "xla":
        return chunk_o_xla(q, k, v, h, g, runs, **kwargs)
    return _pallas_padded(q, k, v, h, g, runs, interpret=config.implementation == "interpret", **kwargs)


def _pallas_padded(q, k, v, h, g, runs, **kwargs):
    """The forward kernel on K and V zero-padded to Triton tile widths, cut back after."""
    (q, k, v, h), unpad = _pad_to_tiles(q, k, v, h)
    return unpad(value=chunk_o_pallas(q, k, v, h, g, runs, **kwargs))


def _pallas_bwd_padded(q, k, v, h, g, runs, do, **kwargs):
    """The fused backward kernels on K and V zero-padded to Triton tile widths, cut back after."""
    (q, k, v, h, do), unpad = _pad_to_tiles(q, k, v, h, do.astype(v.dtype))
    dq, dk, dv, dh, dg = chunk_o_bwd_pallas(q, k, v, h, g, runs, do, **kwargs)
    return unpad(key=dq), unpad(key=dk), unpad(value=dv), unpad(state=dh), dg


def _pad_to_tiles(q, k, v, h, *value_width_arrays):
    """Zero-pads K and V to powers of two >= 16 (Triton's tile rule); zeros change no dot product.

    Returns the padded (q, k, v, h, *value_width_arrays) and ``unpad(key=|value=|state=x)``, which
    cuts a result with padded K, V or [K, V] trailing axes back to the caller's widths.
    """
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    key_pad, value_pad = tile_width(key_dim) - key_dim, tile_width(value_dim) - value_dim
    pad_last = lambda x, n: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n)]) if n else x
    padded = (pad_last(q, key_pad), pad_last(k, key_pad), pad_last(v, value_pad),
              jnp.pad(h, [(0, 0)] * 3 + [(0, key_pad), (0, value_pad)]) if key_pad or value_pad else h,
              *(pad_last(x, value_pad) for x in value_width_arrays))

    def unpad(key=None, value=None, state=None):
        if key is not None:
            return key[..., :key_dim]
        if value is not None:
            return value[..., :value_dim]
        return state[..., :key_dim, :value_dim]

    return padded, unpad


def chunk_o_xla(q, k, v, h, g, runs, *, scale: float, chunk_size: int,
                num_householder: int) -> jax.Array:
    """The jnp path: SPEC's chunked form as batched einsums over a [B, NT, BT, ...] view.

    Same arguments as ``chunk_o_pallas`` (g float32 or None, runs int32 run numbers or None);
    returns o [B, T, H, V] in v's dtype, accumulated in float32.
    """
    batch, tokens, heads, key_dim = q.shape
    value_dim, m, bt, out_dtype = v.shape[-1], num_householder, chunk_size, v.dtype
    num_chunks = -(-tokens // bt)
    pad = num_chunks * bt - tokens

    def chunked(x, per_token):  # [B, T*per_token, ...] -> [B, NT, BT, per_token, ...], zero-padded
        x = jnp.pad(x, [(0, 0), (0, pad * per_token)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape((batch, num_chunks, bt, per_token) + x.shape[2:])

    if jax.default_backend() == "cpu":
        # XLA:CPU has no bf16 x bf16 -> f32 dot for every layout; f32 operands are exact anyway.
        q, k, v, h = (x.astype(jnp.promote_types(x.dtype, jnp.float32)) for x in (q, k, v, h))
    qc = chunked(q, 1)[:, :, :, 0]                                   # [B, NT, BT, H, K]
    kc, vc = chunked(k, m), chunked(v, m)                            # [B, NT, BT, M, H, *]
    causal = jnp.tril(jnp.ones((bt, bt), bool))                      # [t, s], diagonal included
    # Padding rows t >= T are masked too: their g is 0, so 2^(g[t]-g[s]) could overflow there.
    real_row = (jnp.arange(num_chunks * bt) < tokens).reshape(num_chunks, bt)
    pair_mask = causal & real_row[:, :, None]                        # [NT, t, s]
    pair_mask = jnp.broadcast_to(pair_mask[None, :, None], (batch, num_chunks, 1, bt, bt))
    row_weight = jnp.ones((batch, num_chunks, 1, bt), jnp.float32)    # weight of q[t]·h[c]
    if runs is not None:
        rc = chunked(runs, 1)[:, :, :, 0]                            # [B, NT, BT]
        pair_mask = pair_mask & (rc[:, :, None, :, None] == rc[:, :, None, None, :])
        row_weight = row_weight * (rc == rc[:, :, :1])[:, :, None, :]
    pair_weight = pair_mask.astype(jnp.float32)
    if g is not None:
        gc = jnp.moveaxis(chunked(g, 1)[:, :, :, 0], 3, 2)          # [B, NT, H, BT]
        # where() before exp2 would still differentiate exp2 of the masked entries; mask the
        # exponent instead so no inf (and no NaN gradient) ever appears.
        exponent = jnp.where(pair_mask, gc[..., :, None] - gc[..., None, :], 0.0)
        pair_weight = jnp.where(pair_mask, jnp.exp2(exponent), 0.0)
        row_weight = row_weight * jnp.exp2(gc)

    f32 = jnp.float32
    scores = jnp.einsum("bnthk,bnsmhk->bnhtsm", qc, kc, preferred_element_type=f32)
    intra = jnp.einsum("bnhtsm,bnsmhv->bnthv", scores * pair_weight[..., None], vc,
                       preferred_element_type=f32)
    inter = jnp.einsum("bnthk,bnhkv->bnthv", qc, h, preferred_element_type=f32)
    inter = inter * jnp.moveaxis(row_weight, 2, 3)[..., None]
    o = scale * (inter + intra)
    return o.reshape(batch, num_chunks * bt, heads, value_dim)[:, :tokens].astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _chunk_o(q, k, v, h, g, runs, config):
    return _forward(q, k, v, h, g, runs, config)


def _chunk_o_fwd(q, k, v, h, g, runs, config):
    return _forward(q, k, v, h, g, runs, config), (q, k, v, h, g, runs)


def _chunk_o_bwd(config, residuals, do):
    q, k, v, h, g, runs = residuals
    g32 = None if g is None else g.astype(jnp.float32)
    kwargs = dict(scale=config.scale, chunk_size=config.chunk_size,
                  num_householder=config.num_householder)
    if _resolved(config, q, v) == "xla":
        if g is None:
            _, vjp = jax.vjp(lambda *a: chunk_o_xla(*a, None, runs, **kwargs), q, k, v, h)
            dq, dk, dv, dh = vjp(do)
            dg = None
        else:
            _, vjp = jax.vjp(lambda *a: chunk_o_xla(*a, runs, **kwargs), q, k, v, h, g32)
            dq, dk, dv, dh, dg = vjp(do)
    else:
        dq, dk, dv, dh, dg = _pallas_bwd_padded(q, k, v, h, g32, runs, do,
                                                interpret=config.implementation == "interpret", **kwargs)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dh.astype(h.dtype),
            None if g is None else dg.astype(g.dtype), None)


_chunk_o.defvjp(_chunk_o_fwd, _chunk_o_bwd)
