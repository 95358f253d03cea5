"""gdp_jax.layers.GatedDeltaProduct (the Flax NNX layer, also exported as gdp_jax.nn) on CPU:
shapes and dtypes, decode steps against the forward, prefill then decode, segment isolation,
gradients reaching every parameter. The layer runs the jnp path ("xla"); the op under it is
tested against the recurrence in test_full_op.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

from gdp_jax.layers import GatedDeltaProduct  # noqa: E402

D, H, K = 32, 2, 16


def test_nn_is_a_shim_of_layers():
    import gdp_jax.layers
    import gdp_jax.nn
    for name in ("GatedDeltaProduct", "GDPCache", "ShortConvolution"):
        assert getattr(gdp_jax.nn, name) is getattr(gdp_jax.layers, name), name


def _layer(**kw):
    kw.setdefault("num_householder", 2)
    return GatedDeltaProduct(D, num_heads=H, head_dim=K, chunk_size=16,
                             implementation="xla", rngs=nnx.Rngs(0), **kw)


@nnx.jit(static_argnames="return_cache")
def _fwd(layer, x, segment_ids=None, return_cache=False):
    return layer(x, segment_ids=segment_ids, return_cache=return_cache)


@nnx.jit
def _step(layer, x_t, cache):
    return layer.step(x_t, cache)


def _x(b=2, t=21, seed=1, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), (b, t, D), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_shapes_and_dtypes(dtype):
    layer = GatedDeltaProduct(D, num_heads=H, head_dim=K, expand_v=2.0, num_householder=3,
                              chunk_size=16, dtype=dtype, rngs=nnx.Rngs(0))
    x = _x(dtype=dtype)
    y, cache = _fwd(layer, x, return_cache=True)
    assert y.shape == x.shape and y.dtype == dtype
    assert cache.state.shape == (2, H, K, 2 * K) and cache.state.dtype == jnp.float32
    assert cache.conv_q.shape == (2, 3, H * K)
    assert cache.conv_k.shape == (2, 3, 3 * H * K)
    assert cache.conv_v.shape == (2, 3, 3 * H * 2 * K)
    y_t, _ = _step(layer, x[:, 0], layer.init_cache(2, dtype))
    assert y_t.shape == (2, D) and y_t.dtype == dtype
    assert bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))


@pytest.mark.parametrize("kw", [
    {},
    {"use_forget_gate": False},
    {"allow_neg_eigval": False, "use_output_gate": False},
    {"use_short_conv": False, "num_householder": 1},
])
def test_decode_matches_forward(kw):
    layer = _layer(**kw)
    x = _x()
    with jax.default_matmul_precision("highest"):
        y, cache = _fwd(layer, x, return_cache=True)
        c = layer.init_cache(2)
        outs = []
        for t in range(x.shape[1]):
            y_t, c = _step(layer, x[:, t], c)
            outs.append(y_t)
    np.testing.assert_allclose(np.stack(outs, 1), y, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(c.state, cache.state, atol=1e-4, rtol=1e-4)
    if layer.use_short_conv:
        np.testing.assert_allclose(c.conv_k, cache.conv_k, atol=1e-6)


def test_prefill_cache_then_decode():
    layer = _layer()
    x = _x(t=20)
    with jax.default_matmul_precision("highest"):
        y = _fwd(layer, x)
        _, cache = _fwd(layer, x[:, :13], return_cache=True)
        outs = []
        for t in range(13, 20):
            y_t, cache = _step(layer, x[:, t], cache)
            outs.append(y_t)
    np.testing.assert_allclose(np.stack(outs, 1), y[:, 13:], atol=1e-4, rtol=1e-4)


def test_segment_isolation():
    layer = _layer()
    t = 24
    seg = jnp.array([[0] * 7 + [1] * 10 + [2] * 7, [5] * 12 + [3] * 12], jnp.int32)
    x = _x(t=t)
    # change every token of segment 1 of row 0 and of segment "3" of row 1
    changed = jnp.zeros((2, t), bool).at[0, 7:17].set(True).at[1, 12:].set(True)
    x2 = jnp.where(changed[..., None], _x(t=t, seed=9), x)
    with jax.default_matmul_precision("highest"):
        y, y2 = _fwd(layer, x, seg), _fwd(layer, x2, seg)
    same = ~changed
    np.testing.assert_allclose(np.asarray(y)[np.asarray(same)], np.asarray(y2)[np.asarray(same)],
                               atol=1e-6)
    assert float(jnp.max(jnp.abs(y - y2))) > 1e-2
    # each segment alone equals its slice of the packed row (state and conv restart)
    with jax.default_matmul_precision("highest"):
        alone = _fwd(layer, x[:1, 7:17])
    np.testing.assert_allclose(y[:1, 7:17], alone, atol=1e-4, rtol=1e-4)


def test_segment_ids_constant_equals_none():
    layer = _layer()
    x = _x()
    with jax.default_matmul_precision("highest"):
        a = _fwd(layer, x)
        b = _fwd(layer, x, jnp.full(x.shape[:2], 4, jnp.int32))
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_gradients_reach_all_params():
    layer = _layer()
    x = _x()
    seg = jnp.array([[0] * 10 + [1] * 11] * 2, jnp.int32)

    def loss(model):
        return jnp.mean(model(x, segment_ids=seg) ** 2)

    grads = nnx.jit(nnx.grad(loss))(layer)
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param))
    assert len(leaves) >= 12
    for path, g in leaves:
        g = np.asarray(g)
        assert np.all(np.isfinite(g)), path
        assert np.any(g != 0), path


@pytest.mark.parametrize("width,bias", [(1, False), (2, True), (4, False)])
def test_short_conv_against_fla_and_its_steps(width, bias):
    """ShortConvolution (float32) against fla's causal conv + SiLU in float64, per segment of a
    packed row, and its decode steps against its own full call."""
    import fla_reference as ref
    from gdp_jax.layers import ShortConvolution
    channels, tokens = 6, 11
    conv = ShortConvolution(channels, width, use_bias=bias, rngs=nnx.Rngs(width))
    if bias:
        conv.conv.bias.set_value(jax.random.normal(jax.random.key(5), (channels,)))
    x = jax.random.normal(jax.random.key(width), (2, tokens, channels))
    seg = jnp.asarray([[0] * 4 + [1] * 7, [0] * 11])
    got = np.asarray(conv(x, segment_ids=seg), np.float64)
    weight = np.asarray(conv.conv.kernel.get_value(), np.float64).transpose(2, 1, 0)  # [C, 1, W]
    b = np.asarray(conv.conv.bias.get_value(), np.float64) if bias else None
    xs = np.asarray(x, np.float64)
    for row, cuts in ((0, [(0, 4), (4, 11)]), (1, [(0, 11)])):
        for s, e in cuts:
            want = ref.causal_conv_silu(xs[row, s:e], weight, b)
            np.testing.assert_allclose(got[row, s:e], want, rtol=1e-5, atol=1e-6)
    state = jnp.zeros((2, width - 1, channels))
    steps = []
    for t in range(tokens):
        y, state = conv.step(x[:, t], state)
        steps.append(y)
    assert state.shape == (2, width - 1, channels)
    np.testing.assert_allclose(np.stack(steps, 1), np.asarray(conv(x)), rtol=1e-6, atol=1e-6)
