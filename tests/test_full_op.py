"""chunk_gated_delta_product, the full op, on CPU: "xla" (jnp stages 1-3, autodiff) and
"interpret" (the Pallas path: WY and state-walk kernels on the sub-chunk grid under the states'
custom_vjp, then chunk_o's kernels), and its stages on their own (``states_jnp``,
``states_pallas``).

Everything against SPEC's recurrence in float64: o and the final state, h and v_new of the stages,
and the gradients in q, k, v, g, beta and initial_state against float64 autodiff of the recurrence.
Argument errors: test_validation.py; the decode step: test_decode.py.
"""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax import reference
from gdp_jax._src import dispatch
from gdp_jax.ops import cumsum
from gdp_jax.ops import gated_delta_product as gdp_op
from gdp_jax.ops.gated_delta_product import states_jnp, states_pallas
from cases import (GRAD_NAMES, Case, assert_all_close, assert_close, build, full_op_fn,
                   l2norm_op_of_qk, recurrence_grads, run_full_op, stress_problem, tolerance)

IMPLEMENTATIONS = ["xla", "interpret"]
BASE = Case(77, 32, 16, 2, 16)

# A covering subset: ragged T, M = 1..3, K != V both ways and K, V padded to tiles, with and
# without g, segments and initial state, float32, bfloat16 and float16 (16-bit work dtype). The
# Pallas path's sub-chunks (min(chunk, 64) positions) number M per token chunk up to chunk 64 and
# 2M at chunk 128 (here 4).
FORWARD_CASES = [
    BASE,
    Case(130, 16, 32, 3, 32, initial_state=False),
    Case(77, 32, 16, 1, 16, gated=False, segments=False),
    Case(150, 16, 16, 2, 128),
    Case(130, 24, 20, 1, 64, gated=False),
    Case(77, 16, 32, 2, 16, dtype="bfloat16"),
    Case(130, 32, 16, 2, 16, dtype="float16"),
]


# The jnp path of chunk 128, of widths that are not powers of two and of float16 inputs is
# chunk_o_xla and float32 stages (covered by test_chunk_o.py and the other cases); the Pallas
# path pads, tiles and casts for them, so those cases run "interpret" only.
# No g and no segments under "interpret": the gradient test's nog-noseg-noinit case checks o.
# bfloat16 under "xla": chunk_o_xla with bf16 q, k, v and float32 h (test_chunk_o_bwd.py) after
# float32 stages.
FORWARD_PARAMS = [(case, impl) for case in FORWARD_CASES for impl in IMPLEMENTATIONS
                  if (impl == "interpret" and (case.gated or case.segments))
                  or (impl == "xla" and not (case.chunk_size == 128 or case.key_dim == 24
                                             or case.dtype != "float32"))]


@pytest.mark.parametrize("case,implementation", FORWARD_PARAMS,
                         ids=[f"{c.id}-{i}" for c, i in FORWARD_PARAMS])
def test_against_recurrence(case, implementation):
    p = build(case)
    o, final_state = run_full_op(p, implementation)
    chex.assert_shape(o, p.ref["o"].shape)
    chex.assert_type([o, final_state], [case.jnp_dtype, jnp.float32])
    assert_close(o, p.ref["o"], tolerance(case.dtype), "o")
    assert_close(final_state, p.ref["final_state"], tolerance(case.dtype), "final_state")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_stages_against_recurrence(implementation):
    """Stages 1-3 on their own: g, h, v_new and the final state exactly as SPEC defines them;
    "interpret" runs states_pallas (WY and walk kernels on the sub-chunk grid: M = 3 at chunk 32,
    three sub-chunks per token chunk)."""
    case = FORWARD_CASES[1]
    p = build(case)
    g_log2 = cumsum.chunk_local_log2_cumsum(p.g_raw, case.chunk_size)
    assert_close(g_log2, p.ref["g"], tolerance("float32"), "g")
    kw = dict(chunk_size=case.chunk_size, num_householder=case.m)
    if implementation == "xla":
        stages = jax.jit(functools.partial(states_jnp, **kw))
        out = stages(p.k, p.v, p.beta, g_log2, p.runs, p.initial_state)
    else:       # natural-log gates: the Pallas path takes its own sub-chunk cumsum
        stages = jax.jit(functools.partial(states_pallas, interpret=True, **kw))
        out = stages(p.k, p.v, p.beta, p.g_raw, p.runs, p.initial_state)
    for name, x in zip(("h", "v_new", "final_state"), out):
        assert_close(x, p.ref[name], tolerance("float32"), name)


