"""gdp_jax.models on CPU without fla: config and names as fla's code has them, the model against a
numpy statement of fla's model (tests/fla_reference.py), checkpoints (save -> load, name errors)
and generate (greedy = the full forward's argmax, batched = unbatched, eos, top-k sampling)."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")
pytest.importorskip("safetensors")

from gdp_jax.models import (GatedDeltaProductConfig, GatedDeltaProductForCausalLM,  # noqa: E402
                            fla_state_dict, from_pretrained, generate, init_model,
                            read_safetensors)

import fla_reference as ref  # noqa: E402

VOCAB = 64
HYBRID = dict(hidden_size=32, num_heads=2, head_dim=16, expand_v=2.0, num_hidden_layers=2,
              vocab_size=VOCAB, intermediate_size=64, use_forget_gate=True, allow_neg_eigval=True,
              num_householder=2, initializer_range=0.2, eos_token_id=None,
              attn={"layers": [1], "num_heads": 4, "num_kv_heads": 2})


def _model(seed=0, **overrides):
    return init_model(GatedDeltaProductConfig(**{**HYBRID, **overrides}), seed=seed,
                      chunk_size=16, implementation="xla")


@pytest.fixture(scope="module")
def hybrid():
    return _model()


@nnx.jit
def _logits(model, ids, mask=None):
    return model(ids, attention_mask=mask)


def _ids(b, t, seed=1):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, VOCAB)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


# -- config --------------------------------------------------------------------------------------

# fla/models/gated_deltaproduct/configuration_gated_deltaproduct.py (flash-linear-attention 0.6.0)
FLA_DEFAULTS = dict(
    attn_mode="chunk", conv_size=4, head_dim=256, num_heads=6, hidden_size=2048, expand_v=2.0,
    use_output_gate=True, use_short_conv=True, max_position_embeddings=2048, hidden_ratio=4,
    intermediate_size=None, hidden_act="swish", num_hidden_layers=21, norm_eps=1e-6, attn=None,
    use_cache=True, pad_token_id=None, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    initializer_range=0.02, fuse_norm=True, fuse_swiglu=True, fuse_cross_entropy=True,
    fuse_linear_cross_entropy=False, use_l2warp=False, vocab_size=32000, use_forget_gate=False,
    allow_neg_eigval=False, num_householder=1, attnres_block_size=None)


def test_config_fields_and_defaults_are_fla():
    cfg = GatedDeltaProductConfig()
    assert GatedDeltaProductConfig.field_names() == list(FLA_DEFAULTS)
    assert {k: getattr(cfg, k) for k in FLA_DEFAULTS} == FLA_DEFAULTS
    assert cfg.resolved_intermediate_size == 5632 and cfg.head_v_dim == 512  # fla's GatedMLP rule
    # Hugging Face omits fields equal to its defaults: missing fields take fla's
    small = GatedDeltaProductConfig.from_dict({"model_type": "gated_deltaproduct", "vocab_size": 7,
                                               "transformers_version": "5.17.0"})
    assert small.vocab_size == 7 and small.num_heads == 6
    assert small.extra == {"transformers_version": "5.17.0"}
    d = small.to_dict()
    assert d["model_type"] == "gated_deltaproduct" and d["transformers_version"] == "5.17.0"
    assert d["architectures"] == ["GatedDeltaProductForCausalLM"]
    assert GatedDeltaProductConfig.from_dict(d).to_dict() == d


def test_config_attention_spec_and_errors():
    cfg = GatedDeltaProductConfig(num_hidden_layers=4, hidden_size=64,
                                  attn=[{"layers": [1, 3], "num_heads": 4}])
    spec = cfg.attention_spec(3)
    assert spec == {"layers": [1, 3], "num_heads": 4, "num_kv_heads": 4, "qkv_bias": False,
                    "window_size": None, "rope_theta": 10000.0}
    assert cfg.attention_spec(0) is None
    for bad, match in [({"attn": {"layers": [4], "num_heads": 4}}, "attn.layers"),
                       ({"attn": {"layers": [0], "num_heads": 4, "num_kv_heads": 3}},
                        "num_kv_heads"),
                       ({"attn": [{"layers": [0], "num_heads": 4}, {"layers": [0],
                                                                   "num_heads": 2}]},
                        "already assigned"),
                       ({"hidden_act": "gelu"}, "hidden_act"),
                       ({"expand_v": 0.3, "head_dim": 16}, "expand_v"),
                       ({"num_heads": 0}, "num_heads")]:
        with pytest.raises(ValueError, match=match):
            GatedDeltaProductConfig(**{"num_hidden_layers": 4, "hidden_size": 64, **bad})
    with pytest.raises(NotImplementedError, match="attnres_block_size"):
        GatedDeltaProductConfig(attnres_block_size=2)
    with pytest.raises(ValueError, match="model_type"):
        GatedDeltaProductConfig.from_dict({"model_type": "llama"})


# -- names ---------------------------------------------------------------------------------------

def _fla_names(config):
    """fla's state-dict names and shapes, as modeling_gated_deltaproduct.py, layers/
    gated_deltaproduct.py, layers/attn.py and modules/mlp.py build them (torch layouts)."""
    c = GatedDeltaProductConfig(**config)
    d, h, k, v, m, w = (c.hidden_size, c.num_heads, c.head_dim, c.head_v_dim, c.num_householder,
                        c.conv_size)
    inter = c.resolved_intermediate_size
    out = {"model.embeddings.weight": (c.vocab_size, d), "model.norm.weight": (d,)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, d)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        out.update({p + "attn_norm.weight": (d,), p + "mlp_norm.weight": (d,),
                    p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
                    p + "mlp.down_proj.weight": (d, inter)})
        spec = c.attention_spec(i)
        if spec is not None:
            kv = spec["num_kv_heads"] * (d // spec["num_heads"])
            out.update({p + "attn.q_proj.weight": (d, d), p + "attn.k_proj.weight": (kv, d),
                        p + "attn.v_proj.weight": (kv, d), p + "attn.o_proj.weight": (d, d)})
            if spec["qkv_bias"]:
                out.update({p + "attn.q_proj.bias": (d,), p + "attn.k_proj.bias": (kv,),
                            p + "attn.v_proj.bias": (kv,)})
            continue
        out.update({p + "attn.q_proj.weight": (h * k, d), p + "attn.k_proj.weight": (m * h * k, d),
                    p + "attn.v_proj.weight": (m * h * v, d), p + "attn.b_proj.weight": (m * h, d),
                    p + "attn.o_norm.weight": (v,), p + "attn.o_proj.weight": (d, h * v)})
        if c.use_forget_gate:
            out.update({p + "attn.a_proj.weight": (h, d), p + "attn.A_log": (h,),
                        p + "attn.dt_bias": (h,)})
        if c.use_short_conv:
            out.update({p + "attn.q_conv1d.weight": (h * k, 1, w),
                        p + "attn.k_conv1d.weight": (m * h * k, 1, w),
                        p + "attn.v_conv1d.weight": (m * h * v, 1, w)})
        if c.use_output_gate:
            out[p + "attn.g_proj.weight"] = (h * v, d)
    return out


@pytest.mark.parametrize("overrides", [
    {"attn": {"layers": [1], "num_heads": 4, "num_kv_heads": 2, "qkv_bias": True}},
    {"tie_word_embeddings": True, "use_forget_gate": False, "use_short_conv": False,
     "use_output_gate": False, "attn": None, "num_householder": 3},
], ids=["hybrid", "tied+minimal"])
def test_parameter_names_are_fla(overrides):
    config = {**HYBRID, **overrides}
    model = nnx.eval_shape(lambda: GatedDeltaProductForCausalLM(
        GatedDeltaProductConfig(**config), rngs=nnx.Rngs(0)))
    ours = {k: tuple(v.shape) for k, v in fla_state_dict_abstract(model).items()}
    assert ours == _fla_names(config)


def fla_state_dict_abstract(model):
    from gdp_jax.models.convert import _param_vars, fla_name, to_fla_layout
    return {fla_name(p): to_fla_layout(p, np.zeros(v.get_value().shape, np.int8))
            for p, v in _param_vars(model)}


# -- the model against fla's model math -----------------------------------------------------------

@pytest.mark.parametrize("overrides", [{}, {"hidden_act": "powlu", "tie_word_embeddings": True,
                                            "use_short_conv": False, "attn": None}],
                         ids=["hybrid", "powlu+tied+no_conv"])
def test_model_matches_fla_reference(overrides, hybrid):
    model = _model(**overrides) if overrides else hybrid
    ids = _ids(2, 18)
    mask = np.ones((2, 18), np.int32)
    mask[0, :5] = 0       # left padding
    mask[1, 9:11] = 0     # a hole
    with jax.default_matmul_precision("highest"):
        got = _logits(model, ids, jnp.asarray(mask))
    params = {k: np.asarray(v, np.float64) for k, v in fla_state_dict(model).items()}
    want = ref.causal_lm(params, model.config.to_dict(), np.asarray(ids), mask)
    real = mask == 1
    assert _rel(np.asarray(got)[real], want[real]) < 1e-4
    # at padding the mixers give zero, as fla's repadding: the logits there are fla's too
    assert _rel(np.asarray(got)[~real], want[~real]) < 1e-4


# -- checkpoints ---------------------------------------------------------------------------------

def test_save_load_identical(tmp_path, hybrid):
    hybrid.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "gated_deltaproduct" and config["dtype"] == "float32"
    assert config["architectures"] == ["GatedDeltaProductForCausalLM"]
    tensors = read_safetensors(tmp_path)
    assert set(tensors) == set(_fla_names(HYBRID))
    loaded = GatedDeltaProductForCausalLM.from_pretrained(tmp_path, chunk_size=16,
                                                          implementation="xla")
    ids = _ids(2, 11)
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(hybrid, ids))
    # bfloat16 on disk -> bfloat16 parameters by default
    hybrid.save_pretrained(tmp_path / "bf16", dtype=jnp.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    half = from_pretrained(tmp_path / "bf16", implementation="xla")
    assert half.model.embeddings.embedding.get_value().dtype == jnp.bfloat16
    assert half.model.layers[0].attn.A_log.get_value().dtype == jnp.bfloat16


def test_tied_checkpoint_has_no_head(tmp_path):
    model = _model(tie_word_embeddings=True, attn=None, num_hidden_layers=1)
    model.save_pretrained(tmp_path)
    assert "lm_head.weight" not in read_safetensors(tmp_path)
    loaded = from_pretrained(tmp_path, implementation="xla", chunk_size=16)
    np.testing.assert_array_equal(loaded.model.embeddings.embedding.get_value(),
                                  model.model.embeddings.embedding.get_value())


def test_checkpoint_name_errors(tmp_path, hybrid):
    from safetensors.numpy import save_file
    hybrid.save_pretrained(tmp_path)
    tensors = read_safetensors(tmp_path)
    cases = {
        "missing": ({k: v for k, v in tensors.items() if k != "model.layers.0.attn.A_log"},
                    r"missing.*model\.layers\.0\.attn\.A_log"),
        "unknown": ({**tensors, "model.layers.0.attn.q_conv1d.bias": np.zeros(32, np.float32)},
                    r"unknown.*model\.layers\.0\.attn\.q_conv1d\.bias"),
        "shape": ({**tensors, "lm_head.weight": np.zeros((VOCAB + 1, 32), np.float32)},
                  r"lm_head\.weight: checkpoint \(65, 32\), expected \(64, 32\)"),
    }
    for name, (bad, match) in cases.items():
        save_file(bad, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=match):
            from_pretrained(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        from_pretrained(tmp_path / "empty")
    with pytest.raises(ValueError, match="not a directory"):
        from_pretrained(tmp_path / "nowhere")


def test_import_gdp_jax_models_needs_no_torch():
    code = ("import sys, gdp_jax; assert 'flax' not in sys.modules; "
            "import gdp_jax.models; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- generate ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def greedy_run(hybrid):
    prompts = [list(range(3, 12)), [40, 41, 42, 43, 44]]      # lengths 9 and 5
    out = generate(hybrid, prompts, 8)
    return prompts, out


def test_greedy_is_the_full_forward_argmax(hybrid, greedy_run):
    """Each greedy token is the argmax of the full forward on the prompt and the tokens before
    it (one causal forward over the whole sequence recomputes every step)."""
    prompts, out = greedy_run
    assert out.tokens.shape == (2, 8) and out.sequences.shape == (2, 17)
    assert list(np.asarray(out.lengths)) == [8, 8]
    for b, logits in enumerate(_step_logits(hybrid, prompts, out.tokens)):
        np.testing.assert_array_equal(np.argmax(logits, axis=-1), out.tokens[b])


def _step_logits(model, prompts, tokens):
    """The logits that chose each generated token, from one causal forward over prompt + tokens
    (the rows right-padded into one batch: padding changes nothing, test_model_matches_fla_...)."""
    tokens = np.asarray(tokens)
    n = tokens.shape[1]
    longest = max(len(p) for p in prompts) + n
    ids = np.zeros((len(prompts), longest), np.int32)
    mask = np.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, :len(p) + n] = list(p) + list(tokens[b])
        mask[b, :len(p) + n] = 1
    logits = np.asarray(_logits(model, jnp.asarray(ids), jnp.asarray(mask)))
    return [logits[b, len(p) - 1:len(p) - 1 + n] for b, p in enumerate(prompts)]


def test_batched_prompts_equal_unbatched(hybrid, greedy_run):
    prompts, out = greedy_run
    alone = generate(hybrid, jnp.asarray([prompts[1]], jnp.int32), 8)
    np.testing.assert_array_equal(alone.tokens[0], out.tokens[1])
    # the same batch as an array padded on the right, with attention_mask
    ids = np.zeros((2, 9), np.int32)
    mask = np.zeros((2, 9), np.int32)
    for b, p in enumerate(prompts):
        ids[b, :len(p)], mask[b, :len(p)] = p, 1
    right = generate(hybrid, ids, 8, attention_mask=mask)
    np.testing.assert_array_equal(right.tokens, out.tokens)


def test_eos_stops(hybrid, greedy_run):
    prompts, out = greedy_run
    row0 = list(np.asarray(out.tokens[0]))
    eos = row0[2]
    first = row0.index(eos)
    stopped = generate(hybrid, prompts, 8, eos_token_id=eos, pad_token_id=0)
    assert list(np.asarray(stopped.tokens[0])) == row0[:first + 1] + [0] * (7 - first)
    assert int(stopped.lengths[0]) == first + 1
    row1 = list(np.asarray(out.tokens[1]))
    n1 = row1.index(eos) + 1 if eos in row1 else 8
    assert list(np.asarray(stopped.tokens[1])) == row1[:n1] + [0] * (8 - n1)


def test_top_k_sampling_respects_k(hybrid, greedy_run):
    prompts, greedy = greedy_run
    k = 3
    out = generate(hybrid, prompts, 8, temperature=1.5, top_k=k, rng=0)
    again = generate(hybrid, prompts, 8, temperature=1.5, top_k=k, rng=0)
    np.testing.assert_array_equal(out.tokens, again.tokens)           # a seed is a seed
    for b, logits in enumerate(_step_logits(hybrid, prompts, out.tokens)):
        kth = np.sort(logits, axis=-1)[:, -k]
        chosen = logits[np.arange(8), np.asarray(out.tokens[b])]
        assert np.all(chosen >= kth), (b, chosen, kth)
    assert not np.array_equal(out.tokens, greedy.tokens)   # it did sample


def test_temperature_sampling(hybrid, greedy_run):
    """Sampling with a temperature alone (no top_k): a seed is a seed; near 0 it is greedy; hot,
    it leaves greedy."""
    prompts, greedy = greedy_run
    hot = generate(hybrid, prompts, 8, temperature=5.0, rng=1)
    np.testing.assert_array_equal(hot.tokens, generate(hybrid, prompts, 8, temperature=5.0,
                                                       rng=1).tokens)
    assert not np.array_equal(hot.tokens, greedy.tokens)
    cold = generate(hybrid, prompts, 8, temperature=1e-4, rng=1)
    np.testing.assert_array_equal(cold.tokens, greedy.tokens)


def test_generate_rejects_bad_arguments(hybrid):
    ids = _ids(1, 4)
    for kwargs, err, match in [
            (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
            (dict(max_new_tokens=2, top_k=3), ValueError, "top_k"),
            (dict(max_new_tokens=2, temperature=1.0), ValueError, "rng"),
            (dict(max_new_tokens=2, temperature=-1.0), ValueError, "temperature"),
            (dict(max_new_tokens=2, eos_token_id="x"), TypeError, "eos_token_id"),
            (dict(max_new_tokens=2, attention_mask=np.ones((1, 3))), ValueError,
             "attention_mask")]:
        with pytest.raises(err, match=match):
            generate(hybrid, ids, **kwargs)
    with pytest.raises(ValueError, match="input_ids"):
        generate(hybrid, jnp.ones((4,), jnp.int32), 2)
    with pytest.raises(TypeError, match="model"):
        generate(object(), ids, 2)


def test_generate_sees_new_weights_between_calls():
    """generate caches each model's split: values assigned in place and a swapped submodule must
    both reach the next call (its tokens stay the full forward's argmax)."""
    model = _model(seed=3, num_hidden_layers=1, attn=None)
    prompts = [list(range(5, 12)), [30, 31, 32]]

    def check():
        out = generate(model, prompts, 1)   # the prefill alone: one compile per split
        for b, logits in enumerate(_step_logits(model, prompts, out.tokens)):
            np.testing.assert_array_equal(np.argmax(logits, axis=-1), out.tokens[b])
        return np.asarray(out.tokens)

    before = check()
    kernel = model.lm_head.kernel
    kernel.set_value(jax.random.normal(jax.random.key(7), kernel.get_value().shape,
                                       kernel.get_value().dtype))
    in_place = check()
    assert not np.array_equal(in_place, before)
    model.lm_head = nnx.Linear(kernel.get_value().shape[0], VOCAB, use_bias=False,
                               rngs=nnx.Rngs(11))
    swapped = check()
    assert not np.array_equal(swapped, in_place)
