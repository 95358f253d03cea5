"""chunk_gated_delta_product: the full Gated DeltaProduct op, its stages composed in one place.

    g_raw --(1) cumsum.chunk_local_log2_cumsum--> g (chunk-local log2 decays)
    k, v, beta, g --(2) wy.wy_xla | wy_pallas.wy_pallas--> w, u      (WY representation)
    k, w, u, g, initial_state --(3) chunk_h.chunk_h_xla | chunk_h_pallas.chunk_h_pallas--> h, v_new,
                                                                                     final_state
    q, k, v_new, h, g --(4) chunk_o.chunk_o_from_runs (chunk_gdp_fwd_o minus its checks)--> o

implementation="xla" runs stages 1-3 in jnp (exact gradients by plain autodiff). "pallas" and
"interpret" run stages 2-3 as two Pallas kernels on a finer grid (wy_pallas.py: the WY system on
sub-chunks of at most 64 positions of the expanded stream; chunk_h_pallas.py: the state walk over
those sub-chunks, storing h at token-chunk boundaries), under one custom_vjp. Its forward rule
also keeps the state before every sub-chunk and the WY stage's inverses; its backward runs the
state walk's VJP kernels (chunk_h_bwd_pallas.py) on the same grid, then the WY stage's VJP kernel
(wy_bwd_pallas.py; wy.wy_bwd_xla for float32 inputs on the GPU), then the cumsum's VJP in jnp.
Both grids give the same h, v_new and final state: they are
SPEC's. Stage 4 runs the chosen implementation under its own custom_vjp. Segment ids become run
numbers once (segments.py).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from gdp_jax import _validation as val
from gdp_jax._chunking import kernel_dtype_supported, kernel_widths_supported, tile_width
from gdp_jax.chunk_h import chunk_h_xla
from gdp_jax.chunk_h_bwd_pallas import chunk_h_bwd_pallas
from gdp_jax.chunk_h_pallas import chunk_h_pallas
from gdp_jax.chunk_o import chunk_o_from_runs
from gdp_jax.cumsum import chunk_local_log2_cumsum
from gdp_jax.segments import segment_runs
from gdp_jax.wy import wy_bwd_xla, wy_xla
from gdp_jax.wy_bwd_pallas import wy_bwd_pallas
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
        Pallas kernels, forward and backward (compiled with float32 inputs, the WY stage's
        backward is jnp: IEEE float32 dots in that kernel spill). Under "pallas", K or V above 256
        run the jnp stages, and so does chunk_o where its kernels would not fit (see
        chunk_gdp_fwd_o).

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
    # Widths beyond the kernels' (K or V above 256) take the jnp stages under "pallas" too, and
    # float64 inputs under "pallas" and "interpret" alike; chunk_o decides the same for itself
    # (chunk_o._resolved).
    if (implementation == "xla" or not kernel_dtype_supported(q.dtype)
            or (implementation == "pallas" and not kernel_widths_supported(key_dim, value_dim))):
        h, v_new, final_state = _states_jnp(k, v, beta, g_log2, runs, initial_state, **stage)
    else:
        # g enters in float32, so its cotangent is rounded to g's dtype once (as on the xla path).
        g32 = None if g is None else g.astype(jnp.float32)
        # k reaches the output stage through _states (an identity output), so the output stage's
        # share of dk arrives in _states' backward and is summed there inside a kernel, not by
        # XLA where k fans out (one pass over three k-sized arrays, 0.18 ms on an H200 at
        # B=8 T=4096 H=16 K=V=128 M=2 bf16).
        h, v_new, final_state, k = _states(k, v, beta, g32, runs, initial_state,
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


def _sub_grid_operands(k, v, beta, g, runs, initial_state, chunk_size: int, m: int):
    """The GPU path's operands on the sub-chunk grid of the expanded stream: positions padded to
    whole token chunks (zero keys, values and betas; runs repeat the last token), K and V to tile
    widths. Returns (k_p, v_p, beta_p, gamma, runs_p, h0, sub) with gamma [B, P_pad, H] float32
    sub-chunk-local log2 decays (or None) and h0 [B, H, Kp, Vp] float32 (or None)."""
    positions, key_dim = k.shape[1], k.shape[3]
    value_dim = v.shape[-1]
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
    h0 = None
    if initial_state is not None:
        h0 = jnp.pad(initial_state.astype(jnp.float32),
                     ((0, 0), (0, 0), (0, kp - key_dim), (0, vp - value_dim)))
    return k_p, v_p, beta_p, gamma, runs_p, h0, sub


def _work_dtype(dtype):
    """w, u and h stay in 16 bits for 16-bit inputs (as fla keeps them), float32 otherwise."""
    return dtype if jnp.dtype(dtype).itemsize == 2 else jnp.float32


def _bwd_dot_dtype(dtype):
    """The backward kernels of the states (the walk's VJP and the WY stage's VJP) take bfloat16
    dot operands for bfloat16 inputs, as fla does (the walk's VJP then also passes dvt, dS and dw
    through HBM in bfloat16); float32 (TF32 dots) otherwise. Not float16: the state's cotangent dS
    sums the cotangents of a whole row, and the WY VJP's M and F sum over a sub-chunk, both able
    to outgrow float16's range (65504), where bfloat16 keeps float32's exponent. The forward
    walk's float16 dots round only what it stores in float16 anyway (h, v_new)."""
    return jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.float32


