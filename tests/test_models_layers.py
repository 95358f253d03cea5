"""The layer options fla has (num_v_heads, conv_bias, use_short_conv=False, attention_mask) and the
hybrid attention layer, against numpy statements of fla's modules (tests/fla_reference.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

from gdp_jax.layers import GatedDeltaProduct  # noqa: E402
from gdp_jax.models.attention import Attention  # noqa: E402
from gdp_jax.models.convert import fla_state_dict  # noqa: E402

import fla_reference as ref  # noqa: E402
from cases import randomize_biases  # noqa: E402

D, H, K = 32, 2, 16


def _params64(module):
    return {k: np.asarray(v, np.float64) for k, v in fla_state_dict(module).items()}


def _layer(**kw):
    kw.setdefault("num_householder", 2)
    layer = GatedDeltaProduct(D, num_heads=H, head_dim=K, chunk_size=16, implementation="xla",
                              rngs=nnx.Rngs(0), **kw)
    randomize_biases(layer)
    return layer


def _cfg(layer):
    return dict(num_heads=layer.num_heads, num_v_heads=layer.num_v_heads,
                head_dim=layer.head_dim, head_v_dim=layer.head_v_dim,
                num_householder=layer.num_householder, use_short_conv=layer.use_short_conv,
                allow_neg_eigval=layer.allow_neg_eigval, use_forget_gate=layer.use_forget_gate,
                use_output_gate=layer.use_output_gate, norm_eps=1e-5)


@nnx.jit(static_argnames="return_cache")
def _fwd(layer, x, segment_ids=None, attention_mask=None, return_cache=False):
    return layer(x, segment_ids=segment_ids, attention_mask=attention_mask,
                 return_cache=return_cache)


@nnx.jit
def _step(layer, x_t, cache):
    return layer.step(x_t, cache)


def _x(b=2, t=19, seed=1):
    return jax.random.normal(jax.random.key(seed), (b, t, D), jnp.float32)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("kw", [
    {"num_v_heads": 4, "conv_bias": True},
    {"use_short_conv": False, "no_conv_activation": "silu", "num_v_heads": 4, "expand_v": 2.0,
     "use_forget_gate": False, "allow_neg_eigval": False, "use_output_gate": False,
     "num_householder": 3},
], ids=["num_v_heads+conv_bias", "silu_no_conv+ungated"])
def test_layer_options_match_fla(kw):
    layer = _layer(**kw)
    x = _x()
    with jax.default_matmul_precision("highest"):
        y = _fwd(layer, x)
    want, _ = ref.gdp_layer(_params64(layer), np.asarray(x, np.float64), _cfg(layer))
    assert _rel(y, want) < 1e-4


def test_layer_defaults_unchanged():
    """No new option changes the default layer: same parameters, no conv bias, H value heads,
    and without short convolutions SiLU on the projections as fla (linear on request)."""
    layer = GatedDeltaProduct(D, num_heads=H, head_dim=K, rngs=nnx.Rngs(0))
    assert layer.num_v_heads == H and not layer.conv_bias
    assert not hasattr(layer.q_conv.conv, "bias") or layer.q_conv.conv.bias is None
    names = set(fla_state_dict(layer))
    assert "q_conv1d.bias" not in names and "A_log" in names
    plain = GatedDeltaProduct(D, num_heads=H, head_dim=K, use_short_conv=False, rngs=nnx.Rngs(0))
    z = jnp.linspace(-3, 3, 7)
    assert plain.no_conv_activation == "silu" and np.allclose(plain._no_conv(z), jax.nn.silu(z))
    linear = GatedDeltaProduct(D, num_heads=H, head_dim=K, use_short_conv=False,
                               no_conv_activation=None, rngs=nnx.Rngs(0))
    assert np.array_equal(linear._no_conv(z), z)
    with pytest.raises(ValueError, match="no_conv_activation"):
        GatedDeltaProduct(D, num_heads=H, head_dim=K, no_conv_activation="gelu", rngs=nnx.Rngs(0))


MASKS = {
    "left": [[0, 0, 0, 0, 0] + [1] * 14, [1] * 19],
    "right": [[1] * 12 + [0] * 7, [1] * 17 + [0] * 2],
    "holes": [[1, 1, 0, 1, 1, 1, 0, 0, 1] + [1] * 10, [0] * 3 + [1] * 8 + [0] * 2 + [1] * 6],
}


@pytest.mark.parametrize("where", sorted(MASKS))
def test_attention_mask_matches_fla(where):
    """Padding is dropped as in fla (each row's real tokens one sequence, zeros at padding); the
    cache continues each row's real tokens."""
    layer = _layer(num_v_heads=4, conv_bias=True)
    x = _x()
    mask = np.asarray(MASKS[where], np.int32)
    with jax.default_matmul_precision("highest"):
        y, cache = _fwd(layer, x, attention_mask=jnp.asarray(mask), return_cache=True)
    p, cfg = _params64(layer), _cfg(layer)
    want, states = ref.gdp_layer(p, np.asarray(x, np.float64), cfg, attention_mask=mask)
    assert _rel(y, want) < 1e-4
    assert np.all(np.asarray(y)[mask == 0] == 0)
    np.testing.assert_allclose(cache.state, np.stack(states), atol=1e-5, rtol=1e-4)
    # decode three more tokens per row from the masked prefill's cache
    extra = _x(t=3, seed=7)
    outs = []
    with jax.default_matmul_precision("highest"):
        for t in range(3):
            y_t, cache = _step(layer, extra[:, t], cache)
            outs.append(np.asarray(y_t))
    for b in range(2):
        real = np.asarray(x[b])[mask[b] == 1]
        seq = np.concatenate([real, np.asarray(extra[b])], 0)[None].astype(np.float64)
        full, _ = ref.gdp_layer(p, seq, cfg)
        assert _rel(np.stack(outs, 1)[b], full[0, -3:]) < 1e-4


def test_attention_mask_with_segments_and_empty_row():
    layer = _layer()
    x = _x()
    mask = np.asarray([[0, 0] + [1] * 17, [0] * 19], np.int32)
    seg = np.asarray([[0] * 8 + [1] * 6 + [2] * 5, [0] * 19], np.int32)
    with jax.default_matmul_precision("highest"):
        y, cache = _fwd(layer, x, jnp.asarray(seg), jnp.asarray(mask), return_cache=True)
    want, states = ref.gdp_layer(_params64(layer), np.asarray(x, np.float64), _cfg(layer),
                                 attention_mask=mask, segment_ids=seg)
    assert _rel(y, want) < 1e-4
    assert np.all(np.asarray(y[1]) == 0)
    np.testing.assert_allclose(cache.state[0], states[0], atol=1e-5, rtol=1e-4)
    assert np.all(np.asarray(cache.state[1]) == 0) and np.all(np.asarray(cache.conv_k[1]) == 0)


def test_layer_rejects_bad_options():
    with pytest.raises(ValueError, match="num_v_heads"):
        GatedDeltaProduct(D, num_heads=2, head_dim=K, num_v_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="expand_v"):
        GatedDeltaProduct(D, num_heads=2, head_dim=K, expand_v=0.3, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="num_heads"):
        GatedDeltaProduct(D, num_heads=2.0, head_dim=K, rngs=nnx.Rngs(0))
    layer = _layer()
    x = _x()
    with pytest.raises(ValueError, match="attention_mask"):
        layer(x, attention_mask=jnp.ones((2, 5), jnp.int32))
    with pytest.raises(TypeError, match="attention_mask"):
        layer(x, attention_mask=jnp.ones((2, 19), jnp.float32))
    with pytest.raises(ValueError, match="x: expected"):
        layer(x[..., :8])


# -- hybrid attention layer ----------------------------------------------------------------------

def _attention(**kw):
    layer = Attention(D, 4, kw.pop("num_kv_heads", 2), rngs=nnx.Rngs(3), **kw)
    randomize_biases(layer, 1)
    return layer


@nnx.jit(static_argnames=("return_cache", "cache_length"))
def _attn_fwd(layer, x, segment_ids=None, return_cache=False, cache_length=None):
    return layer(x, segment_ids=segment_ids, return_cache=return_cache, cache_length=cache_length)


@pytest.mark.parametrize("kw", [{"qkv_bias": True}, {"window_size": 5, "num_kv_heads": 1,
                                                      "rope_theta": 500.0}],
                         ids=["gqa+bias", "window+mqa"])
def test_attention_matches_fla(kw):
    layer = _attention(**kw)
    x = _x()
    seg = np.asarray([[0] * 7 + [1] * 12, [4] * 19], np.int32)
    with jax.default_matmul_precision("highest"):
        y = _attn_fwd(layer, x, jnp.asarray(seg))
    cfg = dict(num_heads=4, num_kv_heads=layer.num_kv_heads, rope_theta=layer.rope_theta,
               window_size=layer.window_size)
    want = ref.attention_layer(_params64(layer), np.asarray(x, np.float64), cfg, segment_ids=seg)
    assert _rel(y, want) < 1e-5


def test_attention_decode_matches_forward():
    layer = _attention(window_size=6, qkv_bias=True)
    x = _x(t=16)
    seg = jnp.asarray([[0] * 5 + [1] * 11, [2] * 16], jnp.int32)
    with jax.default_matmul_precision("highest"):
        y = _attn_fwd(layer, x, seg)
        _, cache = _attn_fwd(layer, x[:, :10], seg[:, :10], return_cache=True, cache_length=16)
        outs = []
        step = nnx.jit(lambda m, a, c: m.step(a, c))
        for t in range(10, 16):
            y_t, cache = step(layer, x[:, t], cache)
            outs.append(y_t)
    np.testing.assert_allclose(np.stack(outs, 1), y[:, 10:], atol=1e-5, rtol=1e-4)
    assert int(cache.index) == 16 and list(np.asarray(cache.position)) == [11, 16]