@pytest.mark.parametrize("case", [Case(77, 16, 24, 2, 16), Case(40, 8, 8, 3, 16, gated=False),
                                  Case(33, 8, 16, 1, 32, segments=False, initial_state=False)],
                         ids=lambda c: c.id)
def test_library_reference_equals_the_tests_recurrence(case):
    """gdp_jax.reference.recurrence (the lax.scan that the gradient references differentiate)
    against cases.recurrence64 (the numpy loop behind every forward reference): o, h, v_new, g and
    the final state, to float64 rounding, with and without g, segments and initial state."""
    p = build(case)
    raw = p.raw
    out = reference.recurrence(raw["q"], raw["k"], raw["v"], raw["g_raw"], raw["beta"],
                               initial_state=raw["initial_state"], segment_ids=raw["segment_ids"],
                               chunk_size=case.chunk_size, dtype=jnp.float64)
    for name, x in out._asdict().items():
        assert x.dtype == jnp.float64, name
        np.testing.assert_allclose(np.asarray(x), p.ref[name], rtol=1e-12, atol=1e-12,
                                   err_msg=name)


@pytest.mark.parametrize("implementation,tokens", [("xla", 700), ("interpret", 300)])
def test_beta_near_2_and_extreme_gates(implementation, tokens):
    """cases.stress_problem (near-reflections, gates near 0 and down to -8 in runs), bf16: o and
    the final state within SPEC's bf16 bound, every value finite (the GPU test_long_row_stress
    runs it on one row of 65536 tokens)."""
    inputs, ref = stress_problem(tokens, 2, 32, 16, 2)
    o, final_state = jax.jit(functools.partial(
        gdp_jax.chunk_gated_delta_product, output_final_state=True, chunk_size=64,
        implementation=implementation))(*inputs)
    assert_close(o, ref["o"], tolerance("bfloat16"), "o")
    assert_close(final_state, ref["final_state"], tolerance("bfloat16"), "final_state")


def test_reference_shares_the_cumsum():
    """The reference's g and the op's stage 1 are one function, not two copies that could drift."""
    assert reference.chunk_local_log2_cumsum is cumsum.chunk_local_log2_cumsum


# chunk 16, T = 48: segments [0,10) [10,16) [16] [17,30) [30,41) [41,48) in row 0 (one starts on
# the chunk boundary 16 and has length 1, one crosses 32, ids repeat non-adjacently); row 1
# starts segments at 15 and 33.
HAND_IDS = np.array([[0] * 10 + [1] * 6 + [0] + [1] * 13 + [0] * 11 + [2] * 7,
                     [5] * 15 + [6] * 18 + [5] * 15], np.int32)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_hand_built_segments(implementation):
    """The initial state reaches only each row's first segment: changing it changes nothing after
    the first segment start, nor the final state."""
    p = build(Case(48, 16, 16, 2, 16), segment_ids=HAND_IDS)
    o, final_state = run_full_op(p, implementation)
    assert_close(o, p.ref["o"], tolerance("float32"), "o")
    assert_close(final_state, p.ref["final_state"], tolerance("float32"), "final_state")
    o2, final2 = full_op_fn(implementation, 16)(*p.full_args(), initial_state=p.initial_state + 1.0,
                                                segment_ids=p.segment_ids)
    chex.assert_trees_all_equal((o2[0, 10:], o2[1, 15:], final2), (o[0, 10:], o[1, 15:], final_state))
    assert not np.allclose(o2[0, :10], o[0, :10])                 # the change did land


@pytest.mark.parametrize("tokens,implementation", [(1, "xla"), (1, "interpret"), (17, "interpret")])
def test_short_sequences(tokens, implementation):
    """T = 1 and T = chunk + 1 (a one-token last chunk: the sub-chunk grid's padding); row 1's last
    token starts a segment. (The jnp path's one-token last chunk: test_chunk_o.py.)"""
    ids = np.array([[0] * tokens, [0] * (tokens - 1) + [1]], np.int32)
    p = build(Case(tokens, 16, 16, 2, 16), segment_ids=ids)
    o, final_state = run_full_op(p, implementation)
    assert_close(o, p.ref["o"], tolerance("float32"), "o")
    assert_close(final_state, p.ref["final_state"], tolerance("float32"), "final_state")