def _wy_bwd_kernel_used(dtype, interpret: bool) -> bool:
    """Whether _states_bwd runs wy_bwd_pallas (which needs the forward's inverses): for 16-bit
    inputs, and always in the interpreter; compiled float32 inputs take wy.wy_bwd_xla."""
    return jnp.dtype(dtype).itemsize == 2 or interpret


def _states_pallas(k, v, beta, g, runs, initial_state, *, chunk_size: int, num_householder: int,
                   interpret: bool, every_sub_chunk: bool = False):
    """Stages 1-3 on the sub-chunk grid with the Pallas kernels: (h, v_new, final_state).

    h [B, NT, H, K, V] and v_new [B, T*M, H, V] come in the inputs' dtype when it is 16-bit (float32
    otherwise; v_new always in v's dtype); final_state [B, H, K, V] float32.

    ``every_sub_chunk`` (the custom_vjp's forward) also returns what the backward needs:
    (h, v_new, final_state, (w, inverse, h_sub, v_new_p)), with w [B, P_pad, H, Kp], the WY
    stage's inverses [B, P_pad, H, sub] float32 (None where the backward does not use them) and,
    on the padded sub-chunk grid, the state before every sub-chunk h_sub [B, NS, H, Kp, Vp] and
    v_new_p [B, P_pad, H, Vp]; h is then every ``chunk_size * M / sub``-th entry of h_sub.
    """
    positions, key_dim = k.shape[1], k.shape[3]
    value_dim = v.shape[-1]
    m = num_householder
    k_p, v_p, beta_p, gamma, runs_p, h0, sub = _sub_grid_operands(
        k, v, beta, g, runs, initial_state, chunk_size, m)
    work_dtype = _work_dtype(k.dtype)
    keep_inverse = every_sub_chunk and _wy_bwd_kernel_used(k.dtype, interpret)
    # 16-bit inputs: T's off-diagonal blocks from TF32 dots (it is rounded to 16 bits to be applied).
    w, u, *inverse = wy_pallas(k_p, v_p, beta_p, gamma, runs_p, sub_chunk=sub,
                               out_dtype=work_dtype, interpret=interpret,
                               tf32_inverse=work_dtype != jnp.float32,
                               return_inverse=keep_inverse)
    per_chunk = chunk_size * m // sub
    # The walk's dots take 16-bit operands for 16-bit inputs (as fla's do; the state is carried
    # in float32): 0.73 -> 0.50 ms on an H200 at B=8 T=4096 H=16 K=V=128 M=2 bf16, moving h by
    # 1.8e-3 relative, about one bf16 rounding of the h it stores anyway.
    # The forward rule's walk writes h at every sub-chunk too (the backward's residual), besides
    # h at token-chunk boundaries: slicing the latter out of the former was a pass over HBM.
    h, v_new, final_state, *h_sub = chunk_h_pallas(
        k_p, w, u, gamma, runs_p, h0, chunk_size=sub, num_householder=1, subchunks=per_chunk,
        h_dtype=work_dtype, v_new_dtype=v.dtype, dot_dtype=work_dtype, interpret=interpret,
        every_chunk_too=every_sub_chunk)
    saved = None
    if every_sub_chunk:   # h at every sub-chunk (padded K, V), v_new padded
        saved = (w, inverse[0] if inverse else None, h_sub[0], v_new)
    outputs = (h[..., :key_dim, :value_dim], v_new[:, :positions, :, :value_dim],
               final_state[..., :key_dim, :value_dim])
    return (outputs + (saved,)) if every_sub_chunk else outputs


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _states(k, v, beta, g, runs, initial_state, config):
    """(h, v_new, final_state, k): _states_pallas's results, and k itself, so that the cotangent
    of k's other use (the output stage) enters _states_bwd."""
    chunk_size, m, interpret = config
    return _states_pallas(k, v, beta, g, runs, initial_state, chunk_size=chunk_size,
                          num_householder=m, interpret=interpret) + (k,)


def _states_fwd(k, v, beta, g, runs, initial_state, config):
    chunk_size, m, interpret = config
    h, v_new, final_state, saved = _states_pallas(
        k, v, beta, g, runs, initial_state, chunk_size=chunk_size, num_householder=m,
        interpret=interpret, every_sub_chunk=True)
    return (h, v_new, final_state, k), (k, v, beta, g, runs, initial_state, saved)


