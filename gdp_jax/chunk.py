"""chunk_gated_delta_product: the full Gated DeltaProduct op, its stages composed in one place.

    g_raw --(1) cumsum.chunk_local_log2_cumsum--> g (chunk-local log2 decays)
    k, v, beta, g --(2) wy.wy_xla | wy_pallas.wy_pallas--> w, u      (WY representation)
    k, w, u, g, initial_state --(3) chunk_h.chunk_h_xla | chunk_h_pallas.chunk_h_pallas--> h, v_new,
                                                                                     final_state
    q, k, v_new, h, g --(4) chunk_o.chunk_o_from_runs (chunk_gdp_fwd_o minus its checks)--> o

implementation="xla" runs stages 1-3 in jnp (exact gradients by plain autodiff). "pallas" and
"interpret" run stages 2-3 as two Pallas kernels on a finer grid (wy_pallas.py: the WY system on
sub-chunks of at most 64 positions of the expanded stream; chunk_h_pallas.py: the state walk over
those sub-chunks, storing h at token-chunk boundaries), under one custom_vjp whose backward is the
VJP of the jnp stages 1-3 (recomputed; exact, not yet fast). Both grids give the same h, v_new and
final state: they are SPEC's. Stage 4 runs the chosen implementation under its own custom_vjp.
Segment ids become run numbers once (segments.py).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from gdp_jax import _validation as val
from gdp_jax._chunking import tile_width
from gdp_jax.chunk_h import chunk_h_xla
from gdp_jax.chunk_h_pallas import chunk_h_pallas
from gdp_jax.chunk_o import chunk_o_from_runs
from gdp_jax.cumsum import chunk_local_log2_cumsum
from gdp_jax.segments import segment_runs
from gdp_jax.wy import wy_xla
from gdp_jax.wy_pallas import expanded_log2_decays, sub_chunk_size, wy_pallas

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
      implementation: "pallas", "xla", "interpret" or None, as for chunk_gdp_fwd_o: "xla" is jnp
        throughout; "pallas" (GPU) and "interpret" run the WY, state-walk and output stages as
        Pallas kernels. The backward of the WY and state stages is the jnp VJP for now.

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
    if implementation == "xla":
        h, v_new, final_state = _states_jnp(k, v, beta, g_log2, runs, initial_state, **stage)
    else:
        h, v_new, final_state = _states(k, v, beta, g, runs, initial_state,
                                        (chunk_size, m, implementation == "interpret"))
    # The output stage takes v_new in the inputs' dtype (as flash-linear-attention does) and h in
    # float32 (jnp path) or the inputs' dtype when they are 16-bit (Pallas path, as fla does: it
    # halves the bytes h costs); it accumulates in float32 either way.
    # Inputs are checked and segment ids turned into run numbers above: chunk_o's entry point for
    # that, so neither is done twice.
    o = chunk_o_from_runs(q, k, v_new.astype(v.dtype), h, g_log2, runs, scale=scale,
                          implementation=implementation, **stage)
    return o, (final_state if output_final_state else None)


def _states_jnp(k, v, beta, g_log2, runs, initial_state, *, chunk_size: int, num_householder: int):
    """Stages 2-3 in jnp: (h, v_new, final_state), float32. g_log2 [B, T, H] chunk-local log2
    decays (stage 1) or None."""
    stage = dict(chunk_size=chunk_size, num_householder=num_householder)
    w, u = wy_xla(k, v, beta, g_log2, runs, **stage)
    return chunk_h_xla(k, w, u, g_log2, runs, initial_state, **stage)


def _states_pallas(k, v, beta, g, runs, initial_state, *, chunk_size: int, num_householder: int,
                   interpret: bool):
    """Stages 1-3 on the sub-chunk grid with the Pallas kernels: (h, v_new, final_state).

    h [B, NT, H, K, V] and v_new [B, T*M, H, V] come in the inputs' dtype when it is 16-bit (float32
    otherwise; v_new always in v's dtype); final_state [B, H, K, V] float32.
    """
    batch, positions, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    m = num_householder
    tokens = positions // m
    num_chunks = -(-tokens // chunk_size)
    padded_positions = num_chunks * chunk_size * m
    sub = sub_chunk_size(chunk_size)
    kp, vp = tile_width(key_dim), tile_width(value_dim)
    pad_rows = lambda x, width: jnp.pad(x, ((0, 0), (0, padded_positions - positions), (0, 0),
                                            (0, width - x.shape[-1])))
    k_p, v_p = pad_rows(k, kp), pad_rows(v, vp)
    beta_p = jnp.pad(beta, ((0, 0), (0, padded_positions - positions), (0, 0)))
    gamma = None if g is None else expanded_log2_decays(g, m, padded_positions, sub)
    runs_p = None
    if runs is not None:
        runs_p = jnp.pad(jnp.repeat(runs.astype(jnp.int32), m, axis=1),
                         ((0, 0), (0, padded_positions - positions)), mode="edge")
    half = jnp.dtype(k.dtype).itemsize == 2
    work_dtype = k.dtype if half else jnp.float32
    w, u = wy_pallas(k_p, v_p, beta_p, gamma, runs_p, sub_chunk=sub, out_dtype=work_dtype,
                     interpret=interpret)
    h0 = None
    if initial_state is not None:
        h0 = jnp.pad(initial_state.astype(jnp.float32),
                     ((0, 0), (0, 0), (0, kp - key_dim), (0, vp - value_dim)))
    h, v_new, final_state = chunk_h_pallas(
        k_p, w, u, gamma, runs_p, h0, chunk_size=sub, num_householder=1,
        subchunks=chunk_size * m // sub, h_dtype=work_dtype, v_new_dtype=v.dtype,
        interpret=interpret)
    return (h[..., :key_dim, :value_dim], v_new[:, :positions, :, :value_dim],
            final_state[..., :key_dim, :value_dim])


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _states(k, v, beta, g, runs, initial_state, config):
    chunk_size, m, interpret = config
    return _states_pallas(k, v, beta, g, runs, initial_state, chunk_size=chunk_size,
                          num_householder=m, interpret=interpret)


def _states_fwd(k, v, beta, g, runs, initial_state, config):
    return (_states(k, v, beta, g, runs, initial_state, config),
            (k, v, beta, g, runs, initial_state))


def _states_bwd(config, residuals, cotangents):
    """The VJP of the jnp stages 1-3 at the same primals (they compute the same function)."""
    k, v, beta, g, runs, initial_state = residuals
    chunk_size, m, _ = config
    primals = dict(k=k, v=v, beta=beta, g=g, initial_state=initial_state)
    names = [n for n, x in primals.items() if x is not None]

    def jnp_path(*args):
        full = dict(primals, **dict(zip(names, args)))
        g_log2 = (None if full["g"] is None
                  else chunk_local_log2_cumsum(full["g"].astype(jnp.float32), chunk_size))
        return _states_jnp(full["k"], full["v"], full["beta"], g_log2, runs, full["initial_state"],
                           chunk_size=chunk_size, num_householder=m)

    _, vjp = jax.vjp(jnp_path, *[primals[n] for n in names])
    grads = dict(zip(names, vjp(tuple(c.astype(jnp.float32) for c in cotangents))))
    cast = lambda n: None if primals[n] is None else grads[n].astype(primals[n].dtype)
    return cast("k"), cast("v"), cast("beta"), cast("g"), None, cast("initial_state")


_states.defvjp(_states_fwd, _states_bwd)