def test_defaults_and_no_final_state():
    """implementation None, explicit scale and num_householder, output_final_state False."""
    p = build(BASE)
    op = jax.jit(functools.partial(gdp_jax.chunk_gated_delta_product, chunk_size=16, scale=0.3,
                                   num_householder=2))
    o, final_state = op(*p.full_args(), initial_state=p.initial_state, segment_ids=p.segment_ids)
    assert final_state is None
    assert_close(o, p.ref["o"] * 0.3 * BASE.key_dim ** 0.5, tolerance("float32"))


# use_qk_l2norm's undifferentiated forward: the WY kernel applies k's factors and returns them,
# which the walk and chunk_o apply; q's factors reach chunk_o's outputs. Each chunk_o variant:
# whole rows (float32, K 32; M = 3 at chunk 32, copy order "fused") and its K loop (16-bit,
# chunk 64, K 128: 32-key steps at M = 2, the value-column loop at M = 3).
# With and without segment ids; K = 256 (the WY kernel's widest keys).
L2NORM_FORWARD_CASES = [
    Case(77, 32, 16, 2, 16, segments=False),
    Case(130, 16, 32, 3, 32, dtype="bfloat16", initial_state=False),
    Case(70, 128, 64, 2, 64, dtype="bfloat16", batch=1, segments=False),
    Case(70, 100, 128, 3, 64, dtype="bfloat16", batch=1, gated=False),
    Case(45, 256, 32, 1, 64, dtype="bfloat16", batch=1, heads=1),
]


def _outside_kernels(jaxpr, primitive: str) -> int:
    """How many ``primitive`` equations a jaxpr has outside pallas_call kernels (sub-jaxprs of
    other equations included)."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            continue
        count += eqn.primitive.name == primitive
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    count += _outside_kernels(sub, primitive)
    return count


def _normalisations(jaxpr) -> int:
    """Passes that normalise q or k before the fused kernels: an XLA rsqrt, or the
    normalisation's forward kernel (``ops.l2norm.l2norm_and_factor``)."""
    return _outside_kernels(jaxpr, "rsqrt") + kernel_names(jaxpr).count("gdp_l2norm_fwd")


@pytest.mark.parametrize("case", L2NORM_FORWARD_CASES, ids=lambda c: c.id)
def test_l2norm_forward_inside_the_kernels(case, monkeypatch):
    """Raw q, k of varied norms: o and the final state against the recurrence on their
    normalised values, and against the differentiated path's o (the normalisation a separate
    step), within one rounding of the inputs' dtype. Outside the kernels the undifferentiated
    jaxpr normalises once (q's factors; k's are the WY kernel's), the differentiated one twice
    (q and k, by XLA or the normalisation's forward kernel: ``_normalisations``). The rule's program-count row is a speed threshold, lowered here so
    that these small problems take the fused path."""
    monkeypatch.setattr(dispatch, "L2NORM_FUSED_MIN_WALK_PROGRAMS", 1)
    p = build(case, qk_l2norm=True)
    op = l2norm_op_of_qk(p, "interpret")

    o, final_state = jax.jit(op)(p.q, p.k)
    assert_close(o, p.ref["o"], tolerance(case.dtype), "o")
    assert_close(final_state, p.ref["final_state"], tolerance(case.dtype), "final_state")

    o_composed, vjp = jax.vjp(op, p.q, p.k)
    assert_all_close(dict(o=o, final_state=final_state),
                     dict(o=o_composed[0], final_state=o_composed[1]), tolerance(case.dtype))
    assert _normalisations(jax.make_jaxpr(op)(p.q, p.k).jaxpr) == 1
    assert _normalisations(jax.make_jaxpr(lambda q, k: jax.vjp(op, q, k)[0])(p.q, p.k).jaxpr) == 2


@pytest.mark.parametrize("case", [Case(77, 32, 16, 2, 16), Case(130, 16, 32, 3, 32, initial_state=False),
                                  Case(70, 64, 32, 1, 64, gated=False, batch=1)], ids=lambda c: c.id)
