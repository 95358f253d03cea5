"""chunk_gated_delta_product: the full Gated DeltaProduct op, its stages composed in one place.

    g_raw --(1) cumsum.chunk_local_log2_cumsum--> g (chunk-local log2 decays)
    k, v, beta, g --(2) wy.wy_xla--> w, u            (WY representation of each chunk)
    k, w, u, g, initial_state --(3) chunk_h.chunk_h--> h, v_new, final_state
    q, k, v_new, h, g --(4) chunk_o.chunk_gdp_fwd_o--> o

Stages 1-2 are jnp on every backend (exact gradients by autodiff). Stage 3 is a custom_vjp whose
forward is the jnp scan or the Pallas kernel (chunk_h_pallas.py; "interpret" always, "pallas" once
USE_ON_GPU is set after GPU validation) and whose backward is the jnp scan's VJP. Stage 4 runs the
chosen implementation under its own custom_vjp. Segment ids become run numbers once (segments.py).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from gdp_jax import _validation as val
from gdp_jax import chunk_h_pallas
from gdp_jax.chunk_h import chunk_h
from gdp_jax.chunk_o import chunk_gdp_fwd_o
from gdp_jax.cumsum import chunk_local_log2_cumsum
from gdp_jax.segments import segment_runs
from gdp_jax.wy import wy_xla

L2NORM_EPS = 1e-6


def l2norm(x: jax.Array, eps: float = L2NORM_EPS) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, computed in float32, returned in x's dtype
    (the same formula as flash-linear-attention's l2norm)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def chunk_gated_delta_product(q: jax.Array, k: jax.Array, v: jax.Array, g: Optional[jax.Array],
                              beta: jax.Array, *, num_householder: Optional[int] = None,
                              scale: Optional[float] = None,
                              initial_state: Optional[jax.Array] = None,
                              output_final_state: bool = False,
                              segment_ids: Optional[jax.Array] = None,
                              use_qk_l2norm: bool = False, chunk_size: int = 64,
                              implementation: Optional[str] = None):
    """Gated DeltaProduct (SPEC.md's recurrence) in chunked form.

    Args:
      q: [B, T, H, K] queries.
      k: [B, T*M, H, K] keys on the Householder-expanded stream (position t*M + m is step m of t).
      v: [B, T*M, H, V] values, same dtype as q and k.
      g: [B, T, H] natural-log forget gate per token (<= 0), any float dtype, or None (no gating).
      beta: [B, T*M, H] step sizes (in (0, 2) for a contracting update), any float dtype.
      num_householder: M; inferred from k.shape[1] // T when None, checked when given.
      scale: query scale, default K ** -0.5.
      initial_state: [B, H, K, V] state before the first segment of each row, or None for zeros.
      output_final_state: also return the state after each row's last token.
      segment_ids: [B, T] integer packing ids or None; a new segment (state restarted at zero)
        wherever the id changes. Not differentiable.
      use_qk_l2norm: L2-normalise q and k (per position, eps 1e-6) inside the op; the gradient
        flows through the normalisation.
      chunk_size: power of two in [16, 128].
      implementation: "pallas", "xla", "interpret" or None, as for chunk_gdp_fwd_o; it picks the
        output stage's and the state walk's implementation (the WY stage is jnp for now).

    Returns:
      (o, final_state): o [B, T, H, V] in v's dtype; final_state [B, H, K, V] float32, or None
      unless output_final_state. Differentiable in q, k, v, g, beta and initial_state.
    """
    batch, tokens, heads, key_dim = val.check_float_array("q", q, 4, "B, T, H, K")
    k_positions = val.check_float_array("k", k, 4, "B, T*M, H, K")[1]
    value_dim = val.check_float_array("v", v, 4, "B, T*M, H, V")[3]
    m = val.infer_num_householder(num_householder, tokens, k_positions)
    chunk_size = val.check_chunk_size(chunk_size)
    val.check_shape("k", k, (batch, tokens * m, heads, key_dim), "B, T*M, H, K")
    val.check_shape("v", v, (batch, tokens * m, heads, value_dim), "B, T*M, H, V")
    if g is not None:
        val.check_float_shape("g", g, (batch, tokens, heads), "B, T, H")
    val.check_float_shape("beta", beta, (batch, tokens * m, heads), "B, T*M, H")
    if initial_state is not None:
        val.check_float_shape("initial_state", initial_state, (batch, heads, key_dim, value_dim),
                              "B, H, K, V")
    if segment_ids is not None:
        val.check_segment_ids(segment_ids, batch, tokens)
    val.check_same_dtype(q=q, k=k, v=v)
    output_final_state = val.check_bool("output_final_state", output_final_state)
    use_qk_l2norm = val.check_bool("use_qk_l2norm", use_qk_l2norm)
    scale = val.check_scale(scale, key_dim)
    implementation = val.resolve_implementation(implementation)

    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    runs = None if segment_ids is None else segment_runs(jnp.asarray(segment_ids))
    g_log2 = None if g is None else chunk_local_log2_cumsum(g.astype(jnp.float32), chunk_size)
    stage = dict(chunk_size=chunk_size, num_householder=m)
    w, u = wy_xla(k, v, beta, g_log2, runs, **stage)
    # The Pallas chunk_h kernel runs under "interpret"; under "pallas" only once it is validated
    # on a GPU (chunk_h_pallas.USE_ON_GPU), the jnp walk otherwise.
    h_impl = implementation
    if implementation == "pallas" and not chunk_h_pallas.USE_ON_GPU:
        h_impl = "xla"
    h, v_new, final_state = chunk_h(k, w, u, g_log2, runs, initial_state, implementation=h_impl,
                                    **stage)
    # The output stage takes v_new in the inputs' dtype (as flash-linear-attention does) and h in
    # float32; it accumulates in float32 either way.
    o = chunk_gdp_fwd_o(q, k, v_new.astype(v.dtype), h, g_log2, segment_ids=segment_ids,
                        scale=scale, implementation=implementation, **stage)
    return o, (final_state if output_final_state else None)
