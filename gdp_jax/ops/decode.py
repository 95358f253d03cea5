"""recurrent_gdp_step: one token of Gated DeltaProduct (SPEC's recurrence), for decoding."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from gdp_jax._src import validation as val
from gdp_jax._src.layout import l2norm
from gdp_jax._src.pallas import HIGHEST as _HIGHEST


def recurrent_gdp_step(q_t: jax.Array, k_t: jax.Array, v_t: jax.Array, g_t: Optional[jax.Array],
                       beta_t: jax.Array, state: jax.Array, *, scale: Optional[float] = None,
                       num_householder: Optional[int] = None, use_qk_l2norm: bool = False):
    """One token of SPEC's recurrence: gate the state once, apply the token's M steps, read out.

        S <- exp(g_t) S;  for m < M: v_new = beta_m (v_m - S^T k_m), S <- S + k_m v_new^T;
        o_t = scale S^T q_t

    Matches chunk_gated_delta_product token by token (the same token fed to both gives the same o
    and state, up to float32 rounding). A segment start is the caller's business: pass a zero state.

    Args:
      q_t: [B, H, K]. k_t: [B, M, H, K]. v_t: [B, M, H, V] (q_t, k_t, v_t share one dtype).
      g_t: [B, H] natural-log gate (<= 0) or None. beta_t: [B, M, H].
      state: [B, H, K, V], any float dtype.
      scale: default K ** -0.5, as in the chunked op.
      num_householder: M, read from k_t.shape[1]; checked when given.
      use_qk_l2norm: L2-normalise q_t and k_t first (same formula as the chunked op).

    Returns:
      (o_t [B, H, V] in v_t's dtype, new state [B, H, K, V] in state's dtype, computed in float32).
    """
    batch, heads, key_dim = val.check_float_array("q_t", q_t, 3, "B, H, K")
    m = val.check_float_array("k_t", k_t, 4, "B, M, H, K")[1]
    m = val.check_num_householder_equals(num_householder, m, "k_t", "1")
    value_dim = val.check_float_array("v_t", v_t, 4, "B, M, H, V")[3]
    val.check_shape("k_t", k_t, (batch, m, heads, key_dim), "B, M, H, K")
    val.check_shape("v_t", v_t, (batch, m, heads, value_dim), "B, M, H, V")
    if g_t is not None:
        val.check_float_shape("g_t", g_t, (batch, heads), "B, H")
    val.check_float_shape("beta_t", beta_t, (batch, m, heads), "B, M, H")
    val.check_float_shape("state", state, (batch, heads, key_dim, value_dim), "B, H, K, V")
    val.check_same_dtype(q_t=q_t, k_t=k_t, v_t=v_t)
    scale = val.check_scale(scale, key_dim)
    if val.check_bool("use_qk_l2norm", use_qk_l2norm):
        q_t, k_t = l2norm(q_t), l2norm(k_t)

    f32 = jnp.float32
    s = state.astype(f32)
    if g_t is not None:
        s = jnp.exp(g_t.astype(f32))[..., None, None] * s
    k32, v32, b32 = k_t.astype(f32), v_t.astype(f32), beta_t.astype(f32)
    for step in range(m):
        kj = k32[:, step]
        v_new = b32[:, step, :, None] * (
            v32[:, step] - jnp.einsum("bhkv,bhk->bhv", s, kj, precision=_HIGHEST))
        s = s + jnp.einsum("bhk,bhv->bhkv", kj, v_new, precision=_HIGHEST)
    o = scale * jnp.einsum("bhkv,bhk->bhv", s, q_t.astype(f32), precision=_HIGHEST)
    return o.astype(v_t.dtype), s.astype(state.dtype)
