"""recurrent_gdp_step, one token of SPEC's recurrence for decoding: against a float64 numpy step,
eager and under jit, and token by token against the chunked op and the recurrence."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

import gdp_jax
from cases import Case, assert_close, build, run_full_op, tolerance


def _step64(q, k, v, g, beta, state, scale):
    """SPEC's token step in float64 numpy: gate once, M Householder steps, read out."""
    s = np.asarray(state, np.float64)
    if g is not None:
        s = np.exp(np.asarray(g, np.float64))[..., None, None] * s
    for step in range(k.shape[1]):
        kj = np.asarray(k[:, step], np.float64)
        v_new = beta[:, step, :, None] * (v[:, step] - np.einsum("bhkv,bhk->bhv", s, kj))
        s = s + np.einsum("bhk,bhv->bhkv", kj, v_new)
    return scale * np.einsum("bhkv,bhk->bhv", s, np.asarray(q, np.float64)), s


class DecodeStepTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_one_step(self):
        """With a gate and the default scale, and without a gate at scale 0.5; o in v's dtype,
        the new state in the state's."""
        rng = np.random.default_rng(0)
        b, m, h, kd, vd = 2, 3, 3, 8, 4
        q = rng.normal(size=(b, h, kd)).astype(np.float32)
        k = rng.normal(size=(b, m, h, kd)).astype(np.float32)
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        v = rng.normal(size=(b, m, h, vd)).astype(np.float32)
        beta = rng.uniform(0.1, 1.9, size=(b, m, h)).astype(np.float32)
        g = -rng.uniform(0.0, 0.5, size=(b, h)).astype(np.float32)
        s = rng.normal(size=(b, h, kd, vd)).astype(np.float32)
        for gate, scale in ((g, None), (None, 0.5)):
            step = self.variant(functools.partial(gdp_jax.recurrent_gdp_step, scale=scale))
            o, s_new = step(q, k, v, gate, beta, s)
            chex.assert_type([o, s_new], [jnp.float32, jnp.float32])
            chex.assert_shape([o, s_new], [(b, h, vd), (b, h, kd, vd)])
            o_ref, s_ref = _step64(q, k, v, gate, beta, s, kd ** -0.5 if scale is None else scale)
            assert_close(s_new, s_ref, tolerance("float32"), "state")
            assert_close(o, o_ref, tolerance("float32"), "o")


def test_matches_chunked_op_token_by_token():
    """A scan of decode steps over a row gives the chunked op's o and final state (xla), and the
    recurrence's; with use_qk_l2norm both normalise raw q, k with the same formula (the step
    without it: DecodeStepTest)."""
    use_qk_l2norm = True
    p = build(Case(20, 16, 32, 3, 16, segments=False), qk_l2norm=use_qk_l2norm)
    o_chunked, final_chunked = run_full_op(p, "xla", use_qk_l2norm=use_qk_l2norm)
    batch, tokens, heads, _ = p.q.shape
    m = p.case.m
    k_t = p.k.reshape(batch, tokens, m, heads, -1)
    v_t = p.v.reshape(batch, tokens, m, heads, -1)
    beta_t = p.beta.reshape(batch, tokens, m, heads)
    step = functools.partial(gdp_jax.recurrent_gdp_step, use_qk_l2norm=use_qk_l2norm)

    def body(state, xs):
        o_t, state = step(*xs, state)
        return state, o_t

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (p.q, k_t, v_t, p.g_raw, beta_t))
    final, o = jax.jit(lambda s, xs: jax.lax.scan(body, s, xs))(p.initial_state, xs)
    o = jnp.moveaxis(o, 0, 1)
    chex.assert_type([o, final], [jnp.float32, jnp.float32])
    assert_close(o, p.ref["o"], tolerance("float32"), "o vs recurrence")
    assert_close(final, p.ref["final_state"], tolerance("float32"), "final vs recurrence")
    assert_close(o, o_chunked, tolerance("float32"), "o vs chunked op")
    assert_close(final, final_chunked, tolerance("float32"), "final vs chunked op")
