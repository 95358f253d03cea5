"""numpy (float64) statements of fla 0.6.0's modules, for the gdp_jax.models tests.

Each function restates the PyTorch code of flash-linear-attention 0.6.0 on fla's own parameter
names and layouts (torch Linear weight [out, in], Conv1d weight [C, 1, W]), token by token, with no
gdp_jax code: ``gdp_layer`` is fla/layers/gated_deltaproduct.py (forward with attention_mask:
padding dropped, each row's real tokens one sequence, zeros scattered back), ``attention_layer``
fla/layers/attn.py (RoPE, GQA, causal, flash-attn's window, varlen sequences), ``causal_lm``
fla/models/gated_deltaproduct/modeling_gated_deltaproduct.py (pre-norm blocks, GatedMLP,
final norm, tied or untied head).
"""
from __future__ import annotations

import numpy as np


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.logaddexp(0.0, x)


def rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def l2norm(x, eps=1e-6):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def linear(x, weight, bias=None):
    y = x @ weight.T
    return y if bias is None else y + bias


def causal_conv_silu(x, weight, bias=None):
    """fla's ShortConvolution on one sequence: x [L, C], weight [C, 1, W] -> silu(conv) [L, C]."""
    length, _ = x.shape
    width = weight.shape[-1]
    xp = np.concatenate([np.zeros((width - 1, x.shape[1])), x], axis=0)
    y = np.zeros_like(x)
    for t in range(length):
        y[t] = np.sum(xp[t:t + width] * weight[:, 0, :].T, axis=0)
    if bias is not None:
        y = y + bias
    return silu(y)


def sequences(mask_row, segment_row=None):
    """The token indices of each sequence of one row: fla drops padding (mask 0) and, with
    cu_seqlens (our segment ids), splits at every id change among the remaining tokens."""
    idx = np.nonzero(mask_row)[0] if mask_row is not None else np.arange(len(segment_row))
    if segment_row is None or len(idx) == 0:
        return [idx] if len(idx) else []
    ids = np.asarray(segment_row)[idx]
    cuts = np.nonzero(ids[1:] != ids[:-1])[0] + 1
    return np.split(idx, cuts)


def _gdp_sequence(p, x, cfg):
    """fla's GatedDeltaProduct layer on one unpadded sequence x [L, D] -> [L, D]."""
    h, hv, k_dim, v_dim, m = (cfg["num_heads"], cfg["num_v_heads"], cfg["head_dim"],
                              cfg["head_v_dim"], cfg["num_householder"])
    length = x.shape[0]
    q, k, v = (linear(x, p[f"{n}_proj.weight"]) for n in "qkv")
    if cfg["use_short_conv"]:
        q = causal_conv_silu(q, p["q_conv1d.weight"], p.get("q_conv1d.bias"))
        k = causal_conv_silu(k, p["k_conv1d.weight"], p.get("k_conv1d.bias"))
        v = causal_conv_silu(v, p["v_conv1d.weight"], p.get("v_conv1d.bias"))
    else:
        q, k, v = silu(q), silu(k), silu(v)
    q = q.reshape(length, h, k_dim)
    k = k.reshape(length, m, h, k_dim)              # '... t (n h d) -> ... (t n) h d'
    v = v.reshape(length, m, hv, v_dim)
    groups = hv // h                                 # repeat '... h d -> ... (h g) d'
    q, k = np.repeat(q, groups, axis=-2), np.repeat(k, groups, axis=-2)
    beta = sigmoid(linear(x, p["b_proj.weight"])).reshape(length, m, hv)
    if cfg["allow_neg_eigval"]:
        beta = 2.0 * beta
    g = None
    if cfg["use_forget_gate"]:
        g = -np.exp(p["A_log"]) * softplus(linear(x, p["a_proj.weight"]) + p["dt_bias"])
    q, k = l2norm(q), l2norm(k)
    scale = k_dim ** -0.5
    state = np.zeros((hv, k_dim, v_dim))
    o = np.zeros((length, hv, v_dim))
    for t in range(length):
        if g is not None:
            state = np.exp(g[t])[:, None, None] * state
        for j in range(m):
            kj = k[t, j]
            v_new = beta[t, j][:, None] * (v[t, j] - np.einsum("hkv,hk->hv", state, kj))
            state = state + np.einsum("hk,hv->hkv", kj, v_new)
        o[t] = scale * np.einsum("hkv,hk->hv", state, q[t])
    o = rms_norm(o, p["o_norm.weight"], cfg["norm_eps"])
    if cfg["use_output_gate"]:
        o = o * silu(linear(x, p["g_proj.weight"]).reshape(length, hv, v_dim))
    return linear(o.reshape(length, hv * v_dim), p["o_proj.weight"]), state


def gdp_layer(p, x, cfg, attention_mask=None, segment_ids=None):
    """fla's GatedDeltaProduct layer: x [B, T, D] -> (y [B, T, D], final states per row).

    cfg: num_heads, num_v_heads, head_dim, head_v_dim, num_householder, use_short_conv,
    allow_neg_eigval, use_forget_gate, use_output_gate, norm_eps. The state returned per row is
    that of its last sequence (None for a row with none)."""
    y = np.zeros_like(x)
    states = []
    for b in range(x.shape[0]):
        mask_row = None if attention_mask is None else attention_mask[b]
        if mask_row is None and segment_ids is None:
            seqs = [np.arange(x.shape[1])]
        else:
            seqs = sequences(mask_row if mask_row is not None else np.ones(x.shape[1]),
                             None if segment_ids is None else segment_ids[b])
        state = None
        for idx in seqs:
            y[b, idx], state = _gdp_sequence(p, x[b, idx], cfg)
        states.append(state)
    return y, states