def _states_bwd(config, residuals, cotangents):
    """Reverse of _states_pallas on the sub-chunk grid, exact:

    1. the state walk's VJP: chunk_h_bwd_pallas's kernels over the sub-chunks (from the forward's
       h at every sub-chunk and v_new, saved; h's cotangent enters at token-chunk boundaries)
       -> dk, dw, du, dgamma, dh0;
    2. the WY stage's VJP (w, u -> k, v, beta, gamma), per sub-chunk, with wy_bwd_pallas's
       kernel from the forward's inverses for 16-bit inputs (tensor-core dots with bfloat16
       operands for bfloat16 inputs, TF32 for float16, float32 accumulation), in XLA
       (wy.wy_bwd_xla) for float32 ones when compiled;
    3. the VJP of the expanded decays (gamma <- g, a cumsum) in jnp.
    The cotangent of the k passed through (the output stage's share of dk) is added to dk inside
    the WY VJP kernel, with the walk's share.
    """
    k, v, beta, g, runs, initial_state, (w, inverse, h_sub, v_new_p) = residuals
    chunk_size, m, interpret = config
    dh, dv_new, dfinal, dk_through = cotangents
    positions, key_dim = k.shape[1], k.shape[3]
    value_dim = v.shape[-1]
    k_p, v_p, beta_p, gamma, runs_p, _, sub = _sub_grid_operands(
        k, v, beta, g, runs, None, chunk_size, m)
    padded_positions, kp, vp = k_p.shape[1], k_p.shape[3], v_p.shape[3]
    f32 = jnp.float32
    per_chunk = chunk_size * m // sub
    # Cotangents stay in their dtype (16-bit h and v_new have 16-bit ones): the walk kernel upcasts
    # its loads, where a float32 copy here would cost a pass over HBM each (0.19 ms on an H200 at
    # B=8 T=4096 H=16 K=V=128 M=2).
    pad_state = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 2)
                                  + [(0, kp - key_dim), (0, vp - value_dim)])
    pad_positions = lambda x, width: jnp.pad(
        x, ((0, 0), (0, padded_positions - positions), (0, 0), (0, width - x.shape[-1])))
    dv_new_p = pad_positions(dv_new, vp)
    bwd_dot_dtype = _bwd_dot_dtype(k.dtype)
    dk_walk, dw, du, dgamma_walk, dh0 = chunk_h_bwd_pallas(
        k_p, w, gamma, runs_p, h_sub, v_new_p, pad_state(dh), dv_new_p, pad_state(dfinal),
        chunk_size=sub, num_householder=1, with_initial_state=initial_state is not None,
        interpret=interpret, subchunks=per_chunk, dot_dtype=bwd_dot_dtype)

    # The WY stage's VJP per sub-chunk: the kernel with tensor-core dots for 16-bit inputs, bf16
    # operands for bf16 inputs and TF32 for float16 (their gradients carry bf16/fp16 rounding
    # anyway; on an H200 at B=8 T=4096 H=16 K=V=128 M=2 bf16, 1.75 ms with TF32, 1.12 ms with bf16
    # operands and the dk share below summed in). Float32 inputs need IEEE float32 dots, which
    # on 64 x 64 tiles are FMA loops that spill (23-110 ms there), so compiled they take
    # wy.wy_bwd_xla (9.1 ms); the interpreter runs the kernel for every dtype, so CPU tests check
    # its logic.
    # The kernel also adds the walk's and the output stage's shares of dk and rounds dk and dv to
    # the inputs' dtype itself, so neither the sum nor the casts is a separate pass over HBM.
    if inverse is not None:
        precision = jax.lax.Precision.HIGHEST if jnp.dtype(k.dtype) == f32 else None
        operand_dtype = None if bwd_dot_dtype == f32 else bwd_dot_dtype
        wy_grads = wy_bwd_pallas(k_p, v_p, beta_p, gamma, runs_p, inverse, dw, du, sub_chunk=sub,
                                 precision=precision, operand_dtype=operand_dtype,
                                 interpret=interpret,
                                 dk_accumulate=(dk_walk, pad_positions(dk_through, kp)),
                                 out_dtype=k.dtype)
        dk_p = wy_grads[0]
    else:
        wy_grads = wy_bwd_xla(k_p, v_p, beta_p, gamma, runs_p, dw, du, chunk_size=sub)
        dk_p = dk_walk + wy_grads[0] + pad_positions(dk_through, kp).astype(f32)
    dk = dk_p[:, :positions, :, :key_dim]
    dv = wy_grads[1][:, :positions, :, :value_dim]
    dbeta = wy_grads[2][:, :positions]
    dg = None
    if g is not None:
        _, decay_vjp = jax.vjp(
            lambda g: expanded_log2_decays(g, m, padded_positions, sub), g.astype(f32))
        (dg,) = decay_vjp(dgamma_walk + wy_grads[3])
    cast = lambda x, primal: None if primal is None else x.astype(primal.dtype)
    dinit = None if dh0 is None else dh0[..., :key_dim, :value_dim]
    return (cast(dk, k), cast(dv, v), cast(dbeta, beta), cast(dg, g), None,
            cast(dinit, initial_state))


_states.defvjp(_states_fwd, _states_bwd)
