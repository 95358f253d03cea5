"""chunk_gated_delta_product (the full op), its stages and recurrent_gdp_step, on CPU.

Everything is checked against SPEC's recurrence evaluated in float64 (gdp_jax.reference): o and the
final state of the op, h and v_new of the stages, gradients of q, k, v, g, beta and initial_state
against autodiff of the recurrence, and the decode step against the chunked op token by token.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax import reference
from gdp_jax.chunk_h import chunk_h_xla
from gdp_jax.chunk_h_pallas import chunk_h_pallas
from gdp_jax.cumsum import chunk_local_log2_cumsum
from gdp_jax.segments import segment_runs
from gdp_jax.wy import wy_xla
from helpers import random_segment_ids, rel_err

TOL = {np.float32: 1e-5, jnp.bfloat16: 2e-2}     # SPEC: f32 on CPU, half inputs
GRAD_TOL = 1e-4                                  # f32 gradients against float64 autodiff


def _l2norm64(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


_PROBLEMS = {}


def make_full_problem(seed, *, batch=2, tokens=77, heads=2, key_dim=32, value_dim=16, m=2,
                      chunk_size=16, gated=True, segments=True, initial_state=True,
                      dtype=np.float32, normalized_keys=True, segment_ids=None):
    """Random inputs of the full op (rounded to ``dtype``) and the float64 recurrence over them.

    With ``normalized_keys=False`` q and k are raw normals and the reference sees them
    L2-normalised in float64 (for use_qk_l2norm). Cached: the recurrence is slow to compile.
    """
    key = (seed, batch, tokens, heads, key_dim, value_dim, m, chunk_size, gated, segments,
           initial_state, jnp.dtype(dtype).name, normalized_keys,
           None if segment_ids is None else np.asarray(segment_ids).tobytes())
    if key in _PROBLEMS:
        return _PROBLEMS[key]
    rng = np.random.default_rng(seed)
    cast = lambda x: None if x is None else np.asarray(jnp.asarray(x, dtype), np.float64)
    q = cast(rng.normal(size=(batch, tokens, heads, key_dim)))
    k = rng.normal(size=(batch, tokens * m, heads, key_dim))
    if normalized_keys:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    k = cast(k)
    v = cast(rng.normal(size=(batch, tokens * m, heads, value_dim)))
    beta = rng.uniform(0.05, 1.95, size=(batch, tokens * m, heads)).astype(np.float32)
    g = (-rng.uniform(0.0, 0.25, size=(batch, tokens, heads))).astype(np.float32) if gated else None
    state0 = (0.5 * rng.normal(size=(batch, heads, key_dim, value_dim))).astype(np.float32) \
        if initial_state else None
    if segment_ids is not None:
        seg = np.asarray(segment_ids, np.int32)
    else:
        seg = random_segment_ids(rng, batch, tokens, chunk_size) if segments else None
    q_ref, k_ref = (q, k) if normalized_keys else (_l2norm64(q), _l2norm64(k))
    ref = reference.recurrence(q_ref, k_ref, v, g, beta, initial_state=state0, segment_ids=seg,
                               chunk_size=chunk_size, dtype=jnp.float64)
    p = dict(q=jnp.asarray(q, dtype), k=jnp.asarray(k, dtype), v=jnp.asarray(v, dtype),
             g=None if g is None else jnp.asarray(g), beta=jnp.asarray(beta),
             initial_state=None if state0 is None else jnp.asarray(state0),
             segment_ids=None if seg is None else jnp.asarray(seg), m=m, chunk_size=chunk_size,
             ref={name: np.asarray(x) for name, x in ref._asdict().items()},
             raw=dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=state0, segment_ids=seg))
    _PROBLEMS[key] = p
    return p


@functools.lru_cache(maxsize=None)
def _jitted_op(implementation, chunk_size, **kwargs):
    """One jitted op per static configuration, so tests on one shape share a compilation."""
    return jax.jit(functools.partial(gdp_jax.chunk_gated_delta_product, chunk_size=chunk_size,
                                     implementation=implementation, output_final_state=True,
                                     **kwargs))


def run_op(p, implementation="xla", **kwargs):
    op = _jitted_op(implementation, p["chunk_size"], **kwargs)
    return op(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=p["initial_state"],
              segment_ids=p["segment_ids"])


# ----------------------------------------------------------------------------------------------
# Forward against the float64 recurrence.

# A covering subset, not the product: ragged T (77, 130) and exact multiples, M 1..3, K != V both
# ways, every chunk size seen with and without g / segments / initial_state, f32 and bf16.
FORWARD_CASES = [
    # tokens, key_dim, value_dim, m, chunk_size, gated, segments, initial_state, dtype
    (77, 32, 16, 2, 16, True, True, True, np.float32),
    (130, 16, 32, 3, 32, True, True, False, np.float32),
    (64, 32, 16, 1, 16, False, True, True, np.float32),
    (130, 16, 16, 1, 64, True, False, True, np.float32),
    (77, 16, 32, 3, 16, False, False, False, np.float32),
    (77, 32, 16, 2, 16, True, True, True, jnp.bfloat16),
    (130, 16, 32, 3, 32, False, True, True, jnp.bfloat16),
]


def _case_id(case):
    tokens, key_dim, value_dim, m, chunk_size, gated, segments, init, dtype = case
    return (f"T{tokens}-K{key_dim}-V{value_dim}-M{m}-BT{chunk_size}-{'g' if gated else 'nog'}-"
            f"{'seg' if segments else 'noseg'}-{'init' if init else 'noinit'}-{jnp.dtype(dtype).name}")


def _case_problem(case):
    tokens, key_dim, value_dim, m, chunk_size, gated, segments, init, dtype = case
    return make_full_problem(tokens + m, tokens=tokens, key_dim=key_dim, value_dim=value_dim, m=m,
                             chunk_size=chunk_size, gated=gated, segments=segments,
                             initial_state=init, dtype=dtype)


# "interpret" runs the GPU path's kernels (WY on sub-chunks, the sub-chunk state walk, chunk_o) in
# Pallas' interpreter: the chunk 128 case makes two 64-position sub-chunks per token chunk at M = 1,
# the M = 3 cases split tokens across sub-chunks.
@pytest.mark.parametrize("implementation", ["xla", "interpret"])
@pytest.mark.parametrize("case", FORWARD_CASES + [
    (200, 16, 16, 1, 128, True, True, True, np.float32),
    (150, 16, 16, 3, 64, True, True, True, np.float32)], ids=_case_id)
def test_against_recurrence(case, implementation):
    p = _case_problem(case)
    o, final_state = run_op(p, implementation)
    assert o.shape == p["ref"]["o"].shape and o.dtype == p["v"].dtype
    assert final_state.shape == p["ref"]["final_state"].shape and final_state.dtype == jnp.float32
    tol = TOL[case[-1]]
    assert rel_err(o, p["ref"]["o"]) < tol
    assert rel_err(final_state, p["ref"]["final_state"]) < tol


@pytest.mark.parametrize("case", [FORWARD_CASES[1]], ids=_case_id)
def test_stages_against_recurrence(case):
    # Stages 1-3 on their own: g, h, v_new and the final state exactly as SPEC defines them.
    p = _case_problem(case)
    m, bt = p["m"], p["chunk_size"]
    runs = None if p["segment_ids"] is None else segment_runs(p["segment_ids"])
    g = None if p["g"] is None else chunk_local_log2_cumsum(p["g"], bt)
    if g is not None:
        assert rel_err(g, p["ref"]["g"]) < 1e-6

    @jax.jit
    def stages(k, v, beta, g, runs, initial_state):
        w, u = wy_xla(k, v, beta, g, runs, chunk_size=bt, num_householder=m)
        return chunk_h_xla(k, w, u, g, runs, initial_state, chunk_size=bt, num_householder=m)

    h, v_new, final_state = stages(p["k"], p["v"], p["beta"], g, runs, p["initial_state"])
    assert rel_err(h, p["ref"]["h"]) < 1e-5
    assert rel_err(v_new, p["ref"]["v_new"]) < 1e-5
    assert rel_err(final_state, p["ref"]["final_state"]) < 1e-5


def test_cumsum_lives_in_one_place():
    assert reference.chunk_local_log2_cumsum is chunk_local_log2_cumsum


def test_interpret_output_stage():
    # implementation="interpret" runs chunk_o's Pallas kernel in the interpreter for stage 4.
    p = _case_problem(FORWARD_CASES[0])
    o, final_state = run_op(p, "interpret")
    assert rel_err(o, p["ref"]["o"]) < TOL[np.float32]
    assert rel_err(final_state, p["ref"]["final_state"]) < TOL[np.float32]


@pytest.mark.parametrize("dot_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", [FORWARD_CASES[0], FORWARD_CASES[4]], ids=_case_id)
def test_chunk_h_kernel_in_interpreter(case, dot_dtype):
    # The Pallas state walk (interpreted) against the recurrence's h, v_new and final state; the
    # second case has no g, no segments, no initial state and V = 32 split into value blocks.
    # bfloat16 dots (the op's choice for 16-bit inputs) round w, k, the state and v_new once per
    # dot, so they are held to the half-input tolerance.
    p = _case_problem(case)
    m, bt = p["m"], p["chunk_size"]
    runs = None if p["segment_ids"] is None else segment_runs(p["segment_ids"])
    g = None if p["g"] is None else chunk_local_log2_cumsum(p["g"], bt)

    @jax.jit
    def stages(k, v, beta, g, runs, initial_state):
        w, u = wy_xla(k, v, beta, g, runs, chunk_size=bt, num_householder=m)
        return chunk_h_pallas(k, w, u, g, runs, initial_state, chunk_size=bt, num_householder=m,
                              interpret=True, block_v=16, dot_dtype=dot_dtype)

    h, v_new, final_state = stages(p["k"], p["v"], p["beta"], g, runs, p["initial_state"])
    tol = 1e-5 if dot_dtype == jnp.float32 else TOL[jnp.bfloat16]
    assert rel_err(h, p["ref"]["h"]) < tol
    assert rel_err(v_new, p["ref"]["v_new"]) < tol
    assert rel_err(final_state, p["ref"]["final_state"]) < tol


def test_chunk_h_kernel_writes_every_chunk_too():
    # every_chunk_too (the full op's forward rule): the state before every chunk as a fourth
    # result, alongside h before every `subchunks`-th chunk; both equal the plain walk's h.
    p = make_full_problem(61, tokens=64, key_dim=32, value_dim=16, m=2, chunk_size=16)
    runs = segment_runs(p["segment_ids"])
    g = chunk_local_log2_cumsum(p["g"], 16)
    kw = dict(chunk_size=16, num_householder=2)
    w, u = wy_xla(p["k"], p["v"], p["beta"], g, runs, **kw)
    walk = lambda **extra: chunk_h_pallas(p["k"], w, u, g, runs, p["initial_state"],
                                          interpret=True, block_v=16, **kw, **extra)
    h_plain, v_new_plain, final_plain = walk()
    h, v_new, final_state, h_every = walk(subchunks=2, every_chunk_too=True)
    np.testing.assert_array_equal(np.asarray(h_every), np.asarray(h_plain))
    np.testing.assert_array_equal(np.asarray(h), np.asarray(h_plain[:, ::2]))
    np.testing.assert_array_equal(np.asarray(v_new), np.asarray(v_new_plain))
    np.testing.assert_array_equal(np.asarray(final_state), np.asarray(final_plain))
    assert rel_err(h_every, p["ref"]["h"]) < 1e-5


# implementation="interpret": the states' custom_vjp (sub-chunk kernels forward; reverse-walk kernel
# and WY VJP backward) and chunk_o's Pallas backward. No g and no initial state exercise the None
# plumbing of both VJPs; M = 3 at chunk 32 puts three sub-chunks in a token chunk, K != V.
@pytest.mark.parametrize("m,chunk_size,key_dim,value_dim,segments",
                         [(2, 16, 16, 16, True), (3, 32, 32, 16, False)])
def test_interpret_gradients_match_xla(m, chunk_size, key_dim, value_dim, segments):
    p = make_full_problem(51, batch=1, tokens=40, heads=2, key_dim=key_dim, value_dim=value_dim,
                          m=m, chunk_size=chunk_size, gated=False, initial_state=False,
                          segments=segments)
    do = jnp.asarray(np.random.default_rng(6).normal(size=p["ref"]["o"].shape), jnp.float32)
    seg = p["segment_ids"]

    def grads(implementation):
        def loss(q, k, v, beta):
            o, final_state = gdp_jax.chunk_gated_delta_product(
                q, k, v, None, beta, output_final_state=True, segment_ids=seg,
                chunk_size=chunk_size, implementation=implementation)
            return jnp.sum(o * do) + jnp.sum(final_state)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(p["q"], p["k"], p["v"], p["beta"])

    for name, got, want in zip(("q", "k", "v", "beta"), grads("interpret"), grads("xla")):
        assert rel_err(got, want) < 1e-5, name


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_hand_built_segments(implementation):
    # chunk 16, T = 48: segments [0,10) [10,16) [16] [17,30) [30,41) [41,48) in row 0 (one starts
    # on the chunk boundary 16 and has length 1, one crosses 32, ids repeat non-adjacently); row 1
    # starts segments at 15 and 33. The initial state must reach only each row's first segment.
    ids = np.array([[0] * 10 + [1] * 6 + [0] + [1] * 13 + [0] * 11 + [2] * 7,
                    [5] * 15 + [6] * 18 + [5] * 15], np.int32)
    p = make_full_problem(7, tokens=48, key_dim=16, value_dim=16, m=2, chunk_size=16,
                          segment_ids=ids)
    o, final_state = run_op(p, implementation)
    assert rel_err(o, p["ref"]["o"]) < TOL[np.float32]
    assert rel_err(final_state, p["ref"]["final_state"]) < TOL[np.float32]
    # Changing the initial state changes nothing after the first segment start.
    o2, final2 = run_op(dict(p, initial_state=p["initial_state"] + 1.0), implementation)
    np.testing.assert_array_equal(np.asarray(o2)[0, 10:], np.asarray(o)[0, 10:])
    np.testing.assert_array_equal(np.asarray(o2)[1, 15:], np.asarray(o)[1, 15:])
    np.testing.assert_array_equal(np.asarray(final2), np.asarray(final_state))


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
@pytest.mark.parametrize("tokens", [1, 17])
def test_short_sequences(tokens, implementation):
    # T = 1 and T = chunk_size + 1 (a one-token last chunk); row 1's last token starts a segment.
    ids = np.array([[0] * tokens, [0] * (tokens - 1) + [1]], np.int32)
    p = make_full_problem(tokens, tokens=tokens, key_dim=16, value_dim=16, m=2, chunk_size=16,
                          segment_ids=ids)
    o, final_state = run_op(p, implementation)
    assert rel_err(o, p["ref"]["o"]) < TOL[np.float32]
    assert rel_err(final_state, p["ref"]["final_state"]) < TOL[np.float32]


def test_use_qk_l2norm():
    p = make_full_problem(21, tokens=77, key_dim=32, value_dim=16, m=2, chunk_size=16,
                          normalized_keys=False)
    o, final_state = run_op(p, use_qk_l2norm=True)
    assert rel_err(o, p["ref"]["o"]) < TOL[np.float32]
    assert rel_err(final_state, p["ref"]["final_state"]) < TOL[np.float32]


def test_defaults_and_no_final_state():
    p = _case_problem(FORWARD_CASES[0])
    # implementation None; the reference used the default scale K ** -0.5 and o is linear in scale.
    op = jax.jit(functools.partial(gdp_jax.chunk_gated_delta_product, chunk_size=16, scale=0.3,
                                   num_householder=2))
    o, final_state = op(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=p["initial_state"],
                        segment_ids=p["segment_ids"])
    assert final_state is None
    assert rel_err(o, p["ref"]["o"] * 0.3 * 32 ** 0.5) < TOL[np.float32]


# ----------------------------------------------------------------------------------------------
# Decode step.

@pytest.mark.parametrize("use_qk_l2norm", [False, True])
def test_decode_step_matches_chunked_op_token_by_token(use_qk_l2norm):
    p = make_full_problem(31, tokens=20, key_dim=16, value_dim=32, m=3, chunk_size=16,
                          segments=False, normalized_keys=not use_qk_l2norm)
    o_chunked, final_chunked = run_op(p, use_qk_l2norm=use_qk_l2norm)
    batch, tokens, heads, _ = p["q"].shape
    m = p["m"]
    k_t = p["k"].reshape(batch, tokens, m, heads, -1)
    v_t = p["v"].reshape(batch, tokens, m, heads, -1)
    beta_t = p["beta"].reshape(batch, tokens, m, heads)
    step = functools.partial(gdp_jax.recurrent_gdp_step, use_qk_l2norm=use_qk_l2norm)

    def body(state, xs):
        o_t, state = step(*xs, state)
        return state, o_t

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (p["q"], k_t, v_t, p["g"], beta_t))
    final, o = jax.jit(lambda s, xs: jax.lax.scan(body, s, xs))(p["initial_state"], xs)
    o = jnp.moveaxis(o, 0, 1)
    assert o.dtype == p["v"].dtype and final.dtype == jnp.float32
    assert rel_err(o, o_chunked) < 1e-5
    assert rel_err(final, final_chunked) < 1e-5
    assert rel_err(o, p["ref"]["o"]) < 1e-5


def test_decode_step_without_gate_and_scale():
    rng = np.random.default_rng(0)
    b, m, h, kd, vd = 2, 2, 3, 8, 4
    q = rng.normal(size=(b, h, kd)).astype(np.float32)
    k = rng.normal(size=(b, m, h, kd)).astype(np.float32)
    v = rng.normal(size=(b, m, h, vd)).astype(np.float32)
    beta = rng.uniform(0.1, 1.9, size=(b, m, h)).astype(np.float32)
    s = rng.normal(size=(b, h, kd, vd)).astype(np.float32)
    o, s_new = gdp_jax.recurrent_gdp_step(q, k, v, None, beta, s, scale=0.5)
    s64 = s.astype(np.float64)
    for step in range(m):
        kj = k[:, step].astype(np.float64)
        vn = beta[:, step, :, None] * (v[:, step] - np.einsum("bhkv,bhk->bhv", s64, kj))
        s64 = s64 + np.einsum("bhk,bhv->bhkv", kj, vn)
    assert rel_err(s_new, s64) < 1e-6
    assert rel_err(o, 0.5 * np.einsum("bhkv,bhk->bhv", s64, q)) < 1e-6


# ----------------------------------------------------------------------------------------------
# Gradients against autodiff of the float64 recurrence.

GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


_GRAD_REFS = {}


def _gradient_problem(use_qk_l2norm):
    """Inputs, cotangents and float64 autodiff of the recurrence (cached: it is slow to compile)."""
    if use_qk_l2norm in _GRAD_REFS:
        return _GRAD_REFS[use_qk_l2norm]
    p = make_full_problem(41, batch=2, tokens=37, heads=2, key_dim=16, value_dim=8, m=2,
                          chunk_size=16, normalized_keys=not use_qk_l2norm)
    rng = np.random.default_rng(5)
    do = rng.normal(size=p["ref"]["o"].shape)
    dfinal = rng.normal(size=p["ref"]["final_state"].shape)
    seg = p["raw"]["segment_ids"]
    with jax.enable_x64(True):
        def loss_ref(q, k, v, g, beta, initial_state):
            if use_qk_l2norm:
                norm = lambda x: x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)
                q, k = norm(q), norm(k)
            ref = reference.recurrence(q, k, v, g, beta, initial_state=initial_state,
                                       segment_ids=seg, chunk_size=16, dtype=jnp.float64)
            return jnp.sum(ref.o * do) + jnp.sum(ref.final_state * dfinal)

        primals = [jnp.asarray(np.asarray(p["raw"][n], np.float64)) for n in GRAD_NAMES]
        expected = jax.grad(loss_ref, argnums=tuple(range(6)))(*primals)
        expected = [np.asarray(x) for x in expected]
    _GRAD_REFS[use_qk_l2norm] = (p, do, dfinal, expected)
    return _GRAD_REFS[use_qk_l2norm]


# One case, with use_qk_l2norm: the gradients of q and k then also pass through the normalisation.
# "interpret": the Pallas path's custom_vjps, kernels interpreted, against the same float64 autodiff.
def test_pallas_takes_the_jnp_stages_beyond_the_kernels_widths():
    """K above 256 (padded to 512) is wider than the compiled kernels are built for:
    implementation="pallas" runs every stage in jnp, forward and backward, and so works on this
    GPU-less host (a kernel would fail here) and equals "xla"."""
    p = make_full_problem(53, batch=1, tokens=21, heads=1, key_dim=260, value_dim=16, m=2,
                          chunk_size=16)
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def run(implementation):
        def loss(*args):
            o, final_state = gdp_jax.chunk_gated_delta_product(
                *args[:5], initial_state=args[5], output_final_state=True,
                segment_ids=p["segment_ids"], chunk_size=16, implementation=implementation)
            return jnp.sum(o ** 2) + jnp.sum(final_state), o
        return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(
            *[p[n] for n in names])

    (_, o), grads = run("pallas")
    (_, o_xla), grads_xla = run("xla")
    assert rel_err(o, p["ref"]["o"]) < TOL[np.float32]
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_xla))
    for name, got, want in zip(names, grads, grads_xla):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_interpret_16_bit_gradients(dtype):
    """16-bit inputs through the Pallas path's custom_vjps (interpreted): 16-bit cotangents of h and
    v_new enter the reverse walk as they are, the walks' dots take 16-bit operands (the backward's
    only for bf16), and the WY VJP kernel adds the walk's dk and rounds dk, dv to the inputs'
    dtype itself. Against the xla path in float32 on the same rounded inputs."""
    p = make_full_problem(52, batch=1, tokens=40, heads=2, key_dim=16, value_dim=32, m=2,
                          chunk_size=16, gated=True, initial_state=True, segments=True,
                          dtype=dtype)
    do = jnp.asarray(np.random.default_rng(7).normal(size=p["ref"]["o"].shape), jnp.float32)
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def grads(implementation, dtype):
        def loss(q, k, v, g, beta, initial_state):
            o, final_state = gdp_jax.chunk_gated_delta_product(
                q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                segment_ids=p["segment_ids"], chunk_size=16, implementation=implementation)
            return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(final_state)
        primals = [p[n].astype(dtype) if n in "qkv" else p[n] for n in names]
        return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*primals)

    for name, got, want in zip(names, grads("interpret", dtype), grads("xla", jnp.float32)):
        assert got.dtype == p[name].dtype, name
        assert rel_err(got, want) < TOL[jnp.bfloat16], (name, rel_err(got, want))


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
@pytest.mark.parametrize("use_qk_l2norm", [True])
def test_gradients_against_recurrence(use_qk_l2norm, implementation):
    p, do, dfinal, expected = _gradient_problem(use_qk_l2norm)
    seg = p["raw"]["segment_ids"]

    def loss(q, k, v, g, beta, initial_state):
        o, final_state = gdp_jax.chunk_gated_delta_product(
            q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
            segment_ids=seg, use_qk_l2norm=use_qk_l2norm, chunk_size=16,
            implementation=implementation)
        return jnp.sum(o * do.astype(np.float32)) + jnp.sum(final_state * dfinal.astype(np.float32))

    grads = jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*[p[n] for n in GRAD_NAMES])
    for name, grad, ref in zip(GRAD_NAMES, grads, expected):
        assert grad.dtype == p[name].dtype and grad.shape == p[name].shape, name
        assert rel_err(grad, ref) < GRAD_TOL, (name, rel_err(grad, ref))


# ----------------------------------------------------------------------------------------------
# Transformations.

@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_jit_vmap_over_differently_packed_rows(implementation):
    # "interpret": vmap of the Pallas kernels (an extra grid axis) and of the stages' custom_vjp.
    p = _case_problem(FORWARD_CASES[0])
    names = ("q", "k", "v", "g", "beta", "initial_state", "segment_ids")

    def one_row(q, k, v, g, beta, initial_state, segment_ids):
        add = lambda x: x[None]
        o, s = gdp_jax.chunk_gated_delta_product(
            add(q), add(k), add(v), add(g), add(beta), initial_state=add(initial_state),
            segment_ids=add(segment_ids), output_final_state=True, chunk_size=16,
            implementation=implementation)
        return o[0], s[0]

    o, final_state = jax.jit(jax.vmap(one_row))(*[p[n] for n in names])
    assert rel_err(o, p["ref"]["o"]) < TOL[np.float32]
    assert rel_err(final_state, p["ref"]["final_state"]) < TOL[np.float32]


# ----------------------------------------------------------------------------------------------
# Bad input: the error names the argument, what it got and what was expected.

def _bad_call(**overrides):
    b, t, h, kd, vd, m = 2, 8, 2, 16, 8, 2
    args = dict(q=np.zeros((b, t, h, kd), np.float32), k=np.zeros((b, t * m, h, kd), np.float32),
                v=np.zeros((b, t * m, h, vd), np.float32), g=np.zeros((b, t, h), np.float32),
                beta=np.ones((b, t * m, h), np.float32))
    kwargs = dict(chunk_size=16)
    for name, value in overrides.items():
        (args if name in args else kwargs)[name] = value
    return gdp_jax.chunk_gated_delta_product(args.pop("q"), args.pop("k"), args.pop("v"),
                                             args.pop("g"), args.pop("beta"), **kwargs)


@pytest.mark.parametrize("overrides, error, pattern", [
    (dict(beta=np.ones((2, 8, 2), np.float32)), ValueError,
     r"beta must have shape .*\(2, 16, 2\).*got \(2, 8, 2\)"),
    (dict(g=np.zeros((2, 8), np.float32)), ValueError, r"g must have rank 3.*got shape \(2, 8\)"),
    (dict(g=np.zeros((2, 8, 3), np.float32)), ValueError,
     r"g must have shape .*\(2, 8, 2\).*got \(2, 8, 3\)"),
    (dict(initial_state=np.zeros((2, 2, 8, 16), np.float32)), ValueError,
     r"initial_state must have shape .*\(2, 2, 16, 8\).*got \(2, 2, 8, 16\)"),
    (dict(k=np.zeros((2, 12, 2, 16), np.float32)), ValueError, r"k.shape\[1\] must be a multiple"),
    (dict(num_householder=3), ValueError, r"k.shape\[1\] must be T\*M"),
    (dict(v=np.zeros((2, 16, 2, 8), jnp.bfloat16)), TypeError, r"q, k, v must share one dtype"),
    (dict(beta=np.ones((2, 16, 2), np.int32)), TypeError, r"beta must be a floating-point array"),
    (dict(segment_ids=np.zeros((2, 7), np.int32)), ValueError, r"segment_ids must have shape"),
    (dict(chunk_size=48), ValueError, r"chunk_size must be a power of two"),
    (dict(implementation="cuda"), ValueError, r"implementation must be one of"),
    (dict(output_final_state=1), TypeError, r"output_final_state must be a Python bool"),
])
def test_bad_input(overrides, error, pattern):
    with pytest.raises(error, match=pattern):
        _bad_call(**overrides)


def test_empty_rows_are_refused():
    with pytest.raises(ValueError, match=r"^q.shape\[1\] \(T, tokens per row\) must be at least 1"):
        gdp_jax.chunk_gated_delta_product(np.zeros((2, 0, 2, 16), np.float32),
                                          np.zeros((2, 0, 2, 16), np.float32),
                                          np.zeros((2, 0, 2, 8), np.float32), None,
                                          np.zeros((2, 0, 2), np.float32))


@pytest.mark.parametrize("overrides, error, pattern", [
    (dict(k_t=np.zeros((2, 2, 2, 8), np.float32)), ValueError, r"k_t must have shape .*\(2, 2, 2, 16\)"),
    (dict(beta_t=np.ones((2, 3, 2), np.float32)), ValueError,
     r"beta_t must have shape .*\(2, 2, 2\).*got \(2, 3, 2\)"),
    (dict(state=np.zeros((2, 2, 8, 16), np.float32)), ValueError, r"state must have shape"),
    (dict(g_t=np.zeros((2,), np.float32)), ValueError, r"g_t must have rank 2"),
    (dict(num_householder=3), ValueError, r"k_t.shape\[1\] must be M = num_householder = 3; got 2"),
])
def test_decode_bad_input(overrides, error, pattern):
    b, m, h, kd, vd = 2, 2, 2, 16, 8
    args = dict(q_t=np.zeros((b, h, kd), np.float32), k_t=np.zeros((b, m, h, kd), np.float32),
                v_t=np.zeros((b, m, h, vd), np.float32), g_t=np.zeros((b, h), np.float32),
                beta_t=np.ones((b, m, h), np.float32), state=np.zeros((b, h, kd, vd), np.float32))
    kwargs = {}
    for name, value in overrides.items():
        (args if name in args else kwargs)[name] = value
    with pytest.raises(error, match=pattern):
        gdp_jax.recurrent_gdp_step(*args.values(), **kwargs)
