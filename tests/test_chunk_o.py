"""chunk_gdp_fwd_o on CPU: the jnp path ("xla") and the Pallas kernel in the interpreter ("interpret").

Forward outputs are checked against the float64 recurrence (SPEC's identity: the recurrence's own
h, v_new and g fed to chunk_o reproduce its o). Gradients are checked against autodiff of an
independent dense statement of the chunked form written below, in float64.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import gdp_jax
from helpers import dense_chunked_form, make_problem, rel_err

IMPLEMENTATIONS = ["xla", "interpret"]
TOL = {np.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}   # SPEC: f32 on CPU, half inputs
GRAD_TOL = 1e-5                                   # f32 gradients against float64 autodiff


_PROBLEMS = {}


def cached_problem(seed, **kwargs):
    """make_problem, shared by the tests that use one case (the recurrence is slow to compile)."""
    key = (seed,) + tuple(sorted((name, value.tobytes() if isinstance(value, np.ndarray) else value)
                                 for name, value in kwargs.items()))
    if key not in _PROBLEMS:
        _PROBLEMS[key] = make_problem(seed, **kwargs)
    return _PROBLEMS[key]


def run_op(p, implementation, *, jit=True, **kwargs):
    """chunk_gdp_fwd_o on a make_problem dict; jitted because eager jnp dispatch is slow on CPU."""
    op = functools.partial(gdp_jax.chunk_gdp_fwd_o, chunk_size=p["chunk_size"],
                           implementation=implementation, **kwargs)
    if jit:
        op = jax.jit(op)
    return op(p["q"], p["k"], p["v"], p["h"], p["g"], segment_ids=p["segment_ids"])


# ----------------------------------------------------------------------------------------------
# Forward against the float64 recurrence.

# A covering subset of T x (K, V) x M x chunk_size x gated x segmented x dtype, not the product:
# every T, M and chunk size appears with and without g and with and without segments (across
# dtypes), K != V both ways, ragged T (77, 130) on every chunk size, and non-power-of-two widths
# (K=24, V=20) for the zero-padding path.
FORWARD_CASES = [
    # tokens, key_dim, value_dim, m, chunk_size, gated, segments, dtype
    (64, 32, 16, 1, 16, True, True, np.float32),
    (77, 16, 32, 2, 16, True, True, np.float32),
    (130, 32, 16, 3, 32, True, True, np.float32),
    (130, 24, 16, 2, 64, True, True, np.float32),
    (77, 32, 20, 3, 64, False, True, np.float32),
    (64, 16, 32, 2, 32, True, False, np.float32),
    (77, 32, 16, 1, 16, False, False, np.float32),
    (130, 16, 32, 1, 16, False, True, np.float32),
    (64, 32, 16, 3, 64, False, False, np.float32),
    (77, 32, 16, 2, 16, True, True, jnp.bfloat16),
    (130, 16, 32, 3, 32, True, False, jnp.bfloat16),
    (64, 24, 20, 1, 64, False, True, jnp.bfloat16),
    (77, 16, 32, 2, 32, False, False, jnp.bfloat16),
    (130, 32, 16, 2, 16, True, True, jnp.float16),
]


def _case_id(case):
    tokens, key_dim, value_dim, m, chunk_size, gated, segments, dtype = case
    return (f"T{tokens}-K{key_dim}-V{value_dim}-M{m}-BT{chunk_size}-{'g' if gated else 'nog'}-"
            f"{'seg' if segments else 'noseg'}-{jnp.dtype(dtype).name}")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", FORWARD_CASES, ids=_case_id)
def test_against_recurrence(case, implementation):
    tokens, key_dim, value_dim, m, chunk_size, gated, segments, dtype = case
    p = cached_problem(tokens + m, batch=2, tokens=tokens, heads=2, key_dim=key_dim,
                       value_dim=value_dim, m=m, chunk_size=chunk_size, gated=gated,
                       segments=segments, dtype=dtype)
    o = run_op(p, implementation)
    assert o.shape == (2, tokens, 2, value_dim)
    assert o.dtype == p["v"].dtype
    assert rel_err(o, p["o_ref"]) < TOL[dtype]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("tokens", [1, 17])
def test_short_sequences(tokens, implementation):
    # T = 1 (one partial chunk of one token) and T = chunk_size + 1 (a one-token last chunk).
    ids = np.array([[0] * tokens, [0] * (tokens - 1) + [1]], np.int32)
    p = cached_problem(tokens, batch=2, tokens=tokens, heads=2, key_dim=16, value_dim=32, m=2,
                       chunk_size=16, segment_ids=ids)
    assert rel_err(run_op(p, implementation), p["o_ref"]) < TOL[np.float32]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_every_output_element_is_written(implementation):
    # Ragged T = 77 with chunk 16: the last chunk has 13 rows. A per-token check (not just the
    # Frobenius norm) catches any tile or row the kernel leaves unwritten, zero or NaN.
    p = cached_problem(77 + 2, batch=2, tokens=77, heads=2, key_dim=16, value_dim=32, m=2,
                       chunk_size=16, dtype=np.float32)
    o = np.asarray(run_op(p, implementation), np.float64)
    assert np.isfinite(o).all()
    per_token_err = np.linalg.norm(o - p["o_ref"], axis=-1)
    per_token_ref = np.linalg.norm(p["o_ref"], axis=-1)
    assert (per_token_err <= 1e-4 * per_token_ref + 1e-6).all()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_scale_default_and_explicit(implementation):
    p = cached_problem(5, batch=2, tokens=77, heads=2, key_dim=32, value_dim=16, m=2, chunk_size=16)
    # The recurrence used the default scale K ** -0.5, and o is linear in scale.
    o_default = run_op(p, implementation)
    o_explicit = run_op(p, implementation, scale=0.3)
    assert rel_err(o_default, p["o_ref"]) < TOL[np.float32]
    assert rel_err(o_explicit, p["o_ref"] * 0.3 * 32 ** 0.5) < TOL[np.float32]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_num_householder_explicit_equals_inferred(implementation):
    p = cached_problem(130 + 3, batch=2, tokens=130, heads=2, key_dim=32, value_dim=16, m=3,
                       chunk_size=32)
    o_inferred = run_op(p, implementation)
    o_explicit = run_op(p, implementation, num_householder=3)
    np.testing.assert_array_equal(np.asarray(o_explicit), np.asarray(o_inferred))
    assert rel_err(o_explicit, p["o_ref"]) < TOL[np.float32]


def test_default_implementation_on_cpu_is_xla_and_eager_call_works():
    p = cached_problem(77 + 2, batch=2, tokens=77, heads=2, key_dim=16, value_dim=32, m=2,
                       chunk_size=16)
    o = run_op(p, None, jit=False)
    assert rel_err(o, p["o_ref"]) < TOL[np.float32]


# ----------------------------------------------------------------------------------------------
# Segments: the carried state only reaches the segment live at the chunk's first token.

CHUNK = 16
# Row 0: segments [0, 10) [10, 16) [16] [17, 30) [30, 41) [41, 48) with ids 0 1 0 1 0 2: one
# starts exactly on the chunk boundary 16 and has length 1, one starts at chunk_size + 1, one
# crosses the boundary at 32, and ids repeat non-adjacently (different segments all the same).
HAND_IDS_ROW0 = [0] * 10 + [1] * 6 + [0] + [1] * 13 + [0] * 11 + [2] * 7
# Row 1: a different packing; a segment starts at 15 (one before the boundary) and at 33.
HAND_IDS_ROW1 = [5] * 15 + [6] * 18 + [5] * 15
# Tokens whose segment is live at their chunk's first token (0, 16, 32), written out by hand.
HAND_LIVE_ROW0 = list(range(0, 10)) + [16] + list(range(32, 41))
HAND_LIVE_ROW1 = list(range(0, 15)) + list(range(16, 32)) + [32]


def _hand_built_ids():
    ids = np.array([HAND_IDS_ROW0, HAND_IDS_ROW1], np.int32)
    assert ids.shape == (2, 3 * CHUNK)
    return ids


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_state_term_only_reaches_segment_live_at_chunk_start(implementation):
    # With v = 0 only the carried-state term is left: o[t] = scale [same(t, c0)] 2^g[t] q[t]·h[c].
    rng = np.random.default_rng(0)
    batch, tokens, heads, key_dim, value_dim, m = 2, 3 * CHUNK, 2, 16, 16, 2
    q = rng.normal(size=(batch, tokens, heads, key_dim)).astype(np.float32)
    k = rng.normal(size=(batch, tokens * m, heads, key_dim)).astype(np.float32)
    v = np.zeros((batch, tokens * m, heads, value_dim), np.float32)
    h = rng.normal(size=(batch, 3, heads, key_dim, value_dim)).astype(np.float32)
    g = -rng.uniform(0, 3, size=(batch, tokens, heads)).astype(np.float32)
    o = jax.jit(functools.partial(gdp_jax.chunk_gdp_fwd_o, chunk_size=CHUNK, implementation=implementation))(
        q, k, v, h, g, segment_ids=_hand_built_ids())
    o = np.asarray(o, np.float64)

    live = np.zeros((batch, tokens), bool)
    live[0, HAND_LIVE_ROW0] = True
    live[1, HAND_LIVE_ROW1] = True
    chunk_of = np.arange(tokens) // CHUNK
    state_term = np.einsum("bthk,bthkv->bthv", q.astype(np.float64),
                           h.astype(np.float64)[:, chunk_of])
    expected = key_dim ** -0.5 * np.exp2(g.astype(np.float64))[..., None] * state_term
    expected = np.where(live[:, :, None, None], expected, 0.0)
    assert (o[~live] == 0).all(), "state reached a token outside the segment live at c0"
    assert rel_err(o, expected) < 1e-6


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_hand_built_segments_against_recurrence(implementation):
    p = cached_problem(11, batch=2, tokens=3 * CHUNK, heads=2, key_dim=16, value_dim=16, m=2,
                       chunk_size=CHUNK, segment_ids=_hand_built_ids())
    assert rel_err(run_op(p, implementation), p["o_ref"]) < TOL[np.float32]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_repeated_id_does_not_join_segments(implementation):
    # ids [0, 0, 1, 1, 0, 0]: nothing in the first 0-run may reach the second 0-run.
    ids = np.array([[0] * 4 + [1] * 4 + [0] * 8], np.int32)
    p = cached_problem(12, batch=1, tokens=16, heads=1, key_dim=16, value_dim=16, m=1,
                       chunk_size=CHUNK, segment_ids=ids)
    perturbed = dict(p, v=p["v"].at[:, :4].add(10.0), k=p["k"].at[:, :4].add(1.0))
    o, o_perturbed = run_op(p, implementation), run_op(perturbed, implementation)
    np.testing.assert_array_equal(np.asarray(o[:, 8:]), np.asarray(o_perturbed[:, 8:]))
    assert not np.allclose(o[:, :4], o_perturbed[:, :4])      # the perturbation did land
    assert rel_err(o, p["o_ref"]) < TOL[np.float32]


@pytest.mark.parametrize("tokens,chunk_size", [(1, 16), (70, 16), (200, 64)])
def test_segment_start_rows_against_brute_force(tokens, chunk_size):
    # The forward kernel's segment input: for each t, the first row of t's chunk holding t's
    # segment. Brute force over random packings, ragged T, repeated ids and one-token segments.
    from gdp_jax.segments import segment_runs, segment_start_rows

    rng = np.random.default_rng(tokens)
    ids = rng.integers(0, 3, size=(3, tokens)).astype(np.int32)    # many starts, ids repeat
    ids[1] = 7                                                     # one segment for the row
    runs = np.asarray(segment_runs(jnp.asarray(ids)))
    got = np.asarray(segment_start_rows(jnp.asarray(runs), chunk_size))
    assert got.shape == ids.shape and got.dtype == np.int32
    for b in range(ids.shape[0]):
        for t in range(tokens):
            c0 = t - t % chunk_size
            s = t
            while s > c0 and runs[b, s - 1] == runs[b, t]:
                s -= 1
            assert got[b, t] == s - c0, (b, t)
    assert (got[1] == 0).all()


# ----------------------------------------------------------------------------------------------
# Gradients against autodiff of an independent dense statement of the chunked form.

def _to64(x):
    return None if x is None else jnp.asarray(np.asarray(jnp.asarray(x, jnp.float32), np.float64))


def test_dense_chunked_form_matches_recurrence():
    # The gradient reference is only as good as its forward: it must reproduce the recurrence.
    p = cached_problem(77 + 2, batch=2, tokens=77, heads=2, key_dim=16, value_dim=32, m=2,
                       chunk_size=16)
    with jax.enable_x64(True):
        args = [_to64(p[name]) for name in ("q", "k", "v", "h", "g")]
        o = dense_chunked_form(*args, p["segment_ids"], scale=16 ** -0.5, chunk_size=16)
        # Inputs were rounded to f32 by make_problem, so agreement is at the f32 level.
        assert rel_err(np.asarray(o), p["o_ref"]) < 1e-6


def _reference_grads(p, cotangent, names, scale):
    with jax.enable_x64(True):
        primals = {name: _to64(p[name]) for name in ("q", "k", "v", "h", "g")}

        def dense(*diff_args):
            kwargs = dict(primals, **dict(zip(names, diff_args)))
            return dense_chunked_form(kwargs["q"], kwargs["k"], kwargs["v"], kwargs["h"], kwargs["g"],
                                      p["segment_ids"], scale=scale, chunk_size=p["chunk_size"])

        _, vjp = jax.vjp(jax.jit(dense), *[primals[name] for name in names])
        return [np.asarray(x) for x in vjp(_to64(cotangent))]


GRAD_PROBLEM = dict(batch=2, tokens=77, heads=2, key_dim=16, value_dim=32, m=2, chunk_size=16)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gradients_with_g_and_segments(implementation):
    p = cached_problem(77 + 2, **GRAD_PROBLEM)
    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=p["o_ref"].shape), jnp.float32)

    def loss(q, k, v, h, g, segment_ids):
        o = gdp_jax.chunk_gdp_fwd_o(q, k, v, h, g, segment_ids=segment_ids, chunk_size=16,
                                    implementation=implementation)
        return jnp.sum(o * cotangent)

    # Integer segment_ids ride along as an ordinary (non-differentiated) argument of grad and jit.
    names = ("q", "k", "v", "h", "g")
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(
        *[p[name] for name in names], p["segment_ids"])
    expected = _reference_grads(p, cotangent, names, scale=16 ** -0.5)
    for name, grad, ref in zip(names, grads, expected):
        assert grad.dtype == p[name].dtype, name
        assert grad.shape == p[name].shape, name
        assert rel_err(grad, ref) < GRAD_TOL, name


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gradients_without_g(implementation):
    p = cached_problem(77 + 2, **GRAD_PROBLEM)
    p = dict(p, g=None)
    cotangent = jnp.asarray(np.random.default_rng(2).normal(size=p["o_ref"].shape), jnp.float32)

    def op(q, k, v, h, g):
        return gdp_jax.chunk_gdp_fwd_o(q, k, v, h, g, segment_ids=p["segment_ids"], chunk_size=16,
                                       implementation=implementation)

    _, vjp = jax.vjp(op, p["q"], p["k"], p["v"], p["h"], None)
    *grads, g_cotangent = vjp(cotangent)
    assert g_cotangent is None
    names = ("q", "k", "v", "h")
    expected = _reference_grads(p, cotangent, names, scale=16 ** -0.5)
    for name, grad, ref in zip(names, grads, expected):
        assert grad.dtype == p[name].dtype, name
        assert rel_err(grad, ref) < GRAD_TOL, name


def test_gradient_dtypes_follow_primals_bf16():
    # bf16 q, k, v with float32 h and g: each cotangent takes its own primal's dtype.
    p = cached_problem(77 + 2, dtype=jnp.bfloat16, **GRAD_PROBLEM)
    p = dict(p, h=jnp.asarray(p["h"], jnp.float32))
    cotangent = jnp.asarray(np.random.default_rng(3).normal(size=p["o_ref"].shape), jnp.bfloat16)

    def op(q, k, v, h, g):
        return gdp_jax.chunk_gdp_fwd_o(q, k, v, h, g, segment_ids=p["segment_ids"], chunk_size=16,
                                       implementation="xla")

    names = ("q", "k", "v", "h", "g")
    o, vjp = jax.vjp(jax.jit(op), *[p[name] for name in names])
    assert o.dtype == jnp.bfloat16
    grads = vjp(cotangent)
    assert [x.dtype for x in grads] == [jnp.bfloat16] * 3 + [jnp.float32] * 2
    expected = _reference_grads(p, cotangent, names, scale=16 ** -0.5)
    for name, grad, ref in zip(names, grads, expected):
        assert rel_err(grad, ref) < TOL[jnp.bfloat16], name


# ----------------------------------------------------------------------------------------------
# Transformations: vmap with a different packing per row, grad of vmap, checkpoint.

def _single_row_op(implementation):
    """chunk_gdp_fwd_o on one row's arrays with a leading batch axis of 1 (vmapped over rows)."""
    def op(q, k, v, h, g, segment_ids):
        return gdp_jax.chunk_gdp_fwd_o(q, k, v, h, g, segment_ids=segment_ids, chunk_size=16,
                                       implementation=implementation)
    return op