def test_float32_wy_stage_in_jnp(case, monkeypatch):
    """dispatch.wy_fwd_runs_kernel's jnp route (compiled float32: ``wy_xla`` on the kernel's
    sub-chunk grid, with wy_bwd_xla as its VJP), taken here in the interpreter: o, the final state and every input's
    gradient against the recurrence, and use_qk_l2norm's fused forward (the keys' factors formed
    in jnp) and gradients against the recurrence on normalised q, k."""
    monkeypatch.setattr(dispatch, "wy_fwd_runs_kernel", lambda dtype, interpret: False)
    monkeypatch.setattr(dispatch, "wy_bwd_runs_kernel", lambda dtype, interpret: False)
    monkeypatch.setattr(dispatch, "L2NORM_FUSED_MIN_WALK_PROGRAMS", 1)
    p = build(case)
    o, final_state = run_full_op(p, "interpret")
    assert_close(o, p.ref["o"], tolerance(case.dtype), "o")
    assert_close(final_state, p.ref["final_state"], tolerance(case.dtype), "final_state")
    check_gradients(p, functools.partial(
        gdp_jax.chunk_gated_delta_product, output_final_state=True, segment_ids=p.segment_ids,
        chunk_size=case.chunk_size, implementation="interpret"), False)
    q = build(case, qk_l2norm=True)
    op = l2norm_op_of_qk(q, "interpret")
    o, final_state = jax.jit(op)(q.q, q.k)
    assert_close(o, q.ref["o"], tolerance(case.dtype), "o (use_qk_l2norm)")
    assert_close(final_state, q.ref["final_state"], tolerance(case.dtype), "final_state (use_qk_l2norm)")
    # and its gradients through the normalisation's VJP and wy_bwd_xla
    check_gradients(q, functools.partial(
        gdp_jax.chunk_gated_delta_product, output_final_state=True, segment_ids=q.segment_ids,
        chunk_size=case.chunk_size, use_qk_l2norm=True, implementation="interpret"), True)


def test_l2norm_gradients_where_the_forward_is_fused(monkeypatch):
    """Where the undifferentiated forward is fused (threshold lowered), the
    gradient goes through _l2norm_op's custom_vjp (its forward rule the composed op, its
    backward that op's VJP): every input's gradient against float64 autodiff of the
    recurrence, and the op's value under value_and_grad."""
    monkeypatch.setattr(dispatch, "L2NORM_FUSED_MIN_WALK_PROGRAMS", 1)
    case = Case(37, 16, 8, 2, 16)
    p = build(case, qk_l2norm=True)
    op = functools.partial(gdp_jax.chunk_gated_delta_product, output_final_state=True,
                           segment_ids=p.segment_ids, use_qk_l2norm=True,
                           chunk_size=case.chunk_size, implementation="interpret")
    assert _outside_kernels(jax.make_jaxpr(op)(*p.full_args()).jaxpr, "rsqrt") == 1   # fused
    check_gradients(p, op, qk_l2norm=True)


def test_l2norm_fused_rule(monkeypatch):
    """dispatch.l2norm_fused's table: Triton kernels throughout, at least 128 walk programs; and
    the op follows it: q and k are normalised outside the fused kernels (two passes) with too few
    walk programs (B * H * value blocks of 64: here 2 * 2 * 1), and inside them (one, q's factors)
    once the threshold is lowered to the problem's programs, with or without segment ids."""
    fused = dispatch.l2norm_fused
    assert fused("pallas", "pallas", 256) and fused("interpret", "interpret", 128)
    assert not fused("pallas", "pallas", 127)                   # B1 H16 V128 has 32
    assert not fused("xla", "xla", 256) and not fused("pallas", "xla", 256)
    assert not fused("pallas", "mosaic", 256)
    # Past K = 128 "pallas" runs chunk_o's forward on Mosaic GPU (jax >= 0.11), but the fused
    # forward takes the Triton kernel, the one that applies the factors: the fusion stays.
    monkeypatch.setattr(dispatch, "mosaic_by_default", lambda: True)
    q = jax.ShapeDtypeStruct((2, 128, 16, 256), jnp.bfloat16)        # 2 * 16 * 4 walk programs
    assert dispatch.chunk_o_implementation("pallas", q.dtype, 256, 256, 64) == "mosaic"
    config = gdp_op._OpConfig(scale=1.0, chunk_size=64, num_householder=2, implementation="pallas")
    assert gdp_op._l2norm_fused(config, q, 256)
    assert not gdp_op._l2norm_fused(config._replace(implementation="mosaic"), q, 256)
    p = build(Case(40, 32, 16, 2, 16), qk_l2norm=True)
    rsqrts = lambda **kw: _normalisations(jax.make_jaxpr(functools.partial(
        gdp_jax.chunk_gated_delta_product, use_qk_l2norm=True, chunk_size=16,
        implementation="interpret", **kw))(*p.full_args()).jaxpr)
    assert rsqrts(segment_ids=p.segment_ids) == 2 and rsqrts() == 2
    monkeypatch.setattr(dispatch, "L2NORM_FUSED_MIN_WALK_PROGRAMS", 4)
    assert rsqrts(segment_ids=p.segment_ids) == 1 and rsqrts() == 1
    monkeypatch.setattr(dispatch, "L2NORM_FUSED_MIN_WALK_PROGRAMS", 5)
    assert rsqrts() == 2


