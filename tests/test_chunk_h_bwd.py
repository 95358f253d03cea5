"""The backward of stage 3 (chunk_h_bwd_pallas: reverse-walk and epilogue kernels) on CPU.

The kernels run in Pallas' interpreter, from the forward kernel's residuals h and v_new and from
chunk_h_xla's (split into key and value blocks; with h's cotangent only at every second chunk, as
chunk.py's custom_vjp passes it through ``subchunks``), against jax.vjp of the jnp scan chunk_h_xla, on fresh random inputs and cotangents for
every cotangent output. w and u come from the WY stage, so the walk is well conditioned. The full
op's gradients under "interpret" are checked against float64 autodiff of the recurrence in
test_chunk.py::test_gradients_against_recurrence.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax.chunk_h import chunk_h_xla
from gdp_jax.chunk_h_bwd_pallas import chunk_h_bwd_pallas
from gdp_jax.chunk_h_pallas import chunk_h_pallas
from gdp_jax.cumsum import chunk_local_log2_cumsum
from gdp_jax.segments import segment_runs
from gdp_jax.wy import wy_xla
from helpers import random_segment_ids, rel_err

TOL = 1e-5          # float32 on CPU (observed ~2e-7)
NAMES = ("dk", "dw", "du", "dg", "dinitial_state")

# T = 40, chunk 16: segments start at 16 (a chunk boundary), 21, 22 (length 1) and 32, the first
# token of the partial last chunk; row 1 has a single segment ending in a length-1 one at 39.
BOUNDARY_IDS = np.array([[0] * 16 + [1] * 5 + [2] + [3] * 10 + [4] * 8,
                         [7] * 39 + [8]], np.int32)


def make_inputs(seed, *, tokens, key_dim, value_dim, m, chunk_size, gated, segments, init,
                batch=2, heads=2, k_dtype=np.float32, segment_ids=None):
    """Primals (k, w, u, g, runs, initial_state), cotangents (dh, dv_new, dfinal), static kwargs."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
    k = normal(batch, tokens * m, heads, key_dim)
    k = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), k_dtype)
    v = jnp.asarray(normal(batch, tokens * m, heads, value_dim))
    beta = jnp.asarray(rng.uniform(0.05, 1.95, size=(batch, tokens * m, heads)), jnp.float32)
    g = None
    if gated:
        g_raw = -rng.uniform(0.0, 0.25, size=(batch, tokens, heads)).astype(np.float32)
        g = chunk_local_log2_cumsum(jnp.asarray(g_raw), chunk_size)
    if segment_ids is None and segments:
        segment_ids = random_segment_ids(rng, batch, tokens, chunk_size)
    runs = None if segment_ids is None else segment_runs(jnp.asarray(segment_ids))
    state0 = jnp.asarray(0.5 * normal(batch, heads, key_dim, value_dim)) if init else None
    kw = dict(chunk_size=chunk_size, num_householder=m)
    w, u = jax.jit(functools.partial(wy_xla, **kw))(k, v, beta, g, runs)
    num_chunks = -(-tokens // chunk_size)
    cotangents = (jnp.asarray(normal(batch, num_chunks, heads, key_dim, value_dim)),
                  jnp.asarray(normal(batch, tokens * m, heads, value_dim)),
                  jnp.asarray(normal(batch, heads, key_dim, value_dim)))
    return (k, w, u, g, runs, state0), cotangents, kw


def _diff_args(k, w, u, g, state0):
    return [x for x in (k, w, u, g, state0) if x is not None]


def _with_nones(grads, g, state0):
    grads = list(grads)
    dk, dw, du = grads[:3]
    dg = grads.pop(3) if g is not None else None
    dinit = grads[3] if state0 is not None else None
    return dk, dw, du, dg, dinit


def _vjp(fn, primals, cotangents):
    """jax.vjp of fn(k, w, u, g, runs, initial_state) in every differentiable primal given."""
    k, w, u, g, runs, state0 = primals

    def call(*args):
        args = list(args)
        k, w, u = args[:3]
        g_ = args.pop(3) if g is not None else None
        s_ = args[3] if state0 is not None else None
        return fn(k, w, u, g_, runs, s_)

    _, vjp = jax.vjp(call, *_diff_args(k, w, u, g, state0))
    return _with_nones(vjp(cotangents), g, state0)


@functools.partial(jax.jit, static_argnames=("chunk_size", "num_householder"))
def xla_vjp(primals, cotangents, **kw):
    return _vjp(functools.partial(chunk_h_xla, **kw), primals, cotangents)


@functools.partial(jax.jit, static_argnames=("chunk_size", "num_householder"))
def interpret_vjp(primals, cotangents, **kw):
    """The forward kernel's h and v_new, then the backward kernels, all interpreted; cotangents
    in their primals' dtypes."""
    k, w, u, g, runs, state0 = primals
    h, v_new, _ = chunk_h_pallas(k, w, u, g, runs, state0, interpret=True, **kw)
    grads = chunk_h_bwd_pallas(k, w, g, runs, h, v_new, *cotangents,
                               with_initial_state=state0 is not None, interpret=True, **kw)
    return tuple(None if x is None else x.astype(p.dtype)
                 for x, p in zip(grads, (k, w, u, g, state0)))


def check(got, want, primals, tol=TOL):
    k, w, u, g, runs, state0 = primals
    for name, x, ref, primal in zip(NAMES, got, want, (k, w, u, g, state0)):
        if primal is None:
            assert x is None and ref is None, name
            continue
        assert x.shape == primal.shape and x.dtype == primal.dtype, (name, x.shape, x.dtype)
        assert rel_err(x, ref) < tol, (name, rel_err(x, ref))


# A covering subset: ragged T and exact multiples, M 1..3, K != V both ways, K and V that are not
# powers of two (padded inside), several value blocks, with and without g, segments, initial state.
CASES = [
    # tokens, key_dim, value_dim, m, chunk_size, gated, segments, init
    (77, 32, 16, 2, 16, True, True, True),
    (64, 16, 32, 3, 16, False, True, False),
    (50, 16, 16, 1, 16, True, False, True),
    (33, 24, 48, 3, 32, False, False, False),
]


def _case_id(case):
    tokens, key_dim, value_dim, m, chunk_size, gated, segments, init = case
    return (f"T{tokens}-K{key_dim}-V{value_dim}-M{m}-BT{chunk_size}-{'g' if gated else 'nog'}-"
            f"{'seg' if segments else 'noseg'}-{'init' if init else 'noinit'}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_interpreted_kernels_match_xla_vjp(case):
    tokens, key_dim, value_dim, m, chunk_size, gated, segments, init = case
    primals, cotangents, kw = make_inputs(tokens + m, tokens=tokens, key_dim=key_dim,
                                          value_dim=value_dim, m=m, chunk_size=chunk_size,
                                          gated=gated, segments=segments, init=init)
    check(interpret_vjp(primals, cotangents, **kw), xla_vjp(primals, cotangents, **kw), primals)


def test_segment_on_chunk_boundaries_and_partial_last_chunk():
    # Segments starting exactly on chunk boundaries (16, and 32 = first token of the partial last
    # chunk), a length-1 segment in the middle and at the very end; g, initial state, M = 2.
    primals, cotangents, kw = make_inputs(3, tokens=40, key_dim=16, value_dim=32, m=2,
                                          chunk_size=16, gated=True, segments=True, init=True,
                                          segment_ids=BOUNDARY_IDS)
    want = xla_vjp(primals, cotangents, **kw)
    check(interpret_vjp(primals, cotangents, **kw), want, primals)
    # The initial state reaches only each row's first segment: in row 0 it ends at 16, so the
    # initial state's cotangent is that of h[0] walked back through chunk 0 alone.
    k, w, u, g, runs, state0 = primals
    dh = cotangents[0].at[0, 1:].set(0.0)
    only_first = xla_vjp(primals, (dh, cotangents[1].at[0, 32:].set(0.0), cotangents[2]), **kw)
    np.testing.assert_allclose(np.asarray(only_first[4])[0], np.asarray(want[4])[0], rtol=1e-6,
                               atol=1e-6)


def test_direct_call_split_into_key_and_value_blocks():
    # chunk_h_bwd_pallas on its own, from chunk_h_xla's residuals, K = 32 and V = 48 split into
    # 16-wide key and value blocks (the default would use one key block).
    primals, cotangents, kw = make_inputs(9, tokens=45, key_dim=32, value_dim=48, m=2,
                                          chunk_size=16, gated=True, segments=True, init=True)
    k, w, u, g, runs, state0 = primals

    @jax.jit
    def direct(k, w, u, g, runs, state0, cotangents):
        h, v_new, _ = chunk_h_xla(k, w, u, g, runs, state0, **kw)
        return chunk_h_bwd_pallas(k, w, g, runs, h, v_new, *cotangents, with_initial_state=True,
                                  interpret=True, block_k=16, block_v=16, **kw)

    got = direct(*primals, cotangents)
    check(got, xla_vjp(primals, cotangents, **kw), primals)


def test_cotangent_of_h_at_every_second_chunk():
    # subchunks=2, as chunk.py's backward calls it: dh is given only for the states stored before
    # every second chunk, i.e. jax.vjp of chunk_h_xla with dh zero at the other chunks.
    primals, cotangents, kw = make_inputs(13, tokens=64, key_dim=16, value_dim=32, m=2,
                                          chunk_size=16, gated=True, segments=True, init=True)
    k, w, u, g, runs, state0 = primals
    dh, dv_new, dfinal = cotangents
    dh_every_second = dh.at[:, 1::2].set(0.0)

    @jax.jit
    def direct(k, w, u, g, runs, state0, dh_stored, dv_new, dfinal):
        h, v_new, _ = chunk_h_xla(k, w, u, g, runs, state0, **kw)
        return chunk_h_bwd_pallas(k, w, g, runs, h, v_new, dh_stored, dv_new, dfinal,
                                  with_initial_state=True, interpret=True, subchunks=2, **kw)

    got = direct(*primals, dh[:, ::2], dv_new, dfinal)
    check(got, xla_vjp(primals, (dh_every_second, dv_new, dfinal), **kw), primals)
    # T must fill whole groups of chunks: padding here would decay the final state's cotangent.
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        chunk_h_bwd_pallas(k[:, :48 * 2], w[:, :48 * 2], g[:, :48], runs[:, :48],
                           *chunk_h_xla(k[:, :96], w[:, :96], u[:, :96], g[:, :48], runs[:, :48],
                                        state0, **kw)[:2],
                           dh[:, :3:2], dv_new[:, :96], dfinal, with_initial_state=True,
                           interpret=True, subchunks=2, **kw)


def test_bf16_keys():
    # The full op hands stage 3 keys in the inputs' dtype (w, u are float32 from the WY stage):
    # dk comes back in bf16, computed in float32 like the reference, so only rounding differs.
    primals, cotangents, kw = make_inputs(5, tokens=40, key_dim=16, value_dim=16, m=2,
                                          chunk_size=16, gated=True, segments=True, init=True,
                                          k_dtype=jnp.bfloat16)
    got = interpret_vjp(primals, cotangents, **kw)
    assert got[0].dtype == jnp.bfloat16
    check(got, xla_vjp(primals, cotangents, **kw), primals, tol=1e-2)


@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=_case_id)
def test_bfloat16_dots(case):
    # The op's configuration for 16-bit inputs: k, w, h and v_new in bf16, both kernels' dots on
    # bf16 operands, dvt, dS and dw passed through HBM in bf16 (dot_dtype). Against jax.vjp of
    # the jnp scan in float32 on the same rounded k and w, to the half-input tolerance.
    tokens, key_dim, value_dim, m, chunk_size, gated, segments, init = case
    primals, cotangents, kw = make_inputs(tokens + 2 * m, tokens=tokens, key_dim=key_dim,
                                          value_dim=value_dim, m=m, chunk_size=chunk_size,
                                          gated=gated, segments=segments, init=init,
                                          k_dtype=jnp.bfloat16)
    k, w, u, g, runs, state0 = primals
    bf16, f32 = jnp.bfloat16, jnp.float32
    w = w.astype(bf16).astype(f32)

    @jax.jit
    def kernels(k, w, u, g, runs, state0, cotangents):
        h, v_new, _ = chunk_h_pallas(k, w.astype(bf16), u, g, runs, state0, interpret=True,
                                     h_dtype=bf16, v_new_dtype=bf16, dot_dtype=bf16, **kw)
        return chunk_h_bwd_pallas(k, w.astype(bf16), g, runs, h, v_new, *cotangents,
                                  with_initial_state=state0 is not None, interpret=True,
                                  dot_dtype=bf16, **kw)

    got = kernels(k, w, u, g, runs, state0, cotangents)
    want = xla_vjp((k.astype(f32), w, u, g, runs, state0), cotangents, **kw)
    assert got[1].dtype == bf16 and got[2].dtype == bf16          # dw, du
    assert got[0].dtype == f32                                     # dk, summed on in float32
    for name, x, ref in zip(NAMES, got, want):
        if ref is None:
            assert x is None, name
            continue
        assert x.shape == ref.shape, (name, x.shape, ref.shape)
        assert rel_err(x, ref) < 2e-2, (name, rel_err(x, ref))