def _rows_as_leading_axis(p):
    """[B, ...] -> [B, 1, ...]: vmap over B, each call sees batch size 1 with its own packing."""
    return [p[name][:, None] for name in ("q", "k", "v", "h", "g", "segment_ids")]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_jit_vmap_over_differently_packed_rows(implementation):
    p = cached_problem(77 + 2, **GRAD_PROBLEM)
    assert not np.array_equal(p["segment_ids"][0], p["segment_ids"][1])
    o_vmapped = jax.jit(jax.vmap(_single_row_op(implementation)))(*_rows_as_leading_axis(p))
    assert o_vmapped.shape == (2, 1) + p["o_ref"].shape[1:]
    o_batched = run_op(p, implementation)
    np.testing.assert_allclose(np.asarray(o_vmapped[:, 0]), np.asarray(o_batched), rtol=1e-5, atol=1e-5)
    assert rel_err(o_vmapped[:, 0], p["o_ref"]) < TOL[np.float32]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_jit_grad_vmap(implementation):
    p = cached_problem(77 + 2, **GRAD_PROBLEM)
    cotangent = jnp.asarray(np.random.default_rng(4).normal(size=p["o_ref"].shape), jnp.float32)
    rows_cotangent = cotangent[:, None]

    def loss(q, k, v, h, g, segment_ids):
        o = jax.vmap(_single_row_op(implementation))(q, k, v, h, g, segment_ids)
        return jnp.sum(o * rows_cotangent)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*_rows_as_leading_axis(p))
    names = ("q", "k", "v", "h", "g")
    expected = _reference_grads(p, cotangent, names, scale=16 ** -0.5)
    for name, grad, ref in zip(names, grads, expected):
        assert rel_err(grad[:, 0], ref) < GRAD_TOL, name


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_checkpoint_under_grad(implementation):
    p = cached_problem(77 + 2, **GRAD_PROBLEM)
    cotangent = jnp.asarray(np.random.default_rng(5).normal(size=p["o_ref"].shape), jnp.float32)
    op = jax.checkpoint(functools.partial(gdp_jax.chunk_gdp_fwd_o, chunk_size=16,
                                          implementation=implementation))

    def loss(q, k, v, h, g, segment_ids):
        return jnp.sum(op(q, k, v, h, g, segment_ids=segment_ids) * cotangent)

    names = ("q", "k", "v", "h", "g")
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(
        *[p[name] for name in names], p["segment_ids"])
    expected = _reference_grads(p, cotangent, names, scale=16 ** -0.5)
    for name, grad, ref in zip(names, grads, expected):
        assert rel_err(grad, ref) < GRAD_TOL, name