# ---------------------------------------------------------------------------------------------
# Gradients against float64 autodiff of the recurrence.

GRAD_CASES = {
    # name: (case, use_qk_l2norm, implementations)
    # g, segments, initial state; q, k through use_qk_l2norm (the gradient passes the norm).
    "g-seg-init-l2norm": (Case(37, 16, 8, 2, 16), True, IMPLEMENTATIONS),
    # No g, no initial state, no segments: the None plumbing of both custom_vjps (the jnp
    # path's is plain autodiff); M = 3 at chunk 32 puts three sub-chunks in a token chunk.
    "nog-noseg-noinit-M3": (Case(40, 32, 16, 3, 32, gated=False, segments=False,
                                 initial_state=False), False, ["interpret"]),
    # 16-bit inputs: 16-bit cotangents of h and v_new enter the reverse walk as they are, the
    # walks' dots take bf16 operands, the WY VJP kernel (bf16 operands) adds the walk's dk and
    # rounds dk, dv to the inputs' dtype. float16's branches (float32 walk dots, TF32 WY dots) are
    # tested per kernel (test_chunk_h.py, test_wy.py) and compiled in test_gpu.py. (The jnp
    # path's 16-bit gradient dtypes: test_chunk_o_bwd.py; its stages are float32.)
    "bf16": (Case(37, 16, 16, 2, 16, dtype="bfloat16"), False, ["interpret"]),
    # use_qk_l2norm with bfloat16: the keys' VJP inside the WY VJP kernel on its 16-bit route
    # (T^T dw from the reverse walk, bf16 operands); K != V, M = 3.
    "bf16-l2norm-M3": (Case(37, 32, 16, 3, 16, dtype="bfloat16"), True, ["interpret"]),
    # M = 1: one sub-chunk a token chunk, where the walk's h is also the backward's state before
    # every sub-chunk (stored once).
    "M1-l2norm": (Case(45, 32, 16, 1, 16), True, ["interpret"]),
}
GRAD_PARAMS = [(name, impl) for name, (_, _, impls) in GRAD_CASES.items() for impl in impls]


def check_gradients(p, op, qk_l2norm: bool):
    """o and every input's gradient of ``op`` (the full op with the problem's static options
    bound; called as op(q, k, v, g_raw, beta, initial_state=...)) against float64 autodiff of
    the recurrence, at SPEC's tolerance for the inputs' dtype."""
    dtype = p.case.dtype
    do, dfinal, expected = recurrence_grads(p, qk_l2norm=qk_l2norm)
    names = [n for n in GRAD_NAMES if expected[n] is not None]
    primals = dict(q=p.q, k=p.k, v=p.v, g_raw=p.g_raw, beta=p.beta,
                   initial_state=p.initial_state)

    def loss(*args):
        a = dict(primals, **dict(zip(names, args)))
        o, final_state = op(a["q"], a["k"], a["v"], a["g_raw"], a["beta"],
                            initial_state=a["initial_state"])
        return (jnp.sum(o.astype(jnp.float32) * do.astype(np.float32))
                + jnp.sum(final_state * dfinal.astype(np.float32))), o

    (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(names))),
                                               has_aux=True))(*[primals[n] for n in names])
    assert_close(o, p.ref["o"], tolerance(dtype), "o")
    grads = dict(zip(names, grads))
    for n in names:
        chex.assert_equal_shape([grads[n], primals[n]])
        chex.assert_type(grads[n], primals[n].dtype)
    assert_all_close(grads, {n: expected[n] for n in names}, tolerance(dtype))