def rope(x, positions, theta):
    """fla's RotaryEmbedding (GPT-NeoX halves): x [L, N, Dh], positions [L]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2) / dim))
    freqs = positions[:, None] * inv_freq[None, :]
    cos, sin = np.cos(freqs)[:, None, :], np.sin(freqs)[:, None, :]
    x1, x2 = x[..., :dim // 2], x[..., dim // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _attention_sequence(p, x, cfg):
    length, hidden = x.shape
    n, g = cfg["num_heads"], cfg["num_kv_heads"]
    dh = hidden // n
    q = linear(x, p["q_proj.weight"], p.get("q_proj.bias")).reshape(length, n, dh)
    k = linear(x, p["k_proj.weight"], p.get("k_proj.bias")).reshape(length, g, dh)
    v = linear(x, p["v_proj.weight"], p.get("v_proj.bias")).reshape(length, g, dh)
    pos = np.arange(length, dtype=np.float64)        # flash-attn varlen: from each sequence start
    q, k = rope(q, pos, cfg["rope_theta"]), rope(k, pos, cfg["rope_theta"])
    o = np.zeros((length, n, dh))
    t = np.arange(length)
    allowed = t[None, :] <= t[:, None]
    if cfg.get("window_size") is not None:          # flash-attn window (w - 1, 0)
        allowed &= t[:, None] - t[None, :] <= cfg["window_size"] - 1
    for head in range(n):
        kv = head // (n // g)
        s = q[:, head] @ k[:, kv].T / np.sqrt(dh)
        s = np.where(allowed, s, -np.inf)
        w = np.exp(s - s.max(axis=1, keepdims=True))
        w = w / w.sum(axis=1, keepdims=True)
        o[:, head] = w @ v[:, kv]
    return linear(o.reshape(length, hidden), p["o_proj.weight"])


def attention_layer(p, x, cfg, attention_mask=None, segment_ids=None):
    """fla's Attention layer: x [B, T, D] -> y [B, T, D] (zeros at padding).
    cfg: num_heads, num_kv_heads, rope_theta, window_size."""
    y = np.zeros_like(x)
    for b in range(x.shape[0]):
        mask_row = np.ones(x.shape[1]) if attention_mask is None else attention_mask[b]
        for idx in sequences(mask_row, None if segment_ids is None else segment_ids[b]):
            y[b, idx] = _attention_sequence(p, x[b, idx], cfg)
    return y


def gated_mlp(p, x, act="swish", power=3.0):
    gate, up = linear(x, p["gate_proj.weight"]), linear(x, p["up_proj.weight"])
    if act == "swish":
        a = silu(gate)
    else:
        pos = gate > 0
        gp = np.where(pos, gate, 1.0)
        a = np.where(pos, gp ** (power / (np.sqrt(gp) + 1.0)), gate) * sigmoid(gate)
    return linear(a * up, p["down_proj.weight"])


def sub(params, prefix):
    """The entries of a state dict under ``prefix.``, with the prefix removed."""
    n = len(prefix) + 1
    return {k[n:]: v for k, v in params.items() if k.startswith(prefix + ".")}


def causal_lm(params, config: dict, input_ids, attention_mask=None):
    """fla's GatedDeltaProductForCausalLM forward: input_ids [B, T] -> logits [B, T, V] (float64).

    params: fla's state dict (float64 numpy); config: a config.json dict (fla's fields)."""
    c = config
    x = params["model.embeddings.weight"][np.asarray(input_ids)]
    eps = c["norm_eps"]
    attn_layers = {}
    if c.get("attn"):
        for spec in ([c["attn"]] if isinstance(c["attn"], dict) else c["attn"]):
            for i in spec["layers"]:
                attn_layers[i] = spec
    gdp_cfg = dict(num_heads=c["num_heads"], num_v_heads=c["num_heads"], head_dim=c["head_dim"],
                   head_v_dim=int(c["head_dim"] * c["expand_v"]),
                   num_householder=c["num_householder"], use_short_conv=c["use_short_conv"],
                   allow_neg_eigval=c["allow_neg_eigval"], use_forget_gate=c["use_forget_gate"],
                   use_output_gate=c["use_output_gate"], norm_eps=eps)
    for i in range(c["num_hidden_layers"]):
        lp = sub(params, f"model.layers.{i}")
        h = rms_norm(x, lp["attn_norm.weight"], eps)
        if i in attn_layers:
            spec = attn_layers[i]
            a = attention_layer(sub(lp, "attn"), h, dict(
                num_heads=spec["num_heads"],
                num_kv_heads=spec.get("num_kv_heads") or spec["num_heads"],
                rope_theta=spec.get("rope_theta", 10000.0), window_size=spec.get("window_size")),
                attention_mask)
        else:
            a, _ = gdp_layer(sub(lp, "attn"), h, gdp_cfg, attention_mask)
        x = x + a
        x = x + gated_mlp(sub(lp, "mlp"), rms_norm(x, lp["mlp_norm.weight"], eps),
                          c.get("hidden_act", "swish"))
    h = rms_norm(x, params["model.norm.weight"], eps)
    tied = c["tie_word_embeddings"]
    head = params["model.embeddings.weight" if tied else "lm_head.weight"]
    return h @ head.T