# ----------------------------------------------------------------------------------------------
# Argument checking: every bad input is refused with a message naming the argument.

B, T, H, K, V, M, BT = 2, 40, 2, 16, 8, 2, 16
NT = -(-T // BT)


def _good_args():
    zeros = lambda *shape, dtype=jnp.float32: jnp.zeros(shape, dtype)
    return dict(q=zeros(B, T, H, K), k=zeros(B, T * M, H, K), v=zeros(B, T * M, H, V),
                h=zeros(B, NT, H, K, V), g=zeros(B, T, H), segment_ids=zeros(B, T, dtype=jnp.int32),
                chunk_size=BT)


def _call(**overrides):
    args = dict(_good_args(), **overrides)
    q, k, v, h, g = (args.pop(name) for name in ("q", "k", "v", "h", "g"))
    return gdp_jax.chunk_gdp_fwd_o(q, k, v, h, g, implementation=args.pop("implementation", "xla"), **args)


def test_good_arguments_are_accepted():
    # The bad-input cases below change one thing each from these arguments.
    assert _call().shape == (B, T, H, V)


BAD_INPUTS = [
    # overrides, error type, pattern naming the argument
    (dict(q=jnp.zeros((B, T, H * K))), ValueError, r"^q\b"),
    (dict(k=jnp.zeros((B, T * M, H, K, 1))), ValueError, r"^k\b"),
    (dict(v=jnp.zeros((B, T * M, H * V))), ValueError, r"^v\b"),
    (dict(h=jnp.zeros((B, NT, H, K * V))), ValueError, r"^h\b"),
    (dict(g=jnp.zeros((B, T, H, 1))), ValueError, r"^g\b"),
    (dict(k=jnp.zeros((B, T * M + 1, H, K))), ValueError, r"^k\.shape\[1\]"),
    (dict(k=jnp.zeros((B, 0, H, K)), v=jnp.zeros((B, 0, H, V))), ValueError,
     r"^k\.shape\[1\] must be a multiple T\*M .* got k\.shape\[1\] = 0"),
    (dict(k=jnp.zeros((B, T * M, H, K + 1))), ValueError, r"^k\b"),
    (dict(v=jnp.zeros((B, T * M + 1, H, V))), ValueError, r"^v\b"),
    (dict(num_householder=3), ValueError, r"num_householder"),
    (dict(num_householder=0), ValueError, r"num_householder"),
    (dict(h=jnp.zeros((B, NT + 1, H, K, V))), ValueError, r"^h\b"),
    (dict(h=jnp.zeros((B, NT, H, K + 1, V))), ValueError, r"^h\b"),
    (dict(h=jnp.zeros((B, NT, H, K, V + 1))), ValueError, r"^h\b"),
    (dict(g=jnp.zeros((B, T + 1, H))), ValueError, r"^g\b"),
    (dict(g=jnp.zeros((B, T, H + 1))), ValueError, r"^g\b"),
    (dict(segment_ids=jnp.zeros((B, T + 1), jnp.int32)), ValueError, r"^segment_ids\b"),
    (dict(segment_ids=jnp.zeros((T,), jnp.int32)), ValueError, r"^segment_ids\b"),
    (dict(segment_ids=jnp.zeros((B, T), jnp.float32)), TypeError, r"^segment_ids\b"),
    (dict(chunk_size=48), ValueError, r"^chunk_size\b"),
    (dict(chunk_size=8), ValueError, r"^chunk_size\b"),
    (dict(chunk_size=256), ValueError, r"^chunk_size\b"),
    (dict(chunk_size=64.0), ValueError, r"^chunk_size\b"),
    (dict(implementation="cuda"), ValueError, r"^implementation\b"),
    (dict(k=jnp.zeros((B, T * M, H, K), jnp.bfloat16)), TypeError, r"q, k, v must share one dtype"),
    (dict(v=jnp.zeros((B, T * M, H, V), jnp.float16)), TypeError, r"q, k, v must share one dtype"),
    (dict(q=jnp.zeros((B, T, H, K), jnp.int32)), TypeError, r"^q\b"),
    (dict(h=jnp.zeros((B, NT, H, K, V), jnp.int32)), TypeError, r"^h\b"),
    (dict(v=jnp.zeros((B, T * M, H, V), jnp.int32)), TypeError, r"^v\b"),
    (dict(g=jnp.zeros((B, T, H), jnp.int32)), TypeError, r"^g\b"),
    (dict(scale=float("nan")), ValueError, r"^scale\b"),
    (dict(scale="0.5"), TypeError, r"^scale\b"),
]


def _bad_input_id(overrides):
    return "-".join(f"{name}={getattr(value, 'shape', value)}{getattr(value, 'dtype', '')}"
                    for name, value in overrides.items())


@pytest.mark.parametrize("overrides,error,pattern", BAD_INPUTS,
                         ids=[_bad_input_id(overrides) for overrides, _, _ in BAD_INPUTS])
def test_bad_input_is_refused(overrides, error, pattern):
    with pytest.raises(error, match=pattern):
        _call(**overrides)


# ----------------------------------------------------------------------------------------------
# Property test: random shapes and packings, xla path against the float64 recurrence.

@st.composite
def random_problems(draw):
    batch, tokens, heads = draw(st.integers(1, 2)), draw(st.integers(1, 100)), draw(st.integers(1, 2))
    layout = draw(st.sampled_from(["none", "one segment", "every token its own", "random"]))
    if layout == "none":
        ids = None
    elif layout == "one segment":
        ids = np.full((batch, tokens), 7, np.int32)
    elif layout == "every token its own":
        ids = np.tile(np.arange(tokens, dtype=np.int32), (batch, 1))
    else:   # few distinct ids, so runs have random lengths and ids repeat non-adjacently
        ids = np.array([draw(st.lists(st.integers(0, 2), min_size=tokens, max_size=tokens))
                        for _ in range(batch)], np.int32)
    return dict(seed=draw(st.integers(0, 2 ** 32 - 1)), batch=batch, tokens=tokens, heads=heads,
                key_dim=draw(st.sampled_from([8, 16, 32])), value_dim=draw(st.sampled_from([8, 16, 32])),
                m=draw(st.integers(1, 3)), chunk_size=draw(st.sampled_from([16, 32])),
                gated=draw(st.booleans()), segments=ids is not None, segment_ids=ids)


@settings(max_examples=25, deadline=None)
@given(random_problems())
@example(dict(seed=0, batch=1, tokens=1, heads=1, key_dim=8, value_dim=32, m=3, chunk_size=16,
              gated=True, segments=True, segment_ids=np.zeros((1, 1), np.int32)))   # T = 1
def test_random_shapes_against_recurrence(problem):
    p = make_problem(**problem)
    o = run_op(p, "xla")
    assert o.shape == p["o_ref"].shape and o.dtype == jnp.float32
    assert rel_err(o, p["o_ref"]) < TOL[np.float32]


# The forward kernel's launch variant that the cases above do not reach through kernel_config's
# defaults: several value tiles looped in one program (V = 256).
@pytest.mark.parametrize("value_dim,m,segments", [(256, 3, False), (256, 1, True)])
def test_kernel_configs_in_interpreter(value_dim, m, segments):
    from gdp_jax.chunk_o_pallas import chunk_o_pallas, kernel_config
    from gdp_jax.segments import segment_runs

    key_dim, chunk_size = 32, 16
    p = cached_problem(5 + m, batch=2, tokens=77, heads=2, key_dim=key_dim, value_dim=value_dim,
                       m=m, chunk_size=chunk_size, gated=True, segments=segments)
    runs = None if p["segment_ids"] is None else segment_runs(p["segment_ids"])
    config = kernel_config(key_dim, value_dim, chunk_size, m)
    assert config.value_blocks_per_program == value_dim // 128
    o = jax.jit(functools.partial(
        chunk_o_pallas, scale=key_dim ** -0.5, chunk_size=chunk_size, num_householder=m,
        interpret=True, config=config))(p["q"], p["k"], p["v"], p["h"], p["g"], runs)
    assert rel_err(o, p["o_ref"]) < TOL[np.float32]


@pytest.mark.parametrize("m,segments,gated", [(3, True, True), (1, False, True), (2, True, False)])
def test_fused_copy_order_in_interpreter(m, segments, gated):
    """copy_order="fused" (each copy's score used right away; the default for M >= 3) against the
    recurrence, forced for every M."""
    from gdp_jax.chunk_o_pallas import chunk_o_pallas, kernel_config
    from gdp_jax.segments import segment_runs

    key_dim, value_dim, chunk_size = 32, 48, 16
    p = cached_problem(11 + m, batch=2, tokens=77, heads=2, key_dim=key_dim, value_dim=value_dim,
                       m=m, chunk_size=chunk_size, gated=gated, segments=segments)
    runs = None if p["segment_ids"] is None else segment_runs(p["segment_ids"])
    # V = 48 pads to 64 outside the kernel; pad here the same way.
    v = jnp.pad(p["v"], [(0, 0)] * 3 + [(0, 16)])
    h = jnp.pad(p["h"], [(0, 0)] * 4 + [(0, 16)])
    config = kernel_config(key_dim, 64, chunk_size, m, copy_order="fused")
    o = jax.jit(functools.partial(
        chunk_o_pallas, scale=key_dim ** -0.5, chunk_size=chunk_size, num_householder=m,
        interpret=True, config=config))(p["q"], p["k"], v, h, p["g"], runs)[..., :value_dim]
    assert rel_err(o, p["o_ref"]) < TOL[np.float32]
    with pytest.raises(ValueError, match="copy_order"):
        kernel_config(key_dim, 64, chunk_size, m, copy_order="fast")


# The loop over K (KernelConfig.block_k), forced at small widths so the interpreter stays quick:
# all M, with and without g and segments, several value tiles per program (each with its own
# state loop), a chunk loop around it, and the state term moved to a second loop over value
# columns (value_step: one step, or several across one or two value tiles), on ragged T.
@pytest.mark.parametrize("m,gated,segments,value_blocks,chunks_per_program,value_step", [
    (1, True, False, 1, 1, None), (2, True, True, 1, 2, None), (3, False, True, 2, 1, None),
    (2, False, False, 4, 1, None), (3, True, True, 1, 3, None), (1, True, True, 1, 2, 16),
    (2, True, False, 1, 1, 64), (2, False, True, 2, 1, 16), (3, True, True, 1, 1, 32)])
def test_key_loop_in_interpreter(m, gated, segments, value_blocks, chunks_per_program, value_step):
    from gdp_jax.chunk_o_pallas import chunk_o_pallas, kernel_config
    from gdp_jax.segments import segment_runs

    key_dim, value_dim, chunk_size = 64, 64, 16
    p = cached_problem(17 + m + 3 * gated, batch=2, tokens=77, heads=2, key_dim=key_dim,
                       value_dim=value_dim, m=m, chunk_size=chunk_size, gated=gated,
                       segments=segments)
    runs = None if p["segment_ids"] is None else segment_runs(p["segment_ids"])
    config = kernel_config(key_dim, value_dim, chunk_size, m, block_k=16,
                           block_v=value_dim // value_blocks, value_blocks_per_program=value_blocks,
                           chunks_per_program=chunks_per_program, value_step=value_step)
    o = jax.jit(functools.partial(
        chunk_o_pallas, scale=key_dim ** -0.5, chunk_size=chunk_size, num_householder=m,
        interpret=True, config=config))(p["q"], p["k"], p["v"], p["h"], p["g"], runs)
    assert rel_err(o, p["o_ref"]) < TOL[np.float32]


# The v tiles loaded before the K loop (KernelConfig.prefetch_values, the K = 256, M = 2 default),
# forced at small widths so the interpreter stays quick, with g and segments on ragged T.
@pytest.mark.parametrize("m", [1, 2, 3])
def test_prefetched_values_in_interpreter(m):
    from gdp_jax.chunk_o_pallas import chunk_o_pallas, kernel_config
    from gdp_jax.segments import segment_runs

    key_dim, value_dim, chunk_size = 64, 32, 16
    p = cached_problem(29 + m, batch=2, tokens=53, heads=2, key_dim=key_dim, value_dim=value_dim,
                       m=m, chunk_size=chunk_size, gated=True, segments=True)
    config = kernel_config(key_dim, value_dim, chunk_size, m, block_k=16, prefetch_values=True)
    assert config.prefetch_values and config.value_blocks_per_program == 1
    o = jax.jit(functools.partial(
        chunk_o_pallas, scale=key_dim ** -0.5, chunk_size=chunk_size, num_householder=m,
        interpret=True, config=config))(p["q"], p["k"], p["v"], p["h"], p["g"],
                                        segment_runs(p["segment_ids"]))
    assert rel_err(o, p["o_ref"]) < TOL[np.float32]
    with pytest.raises(ValueError, match="prefetch_values needs the K loop"):
        kernel_config(key_dim, value_dim, chunk_size, m, prefetch_values=True)
    with pytest.raises(ValueError, match="prefetch_values needs one value tile"):
        kernel_config(key_dim, value_dim, chunk_size, m, block_k=16, block_v=16,
                      value_blocks_per_program=2, prefetch_values=True)


@pytest.mark.parametrize("m,key_dim,value_dim,expected", [
    (2, 128, 256, (32, 5, 128, 1, None, False)),    # V = 256 split over two value programs
    (3, 128, 128, (64, 2, 128, 1, 64, False)),      # M = 3: the second loop over value columns
    (2, 256, 256, (32, 4, 128, 1, None, True)),    # K = 256: v loaded before the K loop
])
def test_default_key_loop_in_interpreter(m, key_dim, value_dim, expected):
    """The H200 defaults for 2-byte inputs at K >= 128, chunk 64 (the K loop), run through the
    public op in the interpreter on a small problem."""
    from gdp_jax.chunk_o_pallas import kernel_config

    config = kernel_config(key_dim, value_dim, 64, m, itemsize=2)
    assert (config.block_k, config.num_stages, config.block_v, config.value_blocks_per_program,
            config.value_step, config.prefetch_values) == expected
    p = cached_problem(23, batch=1, tokens=150, heads=2, key_dim=key_dim, value_dim=value_dim,
                       m=m, chunk_size=64, gated=True, segments=True, dtype=jnp.bfloat16)
    o = run_op(p, "interpret")
    assert o.dtype == jnp.bfloat16 and rel_err(o, p["o_ref"]) < TOL[jnp.bfloat16]


def test_key_loop_config_rules():
    from gdp_jax.chunk_o_pallas import kernel_config

    # Where it was measured (2-byte tiles, chunk 64, K >= 128, M <= 3) the K loop is the default.
    assert kernel_config(128, 128, 64, 1).block_k == 64
    assert kernel_config(128, 128, 64, 3).copy_order == "scores_first"
    # Elsewhere the previous configs stay, and block_k=0 turns it off explicitly.
    assert kernel_config(128, 128, 64, 2, itemsize=4).block_k is None
    assert kernel_config(128, 128, 128, 2).block_k is None
    assert kernel_config(64, 64, 64, 2).block_k is None
    assert kernel_config(128, 128, 64, 4).block_k is None
    assert kernel_config(128, 128, 64, 2, block_k=0).block_k is None
    # The v tiles load before the K loop by default only at K = 256 with M = 2.
    assert kernel_config(256, 128, 64, 2).prefetch_values
    assert not kernel_config(256, 256, 64, 1).prefetch_values
    assert not kernel_config(256, 256, 64, 3).prefetch_values
    assert not kernel_config(128, 128, 64, 2).prefetch_values
    assert not kernel_config(256, 256, 64, 2, block_k=0).prefetch_values
    assert not kernel_config(256, 256, 64, 2, prefetch_values=False).prefetch_values
    with pytest.raises(ValueError, match="block_k"):
        kernel_config(128, 128, 64, 2, block_k=48)
    with pytest.raises(ValueError, match="block_k"):
        kernel_config(128, 128, 64, 2, block_k=32, copy_order="fused")
    with pytest.raises(ValueError, match="value_step"):
        kernel_config(128, 128, 64, 2, block_k=0, value_step=64)
    with pytest.raises(ValueError, match="value_step"):
        kernel_config(128, 128, 64, 2, value_step=256)
    with pytest.raises(ValueError, match="value_step"):
        kernel_config(128, 128, 64, 2, value_step=48)


@pytest.mark.parametrize("dtype,key_dim,value_dim,chunk_size,fits", [
    (np.float32, 256, 16, 128, False),      # 4-byte q, k tiles of 128 x 256: 256 KiB of shared memory
    (np.float32, 200, 16, 128, False),      # K pads to 256
    (np.float32, 128, 256, 128, True),
    (np.float32, 256, 256, 64, True),
    (jnp.bfloat16, 256, 256, 128, True),
    (jnp.bfloat16, 300, 16, 64, False),     # K pads to 512: wider than the kernels are built for
    (jnp.bfloat16, 16, 257, 64, False),
])
def test_pallas_runs_the_jnp_path_where_the_kernels_do_not_fit(dtype, key_dim, value_dim,
                                                               chunk_size, fits):
    """implementation="pallas" takes the jnp path, forward and backward, for shapes whose compiled
    kernels would exceed shared memory. This host has no GPU, so a "pallas" call that reaches a
    kernel fails here: the unfit shapes must run and equal "xla" (and the recurrence), the fitting
    ones must not run the jnp path."""
    from gdp_jax.chunk_o import _compiled_kernels_fit
    assert _compiled_kernels_fit(dtype, key_dim, value_dim, chunk_size) == fits
    if fits:
        return
    p = make_problem(key_dim + value_dim, batch=1, tokens=chunk_size + 9, heads=1, key_dim=key_dim,
                     value_dim=value_dim, m=2, chunk_size=chunk_size, dtype=dtype)
    names = ("q", "k", "v", "h", "g")

    def loss(implementation):
        def f(q, k, v, h, g):
            o = gdp_jax.chunk_gdp_fwd_o(q, k, v, h, g, segment_ids=p["segment_ids"],
                                        chunk_size=chunk_size, implementation=implementation)
            return jnp.sum(o.astype(jnp.float32) ** 2), o
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True))(
            *[p[n] for n in names])

    (_, o), grads = loss("pallas")
    (_, o_xla), grads_xla = loss("xla")
    assert rel_err(o, p["o_ref"]) < TOL[dtype]
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o_xla, np.float32))
    for name, got, want in zip(names, grads, grads_xla):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                      err_msg=name)