def kernel_eqns(jaxpr) -> list:
    """The pallas_call equations of a jaxpr, sub-jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found += kernel_eqns(sub)
    return found


def kernel_name(eqn) -> str:
    name = eqn.params.get("name_and_src_info", eqn.params.get("name"))
    return getattr(name, "name", name)


def kernel_names(jaxpr) -> list:
    """The names of the pallas_call kernels in a jaxpr, sub-jaxprs included."""
    return [kernel_name(eqn) for eqn in kernel_eqns(jaxpr)]


@pytest.mark.parametrize("m,l2norm", [(2, False), (3, True)])
def test_states_stored_once_under_differentiation(m, l2norm):
    """Differentiated, the walk stores the state before every sub-chunk and nothing else of h:
    chunk_o reads the token chunks' states out of it (forward and backward). Undifferentiated it
    stores h at token chunks alone. Gradients: the other tests of this file."""
    case = Case(40, 32, 16, m, 16)
    p = build(case, qk_l2norm=l2norm)
    op = functools.partial(gdp_jax.chunk_gated_delta_product, use_qk_l2norm=l2norm,
                           chunk_size=16, implementation="interpret")
    args = p.full_args()
    loss = lambda q: jnp.sum(op(q, *args[1:])[0])

    def walk_states(jaxpr):
        (walk,) = [e for e in kernel_eqns(jaxpr) if kernel_name(e) == "gdp_chunk_h_fwd"]
        return [v.aval.shape[1] for v in walk.outvars if len(v.aval.shape) == 5
                and v.aval.shape[-2:] == (32, 16)]      # [B, states, H, K, V] outputs

    token_chunks, sub_chunks = 3, 3 * m     # T = 40 at chunk 16; 16-position sub-chunks
    assert walk_states(jax.make_jaxpr(jax.grad(loss))(p.q).jaxpr) == [sub_chunks]
    assert walk_states(jax.make_jaxpr(loss)(p.q).jaxpr) == [token_chunks]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_keys_l2norm_vjp_in_the_wy_kernel(dtype):
    """Where the WY VJP kernel runs (the interpreter: every dtype) and K is at most 128,
    use_qk_l2norm's gradient takes the normalisation's own VJP kernel for q alone: k's runs
    inside the WY VJP. Past 128 keys, or where that kernel does not run (compiled float32, the
    jnp path), the normalisation is its own step for both."""
    def kernels(case):
        p = build(case, qk_l2norm=True)
        op = functools.partial(gdp_jax.chunk_gated_delta_product, use_qk_l2norm=True,
                               chunk_size=16, implementation="interpret")
        loss = lambda q, k: jnp.sum(op(q, k, *p.full_args()[2:])[0].astype(jnp.float32))
        return kernel_names(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(p.q, p.k).jaxpr)

    names = kernels(Case(40, 32, 16, 2, 16, dtype=dtype))
    assert names.count("gdp_l2norm_bwd") == 1 and names.count("gdp_wy_bwd") == 1, names
    assert names.count("gdp_l2norm_fwd") == 1, names          # k's rows and factors in one pass
    names = kernels(Case(40, 256, 16, 1, 16, dtype=dtype))
    assert names.count("gdp_l2norm_bwd") == 2 and "gdp_l2norm_fwd" not in names, names
    rule = dispatch.keys_l2norm_vjp_in_wy_kernel
    assert rule("pallas", jnp.bfloat16, False, 128) and rule("pallas", jnp.float16, False, 100)
    assert rule("interpret", jnp.float32, True, 64)
    assert not rule("pallas", jnp.float32, False, 64) and not rule("xla", jnp.bfloat16, False, 64)
    assert not rule("pallas", jnp.bfloat16, False, 256)
    assert not rule("pallas", jnp.bfloat16, False, 200)


def test_gradients_through_the_transposed_walk(monkeypatch):
    """Rows of few walk programs narrow the walks' value blocks, and the forward walks (the
    primal one and the one that stores h at every sub-chunk for the backward) then carry the
    state transposed (``chunk_h.pallas_fwd.BlockSizes.transposed``): o, the final state and every
    input's gradient against float64 autodiff of the recurrence, bf16, gates, segments and an
    initial state. The walk-length threshold is lowered so that a short row narrows."""
    from gdp_jax.ops.chunk_h import pallas_fwd
    monkeypatch.setattr(pallas_fwd, "LONG_WALK_STEPS", 1)
    chosen = []
    table = pallas_fwd.default_block_sizes
    monkeypatch.setattr(pallas_fwd, "default_block_sizes",
                        lambda *a, **kw: chosen.append(table(*a, **kw)) or chosen[-1])
    case = Case(37, 16, 32, 2, 16, dtype="bfloat16")
    p = build(case)
    op = functools.partial(gdp_jax.chunk_gated_delta_product, output_final_state=True,
                           segment_ids=p.segment_ids, chunk_size=case.chunk_size,
                           implementation="interpret")
    check_gradients(p, op, False)
    assert chosen and all(sizes.transposed and sizes.block_v == 16 for sizes in chosen), chosen


@pytest.mark.parametrize("name,implementation", GRAD_PARAMS)
def test_gradients_against_recurrence(name, implementation):
    case, l2norm, _ = GRAD_CASES[name]
    p = build(case, qk_l2norm=l2norm)
    check_gradients(p, functools.partial(
        gdp_jax.chunk_gated_delta_product, output_final_state=True, segment_ids=p.segment_ids,
        use_qk_l2norm=l2norm, chunk_size=case.chunk_size, implementation=implementation), l2norm)


@pytest.mark.parametrize("case", [
    Case(37, 16, 16, 2, 16, dtype="bfloat16"),
    Case(45, 32, 16, 3, 16, dtype="bfloat16", gated=False, initial_state=False),
    Case(40, 16, 32, 1, 32, dtype="bfloat16", segments=False)], ids=lambda c: c.id)
def test_backward_walks_from_inverse(case, monkeypatch):
    """dispatch.backward_walks_from_inverse's route (bfloat16's, at every K), against the w, u
    route forced off it: the differentiable forward's WY kernel writes T alone, the forward walk
    applies it and the reverse walk forms w^T dvt from it. o and every input's gradient against
    the recurrence, and the gradients of k, v and beta within bf16 rounding of the w, u route's."""
    from gdp_jax.ops.chunk_h import pallas_bwd
    seen, original = [], pallas_bwd.chunk_h_bwd_walk

    def recording(*args, **kwargs):
        seen.append(kwargs.get("inverse") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(pallas_bwd, "chunk_h_bwd_walk", recording)
    p = build(case)
    op = functools.partial(gdp_jax.chunk_gated_delta_product, output_final_state=True,
                           segment_ids=p.segment_ids, chunk_size=case.chunk_size,
                           implementation="interpret")

    def grads():
        loss = lambda k, v, beta: jnp.sum(jnp.square(op(
            p.q, k, v, p.g_raw, beta, initial_state=p.initial_state)[0].astype(jnp.float32)))
        return dict(zip(("k", "v", "beta"), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(
            p.k, p.v, p.beta)))

    monkeypatch.setattr(dispatch, "backward_walks_from_inverse", lambda dtype: True)
    check_gradients(p, op, False)
    from_inverse = grads()
    assert seen and all(seen)
    monkeypatch.setattr(dispatch, "backward_walks_from_inverse", lambda dtype: False)
    seen.clear()
    with_w = grads()
    assert seen and not any(seen)
    assert_all_close(from_inverse, with_w, tolerance(case.dtype))


@pytest.mark.parametrize("from_inverse", [True, False], ids=["from_T", "from_w"])
def test_narrow_value_blocks_where_walks_are_few(from_inverse, monkeypatch):
    """chunk_h.pallas_fwd.value_block's rule, forced at this small shape (every walk counted long
    and few): both walks run 16 value columns a program, V = 48 over four of them, from T and
    from w. o and every input's gradient against the recurrence."""
    from gdp_jax.ops.chunk_h import pallas_bwd, pallas_fwd
    monkeypatch.setattr(pallas_fwd, "LONG_WALK_STEPS", 1)
    monkeypatch.setattr(pallas_fwd, "FEW_PROGRAMS", 1 << 20)
    monkeypatch.setattr(dispatch, "backward_walks_from_inverse",
                        lambda dtype: from_inverse)
    blocks, original = [], pallas_fwd.value_block

    def recording(*args, **kwargs):
        blocks.append(original(*args, **kwargs))
        return blocks[-1]

    monkeypatch.setattr(pallas_fwd, "value_block", recording)
    monkeypatch.setattr(pallas_bwd, "value_block", recording)
    p = build(Case(45, 32, 48, 2, 16, dtype="bfloat16"))
    check_gradients(p, functools.partial(
        gdp_jax.chunk_gated_delta_product, output_final_state=True, segment_ids=p.segment_ids,
        chunk_size=16, implementation="interpret"), False)
    assert len(blocks) >= 2 and set(blocks) == {16}


# ---------------------------------------------------------------------------------------------
# Transformations and dispatch

def _check_jit_vmap_over_rows(p, implementation):
    """jit(vmap) of the op over p's rows, one row per call (each packed differently): o and the
    final state against the recurrence at the inputs' tolerance."""
    add = lambda x: x[None]

    def one_row(q, k, v, g, beta, initial_state, segment_ids):
        o, s = gdp_jax.chunk_gated_delta_product(
            add(q), add(k), add(v), add(g), add(beta), initial_state=add(initial_state),
            segment_ids=add(segment_ids), output_final_state=True, chunk_size=p.case.chunk_size,
            implementation=implementation)
        return o[0], s[0]

    o, final_state = jax.jit(jax.vmap(one_row))(*p.full_args(), p.initial_state, p.segment_ids)
    assert_close(o, p.ref["o"], tolerance(p.case.dtype), "o")
    assert_close(final_state, p.ref["final_state"], tolerance(p.case.dtype), "final_state")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_jit_vmap_over_differently_packed_rows(implementation):
    """vmap over rows packed differently: "interpret" vmaps the Pallas kernels (an extra grid axis)
    and the states' custom_vjp, "xla" the jnp stages."""
    _check_jit_vmap_over_rows(build(BASE), implementation)


def test_vmap_where_the_walk_applies_inverse(monkeypatch):
    """The 16-bit forward's route where the walk applies the WY kernel's T (forced here at a small
    K) under jit(vmap) over differently packed rows: the kernels with their extra operands (T,
    beta) take the batch as a grid axis."""
    monkeypatch.setattr(dispatch, "walk_applies_inverse", lambda dtype, key_dim: True)
    _check_jit_vmap_over_rows(build(Case(77, 32, 16, 2, 16, dtype="bfloat16")), "interpret")


def test_pallas_takes_the_jnp_stages_beyond_the_kernels_widths():
    """K above 256 (padded to 512) is wider than the compiled kernels are built for:
    implementation="pallas" runs every stage in jnp, forward and backward, so it works on this
    GPU-less host (a kernel would fail here), gives "xla"'s o bit for bit and the recurrence's
    gradients."""
    p = build(Case(21, 260, 16, 2, 16, batch=1, heads=1))
    do, dfinal, expected = recurrence_grads(p)

    def loss(*args):
        o, final_state = gdp_jax.chunk_gated_delta_product(
            *args[:5], initial_state=args[5], output_final_state=True,
            segment_ids=p.segment_ids, chunk_size=16, implementation="pallas")
        return jnp.sum(o * do.astype(np.float32)) + jnp.sum(final_state * dfinal.astype(np.float32)), o

    (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(
        *p.full_args(), p.initial_state)
    chex.assert_trees_all_equal(o, run_full_op(p, "xla")[0])
    assert_close(o, p.ref["o"], tolerance("float32"))
    assert_all_close(dict(zip(GRAD_NAMES, grads)), expected, tolerance("float32"))


def test_dispatch_rules():
    """The full op's stage and dtype rules (_src.dispatch), from plain values."""
    f32, bf16, f16, f64 = (jnp.dtype(x) for x in ("float32", "bfloat16", "float16", "float64"))
    assert dispatch.states_implementation("pallas", bf16, 256, 256) == "pallas"
    assert dispatch.states_implementation("pallas", bf16, 260, 16) == "xla"   # pads to 512
    assert dispatch.states_implementation("pallas", f32, 16, 300) == "xla"
    assert dispatch.states_implementation("interpret", f32, 16, 300) == "interpret"
    assert dispatch.states_implementation("interpret", f64, 16, 16) == "xla"
    assert dispatch.states_implementation("xla", bf16, 16, 16) == "xla"
    assert [dispatch.work_dtype(d) for d in (f32, bf16, f16)] == [f32, bf16, f16]
    assert [dispatch.walk_bwd_dot_dtype(d) for d in (f32, bf16, f16)] == [f32, bf16, f32]
    assert [dispatch.wy_bwd_runs_kernel(d, False) for d in (f32, bf16, f16)] == [False, True, True]
    assert dispatch.wy_bwd_runs_kernel(f32, True)
    assert [dispatch.wy_fwd_runs_kernel(d, False) for d in (f32, bf16, f16)] == [False, True, True]
    assert dispatch.wy_fwd_runs_kernel(f32, True)
    assert [dispatch.walk_applies_inverse(d, 128) for d in (f32, bf16, f16)] == [False, True, True]
    assert [dispatch.walk_applies_inverse(bf16, k) for k in (16, 64, 65, 256)] == [True] * 4
    assert [dispatch.backward_walks_from_inverse(d) for d in (f32, bf16, f16)] == [False, True, False]
    assert dispatch.wy_bwd_dots(f32) == (jax.lax.Precision.HIGHEST, None)
    assert dispatch.wy_bwd_dots(bf16) == (None, bf16)
    assert dispatch.wy_bwd_dots(f16) == (None, None)
