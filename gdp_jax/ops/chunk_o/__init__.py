"""chunk_gdp_fwd_o: the chunk-output stage of Gated DeltaProduct (SPEC.md, "Chunked form").

The public function and its ``jax.custom_vjp``. The implementations: ``xla.chunk_o_xla`` (jnp,
differentiated by autodiff), ``pallas_fwd.chunk_o_fwd_pallas`` (forward kernel, Triton),
``pallas_bwd.chunk_o_bwd_pallas`` (fused backward kernel, whose docstring derives the VJP), and
on Mosaic GPU ``mosaic_fwd.chunk_o_fwd_mosaic`` and ``mosaic_bwd.chunk_o_bwd_mosaic``. Which one
runs is ``_src.dispatch.chunk_o_implementation``'s rule (``chunk_o_backward_implementation``
for the backward).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from gdp_jax._src import dispatch
from gdp_jax._src import validation as val
from gdp_jax._src.layout import pad_last, pad_state, tile_width
from gdp_jax._src.segments import segment_runs
from gdp_jax.ops.chunk_o.mosaic_bwd import chunk_o_bwd_mosaic
from gdp_jax.ops.chunk_o.mosaic_fwd import chunk_o_fwd_mosaic
from gdp_jax.ops.chunk_o.pallas_bwd import chunk_o_bwd_pallas
from gdp_jax.ops.chunk_o.pallas_fwd import chunk_o_fwd_pallas
from gdp_jax.ops.chunk_o.xla import chunk_o_xla
from gdp_jax.ops.l2norm import l2norm, l2norm_and_factor

__all__ = ["chunk_gdp_fwd_o", "chunk_o", "chunk_o_scaled_forward"]


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
        (the Pallas kernel in Pallas' interpreter, for CPU tests), "mosaic" (Mosaic GPU kernels),
        "mosaic_interpret" (those in Mosaic GPU's interpreter), or None for "pallas" on a GPU
        backend ("mosaic" on a jax without Pallas' Triton lowering) and "xla" elsewhere. "pallas"
        runs the jnp path where the compiled kernels' tiles would not fit shared memory: K or V
        above 256, or float32 inputs with K above 128 at chunk_size 128. "mosaic" runs its
        forward and backward for 16-bit q, k, v with h of the same dtype, chunk_size 64 and
        K, V up to 256, and the "pallas" rule otherwise ("mosaic_interpret": the "interpret"
        rule). "pallas" takes that Mosaic backward too where K, V are at most 128, on
        jax >= 0.11 (measured faster; the Triton forward stays). float64 inputs run the jnp path
        in float64.

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
    runs = None if segment_ids is None else segment_runs(jnp.asarray(segment_ids))
    return chunk_o(q, k, v, h, g, runs, scale=val.check_scale(scale, key_dim),
                   chunk_size=chunk_size, num_householder=m,
                   implementation=dispatch.resolve_implementation(implementation))


def chunk_o(q, k, v, h, g, runs, *, scale: float, chunk_size: int, num_householder: int,
            implementation: str, normalize_queries: bool = False) -> jax.Array:
    """chunk_gdp_fwd_o for a caller that has checked its inputs, resolved ``implementation`` and
    ``scale``, and turned segment ids into run numbers (``segments.segment_runs``), as the full op
    does. No checks; the same custom_vjp.

    ``normalize_queries`` (use_qk_l2norm): the stage takes q L2-normalised per token
    (``ops.l2norm``'s formula). Where ``dispatch.queries_l2norm_vjp_in_chunk_o_kernel`` says so,
    the normalisation is part of the custom_vjp and its VJP runs in the backward kernel; elsewhere
    it is ``ops.l2norm``, a step of its own."""
    config = stage_config(q, v, h.dtype, g is not None, scale=scale, chunk_size=chunk_size,
                          num_householder=num_householder, implementation=implementation,
                          normalize_queries=normalize_queries)
    if normalize_queries and not config.normalize_queries:
        q = l2norm(q, implementation)
    return _chunk_o(q, k, v, h, g, runs, config)


def stage_config(q, v, h_dtype, gated: bool, *, scale: float, chunk_size: int,
                 num_householder: int, implementation: str, normalize_queries: bool = False):
    """The stage's static choices as ``chunk_o`` makes them (the forward's and the backward's
    implementations, and whether q's normalisation is inside the custom_vjp): a hashable config
    for ``STAGE_RULES``. Where normalize_queries is given and the config's is False, the
    caller normalises q first."""
    forward = dispatch.chunk_o_implementation(implementation, q.dtype, q.shape[-1], v.shape[-1],
                                              chunk_size, h_dtype)
    backward = dispatch.chunk_o_backward_implementation(forward, q.dtype, q.shape[-1],
                                                        v.shape[-1], chunk_size, h_dtype)
    in_kernel = normalize_queries and dispatch.queries_l2norm_vjp_in_chunk_o_kernel(
        backward, q.shape[-1], v.shape[-1], gated=gated)
    return _Config(scale=scale, chunk_size=chunk_size, num_householder=num_householder,
                   implementation=forward, backward_implementation=backward,
                   normalize_queries=in_kernel)


def chunk_o_scaled_forward(q, k, v, h, g, runs, q_scale, k_scale, *, scale: float,
                           chunk_size: int, num_householder: int, interpret: bool) -> jax.Array:
    """chunk_o of (q_scale q) and (k_scale k), the factors applied inside the Triton forward
    kernel to its scores and outputs: the full op's undifferentiated forward with use_qk_l2norm
    (``dispatch.l2norm_fused``), the factors being l2norm's. Forward only (no VJP); arguments as
    ``chunk_o`` takes them, g float32 or None, q_scale [B, T, H], k_scale [B, T*M, H]."""
    (q, k, v, h), unpad = _pad_to_tiles(q, k, v, h)
    o = chunk_o_fwd_pallas(q, k, v, h, g, runs, scale=scale, chunk_size=chunk_size,
                           num_householder=num_householder, interpret=interpret,
                           q_scale=q_scale, k_scale=k_scale)
    return unpad(value=o)


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    chunk_size: int
    num_householder: int
    implementation: str            # the forward: dispatch.chunk_o_implementation's answer
    backward_implementation: str   # dispatch.chunk_o_backward_implementation's answer
    normalize_queries: bool = False   # q's l2norm and its VJP inside the custom_vjp (Mosaic bwd)

    def stage_kwargs(self):
        return dict(scale=self.scale, chunk_size=self.chunk_size,
                    num_householder=self.num_householder)


def _forward(q, k, v, h, g, runs, config: _Config):
    g = None if g is None else g.astype(jnp.float32)
    if config.implementation == "xla":
        return chunk_o_xla(q, k, v, h, g, runs, **config.stage_kwargs())
    if config.implementation in ("mosaic", "mosaic_interpret"):
        (q, k, v, h), unpad = _pad_to_tiles(q, k, v, h, width=dispatch.mosaic_padded_width)
        o = chunk_o_fwd_mosaic(q, k, v, h, g, runs,
                               interpret=config.implementation == "mosaic_interpret",
                               **config.stage_kwargs())
        return unpad(value=o)
    (q, k, v, h), unpad = _pad_to_tiles(q, k, v, h)
    o = chunk_o_fwd_pallas(q, k, v, h, g, runs, interpret=config.implementation == "interpret",
                           **config.stage_kwargs())
    return unpad(value=o)


def _backward(q, k, v, h, g, runs, do, config: _Config, q_factor=None):
    """(dq, dk, dv, dh, dg) in float32 or the primals' dtypes; dg None without g. With q_factor
    (the Mosaic backward only) dq is the cotangent of the raw queries whose l2norm rows q are."""
    kwargs, implementation = config.stage_kwargs(), config.backward_implementation
    if implementation == "xla":
        if g is None:
            no_decay = lambda q, k, v, h: chunk_o_xla(q, k, v, h, None, runs, **kwargs)
            return jax.vjp(no_decay, q, k, v, h)[1](do) + (None,)
        decayed = lambda q, k, v, h, g: chunk_o_xla(q, k, v, h, g, runs, **kwargs)
        return jax.vjp(decayed, q, k, v, h, g)[1](do)
    if implementation in ("mosaic", "mosaic_interpret"):
        (q, k, v, h, do), unpad = _pad_to_tiles(q, k, v, h, do.astype(v.dtype),
                                                width=dispatch.mosaic_padded_width)
        dq, dk, dv, dh, dg = chunk_o_bwd_mosaic(q, k, v, h, g, runs, do,
                                                interpret=implementation == "mosaic_interpret",
                                                q_factor=q_factor, **kwargs)
        return unpad(key=dq), unpad(key=dk), unpad(value=dv), unpad(state=dh), dg
    (q, k, v, h, do), unpad = _pad_to_tiles(q, k, v, h, do.astype(v.dtype))
    dq, dk, dv, dh, dg = chunk_o_bwd_pallas(q, k, v, h, g, runs, do,
                                            interpret=implementation == "interpret",
                                            **kwargs)
    return unpad(key=dq), unpad(key=dk), unpad(value=dv), unpad(state=dh), dg


def _pad_to_tiles(q, k, v, h, *value_width_arrays, width=tile_width):
    """Zero-pads K and V to ``width(n)``: powers of two >= 16 by default (Triton's tile rule);
    zeros change no dot product.

    Returns the padded (q, k, v, h, *value_width_arrays) and ``unpad(key=|value=|state=x)``, which
    cuts a result with padded K, V or [K, V] trailing axes back to the caller's widths.
    """
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    kp, vp = width(key_dim), width(value_dim)
    padded = (pad_last(q, kp), pad_last(k, kp), pad_last(v, vp), pad_state(h, kp, vp),
              *(pad_last(x, vp) for x in value_width_arrays))

    def unpad(key=None, value=None, state=None):
        if key is not None:
            return key[..., :key_dim]
        if value is not None:
            return value[..., :value_dim]
        return state[..., :key_dim, :value_dim]

    return padded, unpad


def _normalized_queries(q, config: _Config):
    """(q or its l2norm rows, their factors [B, T, H] float32 or None)."""
    if not config.normalize_queries:
        return q, None
    return l2norm_and_factor(q, dispatch.triton_counterpart(config.backward_implementation))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _chunk_o(q, k, v, h, g, runs, config):
    return _forward(_normalized_queries(q, config)[0], k, v, h, g, runs, config)


def _chunk_o_fwd(q, k, v, h, g, runs, config):
    q, q_factor = _normalized_queries(q, config)
    return _forward(q, k, v, h, g, runs, config), (q, k, v, h, g, runs, q_factor)


def _chunk_o_bwd(config, residuals, do):
    q, k, v, h, g, runs, q_factor = residuals
    g32 = None if g is None else g.astype(jnp.float32)
    dq, dk, dv, dh, dg = _backward(q, k, v, h, g32, runs, do, config, q_factor)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dh.astype(h.dtype),
            None if g is None else dg.astype(g.dtype), None)


_chunk_o.defvjp(_chunk_o_fwd, _chunk_o_bwd)

# For a custom_vjp that contains the stage (the full op's, where the chunk_o kernels read h out of
# the states before every sub-chunk): (primal, forward rule, backward rule), each taking
# (q, k, v, h, g, runs, config) as ``_chunk_o`` does. With h as a [B, NT, S, H, K, V] view
# (``layout.chunk_state_index``) the backward rule's dh is [B, NT, H, K, V].
STAGE_RULES = (_chunk_o, _chunk_o_fwd, _chunk_o_bwd)
