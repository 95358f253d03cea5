"""chunk_gated_delta_product: the full Gated DeltaProduct op, its stages composed in one place.

    g_raw --(1) cumsum--> g (chunk-local log2 decays)
    k, v, beta, g --(2) wy--> w, u                  (WY representation, v_new = u - w h)
    k, w, u, g, initial_state --(3) chunk_h--> h, v_new, final_state
    q, k, v_new, h, g --(4) chunk_o--> o

implementation="xla" runs stages 1-3 in jnp (``states_jnp``; exact gradients by plain autodiff).
"pallas" and "interpret" run stages 2-3 as Pallas kernels on a finer grid, sub-chunks of at most
64 positions of the expanded stream (``states_pallas``), under one custom_vjp: its forward rule
also keeps the state before every sub-chunk and the WY stage's inverses; its backward runs the
walk's VJP kernels (``chunk_h.pallas_bwd``), then the WY stage's VJP (``wy.pallas_bwd``, from the
forward's inverses, or ``wy.xla.wy_bwd_xla`` for compiled float32 inputs), then the VJP of the
expanded decays in jnp.
Both grids give SPEC's h, v_new and final state. Stage 4 runs under chunk_o's own custom_vjp;
where stages 2-4 all run kernels, one more custom_vjp holds the two (``_states_and_o``), so that
the differentiable forward stores the state before every sub-chunk once and chunk_o reads the
token chunks' states out of it.
use_qk_l2norm normalises q and k first (``ops.l2norm``), or, where a backward kernel applies the
normalisation's VJP (k's in the WY VJP kernel, q's in chunk_o's one-kernel Mosaic GPU backward),
inside the stages' custom_vjps, except in the undifferentiated forward on the Triton kernels,
where the kernels apply the normalisation themselves (``_l2norm_op``).
Which implementation and dtypes run is ``_src.dispatch``'s rule (docs/math.md has the math).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from gdp_jax._src import dispatch
from gdp_jax._src import validation as val
from gdp_jax._src.layout import l2norm_factor, l2norm_scale, pad_state, tile_width
from gdp_jax._src.segments import segment_runs
from gdp_jax.ops.chunk_h.pallas_bwd import chunk_h_bwd_pallas
from gdp_jax.ops.chunk_h.pallas_fwd import chunk_h_pallas
from gdp_jax.ops.chunk_h.xla import chunk_h_xla
from gdp_jax.ops.chunk_o import STAGE_RULES as CHUNK_O_RULES
from gdp_jax.ops.chunk_o import chunk_o, chunk_o_scaled_forward, stage_config
from gdp_jax.ops.cumsum import chunk_local_log2_cumsum, expanded_log2_decays, sub_chunk_size
from gdp_jax.ops.l2norm import l2norm, l2norm_and_factor
from gdp_jax.ops.wy.pallas_bwd import wy_bwd_pallas
from gdp_jax.ops.wy.pallas_fwd import wy_pallas
from gdp_jax.ops.wy.xla import wy_bwd_xla, wy_xla

__all__ = ["chunk_gated_delta_product", "chunk_states", "states_jnp", "states_pallas",
           "stage_dtypes", "StageDtypes", "sub_grid_operands"]


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
        flows through the normalisation. Undifferentiated on the Triton kernels, where
        ``dispatch.l2norm_fused`` takes it (B * H * ceil(V / 64) >= 128), the kernels apply
        the normalisation themselves and no normalised copy is written; o then differs from
        the differentiated call's by about one rounding of the inputs' dtype.
      chunk_size: power of two in [16, 128].
      implementation: "pallas", "xla", "interpret", "mosaic", "mosaic_interpret" or None, as for
        chunk_gdp_fwd_o: "xla" is jnp throughout; "pallas" (GPU) and "interpret" run the WY,
        state-walk and output stages as Pallas kernels, forward and backward (compiled with
        float32 inputs the WY stage is jnp, forward and backward: IEEE float32 dots in its
        kernels are FMA loops that spill and compile for over 20 s).
        Under "pallas", K or V above 256 run the jnp stages, and so does chunk_o where its
        kernels would not fit (see chunk_gdp_fwd_o). "mosaic" / "mosaic_interpret": the
        output stage on its Mosaic GPU kernels where chunk_gdp_fwd_o's rule takes them, the WY
        and walk stages as for "pallas" / "interpret".

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
    implementation = dispatch.resolve_implementation(implementation)

    runs = None if segment_ids is None else segment_runs(jnp.asarray(segment_ids))
    config = _OpConfig(scale=scale, chunk_size=chunk_size, num_householder=m,
                       implementation=implementation)
    if use_qk_l2norm and _l2norm_fused(config, q, value_dim):
        o, final_state = _l2norm_op(q, k, v, g, beta, runs, initial_state, config)
    else:
        o, final_state = _composed(q, k, v, g, beta, runs, initial_state, config, use_qk_l2norm)
    return o, (final_state if output_final_state else None)


class _OpConfig(NamedTuple):
    scale: float
    chunk_size: int
    num_householder: int
    implementation: str     # resolved; each stage's dispatch rule still applies


def _composed(q, k, v, g, beta, runs, initial_state, config: _OpConfig, use_qk_l2norm: bool):
    """The op's stages in turn, each differentiable on its own, or, where the states and the
    output stage both run kernels, one custom_vjp over both (``_states_and_o``): (o, final_state)."""
    implementation, chunk_size, m = config.implementation, config.chunk_size, config.num_householder
    fused = _states_and_o_configs(q, k, v, g, config, use_qk_l2norm)
    if fused is not None:
        states_config, o_config = fused
        if use_qk_l2norm and not states_config[3]:
            k = l2norm(k, implementation)
        if use_qk_l2norm and not o_config.normalize_queries:
            q = l2norm(q, implementation)
        g32 = None if g is None else g.astype(jnp.float32)
        return _states_and_o(q, k, v, g32, beta, runs, initial_state, (states_config, o_config))
    h, v_new, final_state, k = chunk_states(k, v, beta, g, runs, initial_state,
                                            chunk_size=chunk_size, num_householder=m,
                                            implementation=implementation,
                                            normalize_keys=use_qk_l2norm)
    g_log2 = None if g is None else chunk_local_log2_cumsum(g.astype(jnp.float32), chunk_size)
    # The output stage takes v_new in the inputs' dtype (as fla does) and h in float32 (jnp path)
    # or the inputs' dtype when 16-bit (Pallas path); it accumulates in float32 either way.
    o = chunk_o(q, k, v_new.astype(v.dtype), h, g_log2, runs, scale=config.scale,
                chunk_size=chunk_size, num_householder=m, implementation=implementation,
                normalize_queries=use_qk_l2norm)
    return o, final_state


def _states_and_o_configs(q, k, v, g, config: _OpConfig, use_qk_l2norm: bool):
    """(the states' config, chunk_o's config) where both stages run kernels forward and backward,
    so that one custom_vjp holds both and chunk_o reads h out of the states before every sub-chunk
    (stored once); else None."""
    states, states_config = _states_route(
        k, v, chunk_size=config.chunk_size, num_householder=config.num_householder,
        implementation=config.implementation, normalize_keys=use_qk_l2norm)
    if states == "xla":
        return None
    o_config = stage_config(q, v, dispatch.work_dtype(k.dtype), g is not None, scale=config.scale,
                            chunk_size=config.chunk_size, num_householder=config.num_householder,
                            implementation=config.implementation,
                            normalize_queries=use_qk_l2norm)
    if "xla" in (o_config.implementation, o_config.backward_implementation):
        return None
    return states_config, o_config


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _states_and_o(q, k, v, g, beta, runs, initial_state, configs):
    """Stages 1-4 on kernels (g float32 or None): (o, final_state). Undifferentiated, the
    stages' own primals. Differentiated, the walk stores the state before every sub-chunk once
    and chunk_o reads the token chunks' states out of it (``sub_chunk_view``), where the two
    custom_vjps apart would have it stored twice; the backward is chunk_o's, then the states'."""
    states_config, o_config = configs
    h, v_new, final_state, k = _states(k, v, beta, g, runs, initial_state, states_config)
    g_log2 = None if g is None else chunk_local_log2_cumsum(g, states_config[0])
    o = CHUNK_O_RULES[0](q, k, v_new.astype(v.dtype), h, g_log2, runs, o_config)
    return o, final_state


def _states_and_o_fwd(q, k, v, g, beta, runs, initial_state, configs):
    states_config, o_config = configs
    (h, v_new, final_state, k), states_residuals = _states_fwd(
        k, v, beta, g, runs, initial_state, states_config, sub_chunk_view=True)
    g_log2 = None if g is None else chunk_local_log2_cumsum(g, states_config[0])
    o, o_residuals = CHUNK_O_RULES[1](q, k, v_new.astype(v.dtype), h, g_log2, runs, o_config)
    return (o, final_state), (states_residuals, o_residuals, g)


def _states_and_o_bwd(configs, residuals, cotangents):
    states_config, o_config = configs
    states_residuals, o_residuals, g = residuals
    do, dfinal = cotangents
    dq, dk_o, dv_new, dh, dg_log2, _ = CHUNK_O_RULES[2](o_config, o_residuals, do)
    dk, dv, dbeta, dg, _, dinit = _states_bwd(states_config, states_residuals,
                                              (dh, dv_new, dfinal, dk_o))
    if g is not None:
        _, cumsum_vjp = jax.vjp(lambda g: chunk_local_log2_cumsum(g, states_config[0]), g)
        dg = dg + cumsum_vjp(dg_log2.astype(g.dtype))[0]
    return dq, dk, dv, dg, dbeta, None, dinit


_states_and_o.defvjp(_states_and_o_fwd, _states_and_o_bwd)


def _l2norm_fused(config: _OpConfig, q, value_dim: int) -> bool:
    """``dispatch.l2norm_fused`` for this op's stages (q [B, T, H, K])."""
    batch, _, heads, key_dim = q.shape
    states = dispatch.states_implementation(config.implementation, q.dtype, key_dim, value_dim)
    chunk_o_forward = dispatch.chunk_o_implementation(
        config.implementation, q.dtype, key_dim, value_dim, config.chunk_size,
        dispatch.work_dtype(q.dtype), scaled=True)
    value_width = tile_width(value_dim)
    walk_programs = batch * heads * (value_width // min(value_width, 64))
    return dispatch.l2norm_fused(states, chunk_o_forward, walk_programs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _l2norm_op(q, k, v, g, beta, runs, initial_state, config: _OpConfig):
    """The op with use_qk_l2norm. Undifferentiated, no normalised copy of q or k is written: the
    WY kernel takes the keys' factors from its gram's diagonal, applies them and returns them,
    and the walk and chunk_o apply them as row and column factors; q's factors take one XLA
    reduction and reach chunk_o's outputs. Differentiated, ``_composed`` (the normalisation as
    its own step, with its VJP kernel), forward and backward."""
    interpret = config.implementation == "interpret"
    chunk_size, m = config.chunk_size, config.num_householder
    g32 = None if g is None else g.astype(jnp.float32)
    h, v_new, final_state, key_scale = states_pallas(
        k, v, beta, g32, runs, initial_state, chunk_size=chunk_size, num_householder=m,
        interpret=interpret, normalize_keys=True)
    g_log2 = None if g is None else chunk_local_log2_cumsum(g32, chunk_size)
    o = chunk_o_scaled_forward(q, k, v_new.astype(v.dtype), h, g_log2, runs, l2norm_factor(q),
                               key_scale, scale=config.scale, chunk_size=chunk_size,
                               num_householder=m, interpret=interpret)
    return o, final_state


def _l2norm_op_fwd(q, k, v, g, beta, runs, initial_state, config):
    composed = lambda q, k, v, g, beta, initial_state: _composed(
        q, k, v, g, beta, runs, initial_state, config, True)
    return jax.vjp(composed, q, k, v, g, beta, initial_state)


def _l2norm_op_bwd(config, composed_vjp, cotangents):
    dq, dk, dv, dg, dbeta, dinit = composed_vjp(cotangents)
    return dq, dk, dv, dg, dbeta, None, dinit


_l2norm_op.defvjp(_l2norm_op_fwd, _l2norm_op_bwd)


def chunk_states(k, v, beta, g, runs, initial_state, *, chunk_size: int, num_householder: int,
                 implementation: str, normalize_keys: bool = False):
    """Stages 1-3 for checked inputs, differentiable: (h, v_new, final_state, k).

    k [B, T*M, H, K], v [B, T*M, H, V], beta [B, T*M, H]; g [B, T, H] natural-log gates or None;
    runs [B, T] segment run numbers (``segments.segment_runs``) or None; initial_state
    [B, H, K, V] or None; ``implementation`` resolved ("xla", "pallas" or "interpret"; the
    dispatch rule may still pick the jnp stages). h [B, NT, H, K, V], v_new [B, T*M, H, V] and
    final_state [B, H, K, V] as ``states_pallas`` or ``states_jnp`` give them.

    k comes back as the stages used it: pass it on to ``chunk_o``. On the Pallas path it is an
    output of the stages' custom_vjp, so the output stage's share of dk arrives in that VJP and is
    summed inside a kernel, not by XLA where k fans out.

    ``normalize_keys`` (use_qk_l2norm): the stages take k L2-normalised per position
    (``ops.l2norm``'s formula) and return that. Where ``dispatch.keys_l2norm_vjp_in_wy_kernel``
    says so, the normalisation is part of the stages' custom_vjp and its VJP runs in the WY VJP
    kernel; elsewhere it is ``ops.l2norm``, a step of its own.
    """
    stage = dict(chunk_size=chunk_size, num_householder=num_householder)
    states, config = _states_route(k, v, implementation=implementation,
                                   normalize_keys=normalize_keys, **stage)
    if normalize_keys and not config[3]:
        k = l2norm(k, implementation)
    if states == "xla":
        g_log2 = None if g is None else chunk_local_log2_cumsum(g.astype(jnp.float32), chunk_size)
        return states_jnp(k, v, beta, g_log2, runs, initial_state, **stage) + (k,)
    # g enters in float32, so its cotangent is rounded to g's dtype once (as on the xla path).
    g32 = None if g is None else g.astype(jnp.float32)
    return _states(k, v, beta, g32, runs, initial_state, config)


def _states_route(k, v, *, chunk_size: int, num_householder: int, implementation: str,
                  normalize_keys: bool):
    """(what stages 2-3 run: "xla", "pallas" or "interpret"; the config of their custom_vjp,
    (chunk_size, M, interpret, the keys' l2norm VJP inside the WY VJP kernel))."""
    states = dispatch.states_implementation(implementation, k.dtype, k.shape[-1], v.shape[-1])
    interpret = states == "interpret"
    in_wy_kernel = normalize_keys and dispatch.keys_l2norm_vjp_in_wy_kernel(
        states, k.dtype, interpret, k.shape[-1])
    return states, (chunk_size, num_householder, interpret, in_wy_kernel)


def states_jnp(k, v, beta, g_log2, runs, initial_state, *, chunk_size: int, num_householder: int):
    """Stages 2-3 in jnp: (h, v_new, final_state), float32. g_log2 [B, T, H] chunk-local log2
    decays (stage 1) or None; runs [B, T] segment run numbers or None."""
    stage = dict(chunk_size=chunk_size, num_householder=num_householder)
    w, u = wy_xla(k, v, beta, g_log2, runs, **stage)
    return chunk_h_xla(k, w, u, g_log2, runs, initial_state, **stage)


def sub_grid_operands(k, v, beta, g, runs, initial_state, chunk_size: int, m: int):
    """The Pallas path's stage-2/3 operands on the sub-chunk grid of the expanded stream, as
    ``states_pallas`` builds them (the benchmarks time the kernels on them): positions padded to
    whole token chunks (zero keys, values and betas; runs repeat the last token), K and V to tile
    widths. g: natural-log gates [B, T, H] or None; m: num_householder.

    Returns (k_p, v_p, beta_p, gamma, runs_p, h0, sub): gamma [B, P_pad, H] float32 sub-chunk-local
    log2 decays (or None), h0 [B, H, Kp, Vp] float32 (or None), sub the sub-chunk size; there are
    chunk_size * m // sub sub-chunks per token chunk. The kernels' dtypes follow
    ``stage_dtypes(k.dtype)``."""
    positions, key_dim = k.shape[1], k.shape[3]
    value_dim = v.shape[-1]
    tokens = positions // m
    num_chunks = -(-tokens // chunk_size)
    padded_positions = num_chunks * chunk_size * m
    sub = sub_chunk_size(chunk_size)
    kp, vp = tile_width(key_dim), tile_width(value_dim)
    k_p, v_p = _pad_positions(k, padded_positions, kp), _pad_positions(v, padded_positions, vp)
    beta_p = jnp.pad(beta, ((0, 0), (0, padded_positions - positions), (0, 0)))
    gamma = None if g is None else expanded_log2_decays(g, m, padded_positions, sub)
    runs_p = None
    if runs is not None:
        runs_p = jnp.pad(jnp.repeat(runs.astype(jnp.int32), m, axis=1),
                         ((0, 0), (0, padded_positions - positions)), mode="edge")
    h0 = None if initial_state is None else pad_state(initial_state.astype(jnp.float32), kp, vp)
    return k_p, v_p, beta_p, gamma, runs_p, h0, sub


def _pad_positions(x, padded_positions: int, width: int):
    """[B, P, H, X] -> [B, padded_positions, H, width], zeros (one pad, one pass over HBM)."""
    return jnp.pad(x, ((0, 0), (0, padded_positions - x.shape[1]), (0, 0), (0, width - x.shape[-1])))


class StageDtypes(NamedTuple):
    """The Pallas path's dtype rules for stages 2-3 (``_src.dispatch``; RESULTS.md, "Dtype rules
    of the full op"): ``work`` for w, u, h and the forward walk's dots; ``walk_bwd_dot`` for the
    reverse walk's dots and intermediates; ``wy_bwd_precision`` and ``wy_bwd_operand`` for the WY
    VJP kernel's dots."""
    work: jnp.dtype
    walk_bwd_dot: jnp.dtype
    wy_bwd_precision: Optional[jax.lax.DotAlgorithmPreset]
    wy_bwd_operand: Optional[jnp.dtype]


def stage_dtypes(dtype) -> StageDtypes:
    """``StageDtypes`` for inputs of ``dtype``."""
    precision, operand = dispatch.wy_bwd_dots(dtype)
    return StageDtypes(dispatch.work_dtype(dtype), dispatch.walk_bwd_dot_dtype(dtype), precision,
                       operand)


def states_pallas(k, v, beta, g, runs, initial_state, *, chunk_size: int, num_householder: int,
                  interpret: bool, every_sub_chunk: bool = False, normalize_keys: bool = False,
                  sub_chunk_view: bool = False):
    """Stages 1-3 on the sub-chunk grid with the Pallas kernels (forward only; the op wraps it in
    a custom_vjp): (h, v_new, final_state).

    k [B, T*M, H, K], v [B, T*M, H, V], beta [B, T*M, H]; g [B, T, H] natural-log gates (float32)
    or None; runs [B, T] segment run numbers or None; initial_state [B, H, K, V] or None.
    h [B, NT, H, K, V] comes in the inputs' dtype when it is 16-bit (float32 otherwise), v_new
    [B, T*M, H, V] in v's dtype, final_state [B, H, K, V] float32.

    Routes (``_src.dispatch``): the undifferentiated forward of 16-bit inputs has the WY kernel
    write T alone and the walk apply it (``walk_applies_inverse``), and so does the
    differentiable forward of bfloat16 inputs, whose backward works from T
    (``backward_walks_from_inverse``); compiled float32 inputs run the WY stage in jnp
    (``wy_fwd_runs_kernel``); else the WY kernel writes w and u for the walk.

    ``every_sub_chunk`` (the custom_vjp's forward) also returns what the backward needs:
    (h, v_new, final_state, (w, inverse, h_sub, v_new_p)), with w [B, P_pad, H, Kp] (None where
    the backward works from the inverses, ``dispatch.backward_walks_from_inverse``), the WY
    stage's inverses [B, P_pad, H, sub] (float32, or the WY VJP's 16-bit operand dtype; None
    where the backward does not use them) and, on the padded sub-chunk grid, the state before
    every sub-chunk h_sub [B, NS, H, Kp, Vp] and v_new_p [B, P_pad, H, Vp].

    ``sub_chunk_view`` (with ``every_sub_chunk``): h is not stored apart; it comes as the
    [B, NT, S, H, Kp, Vp] view of h_sub (S sub-chunks a token chunk, the first the chunk's own
    state), which the chunk_o kernels read (``layout.chunk_state_index``).

    ``normalize_keys`` (use_qk_l2norm, the undifferentiated forward only): the WY kernel
    solves for k L2-normalised per position and returns the factors, which the walk applies;
    the results are then (h, v_new, final_state, key_scale [B, T*M, H] float32).
    """
    positions, key_dim = k.shape[1], k.shape[3]
    value_dim = v.shape[-1]
    m = num_householder
    k_p, v_p, beta_p, gamma, runs_p, h0, sub = sub_grid_operands(
        k, v, beta, g, runs, initial_state, chunk_size, m)
    work_dtype = dispatch.work_dtype(k.dtype)
    keep_inverse = every_sub_chunk and dispatch.wy_bwd_runs_kernel(k.dtype, interpret)
    # Kept in the VJP's operand dtype where it has one: it rounds T to that before each dot.
    inverse_dtype = dispatch.wy_bwd_dots(k.dtype)[1] or jnp.float32
    # 16-bit inputs: the WY kernel writes T alone and the walk applies it
    # (dispatch.walk_applies_inverse); in the differentiable forward for bfloat16, whose VJP keeps
    # the same T, the reverse walk then works from T too
    # (dispatch.backward_walks_from_inverse).
    applies = (dispatch.backward_walks_from_inverse(k.dtype) and keep_inverse
               if every_sub_chunk else dispatch.walk_applies_inverse(k.dtype, key_dim))
    walk_inverse, inverse = {}, []
    if applies:
        t, *extra = wy_pallas(k_p, None, beta_p, gamma, runs_p, sub_chunk=sub, out_dtype=work_dtype,
                              interpret=interpret, return_inverse=True, inverse_dtype=work_dtype,
                              normalize_keys=normalize_keys, w_and_u=False)
        w, u, walk_inverse = None, v_p, dict(inverse=t, beta=beta_p)
        inverse = [t] if every_sub_chunk else []
        key_scale = extra[-1] if normalize_keys else None
    elif dispatch.wy_fwd_runs_kernel(k.dtype, interpret):
        w, u, *extra = wy_pallas(k_p, v_p, beta_p, gamma, runs_p, sub_chunk=sub,
                                 out_dtype=work_dtype, interpret=interpret,
                                 return_inverse=keep_inverse, inverse_dtype=inverse_dtype,
                                 normalize_keys=normalize_keys)
        inverse = extra[:1] if keep_inverse else []
        key_scale = extra[-1] if normalize_keys else None
    else:   # jnp on the same sub-chunk grid; the keys' factors as the kernel forms them
        key_scale, k_wy = None, k_p
        if normalize_keys:
            key_scale = l2norm_scale(jnp.sum(jnp.square(k_p.astype(jnp.float32)), axis=-1))
            k_wy = k_p.astype(jnp.float32) * key_scale[..., None]
        w, u = wy_xla(k_wy, v_p, beta_p, gamma, runs_p, chunk_size=sub, num_householder=1)
        w, u = w.astype(work_dtype), u.astype(work_dtype)
    # The walk stores h at token-chunk boundaries and, for the backward, at every sub-chunk too
    # (written by the kernel rather than sliced out after).
    subchunks = chunk_size * m // sub
    h, v_new, final_state, *h_sub = chunk_h_pallas(
        k_p, w, u, gamma, runs_p, h0, chunk_size=sub, num_householder=1,
        subchunks=subchunks, h_dtype=work_dtype, v_new_dtype=v.dtype,
        dot_dtype=work_dtype, interpret=interpret, every_chunk_too=every_sub_chunk,
        key_scale=key_scale, boundary_states=not sub_chunk_view, **walk_inverse)
    if sub_chunk_view:
        batch, sub_chunks, heads, kp, vp = h_sub[0].shape
        h = h_sub[0].reshape(batch, sub_chunks // subchunks, subchunks, heads, kp, vp)
    else:
        h = h[..., :key_dim, :value_dim]
    outputs = (h, v_new[:, :positions, :, :value_dim], final_state[..., :key_dim, :value_dim])
    if every_sub_chunk:
        return outputs + ((w, inverse[0] if inverse else None, h_sub[0], v_new),)
    if normalize_keys:
        return outputs + (key_scale[:, :positions],)
    return outputs


def _normalized_keys(k, normalize: bool, interpret: bool):
    """(k or its l2norm rows, their factors [B, P, H] float32 or None): ``ops.l2norm``'s formula,
    the factors kept for the VJP."""
    if not normalize:
        return k, None
    return l2norm_and_factor(k, "interpret" if interpret else "pallas")


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _states(k, v, beta, g, runs, initial_state, config):
    """(h, v_new, final_state, k): states_pallas's results, and the k they used (with config's
    normalize flag, k's l2norm rows), so that the cotangent of k's other use (the output stage)
    enters _states_bwd."""
    chunk_size, m, interpret, normalize = config
    k, _ = _normalized_keys(k, normalize, interpret)
    return states_pallas(k, v, beta, g, runs, initial_state, chunk_size=chunk_size,
                         num_householder=m, interpret=interpret) + (k,)


def _states_fwd(k, v, beta, g, runs, initial_state, config, sub_chunk_view: bool = False):
    chunk_size, m, interpret, normalize = config
    k, factor = _normalized_keys(k, normalize, interpret)
    h, v_new, final_state, saved = states_pallas(
        k, v, beta, g, runs, initial_state, chunk_size=chunk_size, num_householder=m,
        interpret=interpret, every_sub_chunk=True, sub_chunk_view=sub_chunk_view)
    return (h, v_new, final_state, k), (k, v, beta, g, runs, initial_state, saved, factor)


def _states_bwd(config, residuals, cotangents):
    """Reverse of states_pallas on the sub-chunk grid, exact:

    1. the walk's VJP (``chunk_h_bwd_pallas``, from the saved h at every sub-chunk and v_new;
       h's cotangent enters at token-chunk boundaries) -> dk, dw, du, dgamma, dh0;
    2. the WY stage's VJP (w, u -> k, v, beta, gamma) per sub-chunk: ``wy_bwd_pallas`` from the
       forward's inverses, or ``wy_bwd_xla`` (``dispatch.wy_bwd_runs_kernel``);
    3. the VJP of the expanded decays (gamma <- g, a cumsum) in jnp.
    The output stage's share of dk (the cotangent of the k passed through) and the walk's are
    added to dk inside the WY VJP kernel, which also rounds dk and dv to the inputs' dtype, so
    neither the sum nor the casts costs a pass over HBM. That kernel also forms the gate terms of
    the walk's share (ln2 k_j·dk_j), which the epilogue would otherwise read k for, and, with
    config's normalize flag (only set where that kernel runs), l2norm's VJP: dk comes as the
    cotangent of the raw keys.
    """
    k, v, beta, g, runs, initial_state, (w, inverse, h_sub, v_new_p), key_factor = residuals
    chunk_size, m, interpret, _ = config
    dh, dv_new, dfinal, dk_through = cotangents
    positions, key_dim = k.shape[1], k.shape[3]
    value_dim = v.shape[-1]
    k_p, v_p, beta_p, gamma, runs_p, _, sub = sub_grid_operands(
        k, v, beta, g, runs, None, chunk_size, m)
    padded_positions, kp, vp = k_p.shape[1], k_p.shape[3], v_p.shape[3]
    f32 = jnp.float32
    # Cotangents stay in their dtype (16-bit h and v_new have 16-bit ones): the walk kernel
    # upcasts its loads, where a float32 copy here would cost a pass over HBM each.
    pad_positions = functools.partial(_pad_positions, padded_positions=padded_positions)
    # w None: the forward kept T alone (dispatch.backward_walks_from_inverse), which the reverse
    # walk works from; dw and du then come as T^T dw and T^T du, which the WY VJP takes as such.
    from_inverse = {} if w is not None else dict(inverse=inverse, beta=beta_p)
    # The WY VJP kernel, where it runs, forms the gate terms of the walk's dk share (k_j·dk_j)
    # from the k and dk tiles it loads anyway; the epilogue would read k for them alone.
    wy_kernel = inverse is not None
    dk_walk, dw, du, dgamma_walk, dh0 = chunk_h_bwd_pallas(
        k_p, w, gamma, runs_p, h_sub, v_new_p, pad_state(dh, kp, vp), pad_positions(dv_new, width=vp),
        pad_state(dfinal, kp, vp), chunk_size=sub, num_householder=1,
        with_initial_state=initial_state is not None, subchunks=chunk_size * m // sub,
        dot_dtype=dispatch.walk_bwd_dot_dtype(k.dtype), key_gate_terms=not wy_kernel,
        interpret=interpret, **from_inverse)
    if wy_kernel:
        precision, operand_dtype = dispatch.wy_bwd_dots(k.dtype)
        wy_grads = wy_bwd_pallas(k_p, v_p, beta_p, gamma, runs_p, inverse, dw, du, sub_chunk=sub,
                                 precision=precision, operand_dtype=operand_dtype,
                                 dk_accumulate=(dk_walk, pad_positions(dk_through, width=kp)),
                                 out_dtype=k.dtype, rhs_cotangents=bool(from_inverse),
                                 walk_share_gates=True, interpret=interpret,
                                 key_factor=None if key_factor is None else jnp.pad(
                                     key_factor, ((0, 0), (0, padded_positions - positions), (0, 0))))
        dk_p = wy_grads[0]
    else:
        wy_grads = wy_bwd_xla(k_p, v_p, beta_p, gamma, runs_p, dw, du, chunk_size=sub)
        dk_p = dk_walk + wy_grads[0] + pad_positions(dk_through, width=kp).astype(f32)
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
