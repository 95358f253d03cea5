"""GatedDeltaProductForCausalLM: fla's GatedDeltaProduct causal LM in Flax NNX (needs ``flax``).

Structure, parameter for parameter (fla 0.6.0, ``fla/models/gated_deltaproduct``):

    embeddings [vocab, D]
    layers[i]:  x = x + attn(attn_norm(x));  x = x + mlp(mlp_norm(x))
        attn: gdp_jax.layers.GatedDeltaProduct (fla's layer, built from the config as fla's
              block builds it: num_v_heads = num_heads, no conv bias, norm_eps = config.norm_eps,
              SiLU on q, k, v when use_short_conv=False),
              or, at the layers ``config.attn`` lists, gdp_jax.models.attention.Attention
        mlp:  down_proj(silu(gate_proj(x)) * up_proj(x))  (SwiGLU; 'powlu' as fla's GatedMLP)
        attn_norm, mlp_norm: RMSNorm(D, eps = norm_eps)
    norm: RMSNorm(D)
    lm_head [D, vocab], or the embedding matrix when tie_word_embeddings

Our parameter paths mirror fla's names (``gdp_jax.models.convert`` maps one to the other).

Padding: ``attention_mask`` [B, T] (1 = token, 0 = padding) works as in fla: padding tokens are
dropped from every token mixer (each row's real tokens form one sequence; the mixers output zero
at padding positions), so a padded row gives its real tokens the logits it gives them unpadded.
It is done once per forward: a stable permutation moves each row's padding in front of its real
tokens (``gdp_jax.layers.padding``), the stack runs on that layout with the padding as a segment
of its own, and the outputs are permuted back. ``segment_ids`` pack several sequences in a row.

Decoding: ``prefill`` returns the last position's logits and an ``LMCache`` (one GDPCache or
KVCache per layer); ``step`` consumes one token per row. ``gdp_jax.models.generate`` loops them
under jit.

Names: B batch, T tokens, D hidden size, V vocabulary size, S cache length.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
from flax import nnx

from gdp_jax.layers.gated_delta_product import GatedDeltaProduct, GDPCache
from gdp_jax.layers.padding import check_attention_mask, compact_padding, gather_tokens
from gdp_jax.models.attention import Attention, KVCache
from gdp_jax.models.configuration import GatedDeltaProductConfig

__all__ = ["Block", "GatedDeltaProductForCausalLM", "GatedDeltaProductModel", "GatedMLP",
           "LMCache", "init_model"]

LayerCache = Union[GDPCache, KVCache]
LMCache = Tuple[LayerCache, ...]
"""The causal LM's decode cache: one GDPCache (GatedDeltaProduct layer) or KVCache (attention
layer) per layer, in layer order (a tuple, so a pytree)."""

POWGLU_POWER = 3.0  # fla's GatedMLP default (not a config field)


class GatedMLP(nnx.Module):
    """fla's GatedMLP: x [..., D] -> down_proj(act(gate_proj(x)) * up_proj(x)) [..., D].

    act is silu ('swish') or fla's 'powlu' (x^(p / (sqrt(x) + 1)) * sigmoid(x) for x > 0, else
    x * sigmoid(x), p = 3). The gating runs in float32 and is rounded to the activations' dtype
    before down_proj, as fla's fused kernels do.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "swish", *,
                 dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if hidden_act not in ("swish", "powlu"):
            raise ValueError(f"hidden_act: expected 'swish' or 'powlu', got {hidden_act!r}")
        self.hidden_act = hidden_act
        lin = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(hidden_size, intermediate_size, **lin)
        self.up_proj = nnx.Linear(hidden_size, intermediate_size, **lin)
        self.down_proj = nnx.Linear(intermediate_size, hidden_size, **lin)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = self.gate_proj(x), self.up_proj(x)
        g = gate.astype(jnp.float32)
        if self.hidden_act == "swish":
            act = jax.nn.silu(g)
        else:
            pos = g > 0
            gp = jnp.where(pos, g, 1.0)
            power = jnp.exp(POWGLU_POWER / (jnp.sqrt(gp) + 1.0) * jnp.log(gp))
            act = jnp.where(pos, power, g) * jax.nn.sigmoid(g)
        return self.down_proj((act * up.astype(jnp.float32)).astype(up.dtype))


class Block(nnx.Module):
    """One pre-norm block: x [B, T, D] -> x + attn(attn_norm(x)), then + mlp(mlp_norm(.))."""

    def __init__(self, config: GatedDeltaProductConfig, layer_idx: int, *, dtype=None,
                 param_dtype=jnp.float32, chunk_size: int = 64,
                 implementation: Optional[str] = None, rngs: nnx.Rngs):
        d = config.hidden_size
        norm = dict(epsilon=config.norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.layer_idx = layer_idx
        self.attn_norm = nnx.RMSNorm(d, **norm)
        spec = config.attention_spec(layer_idx)
        self.is_attention = spec is not None
        if spec is not None:
            self.attn = Attention(d, spec["num_heads"], spec["num_kv_heads"],
                                  qkv_bias=spec["qkv_bias"], window_size=spec["window_size"],
                                  rope_theta=spec["rope_theta"],
                                  max_position_embeddings=config.max_position_embeddings,
                                  dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        else:
            self.attn = GatedDeltaProduct(
                d, num_heads=config.num_heads, head_dim=config.head_dim,
                expand_v=config.expand_v, num_householder=config.num_householder,
                use_forget_gate=config.use_forget_gate, allow_neg_eigval=config.allow_neg_eigval,
                use_short_conv=config.use_short_conv, conv_size=config.conv_size,
                no_conv_activation="silu", use_output_gate=config.use_output_gate,
                norm_eps=config.norm_eps,
                chunk_size=chunk_size, implementation=implementation, dtype=dtype,
                param_dtype=param_dtype, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d, **norm)
        self.mlp = GatedMLP(d, config.resolved_intermediate_size, config.hidden_act,
                            dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def _residual(self, x, mixed, keep):
        if keep is not None:
            mixed = jnp.where(keep[..., None], mixed, jnp.zeros((), mixed.dtype))
        x = x + mixed.astype(x.dtype)
        return x + self.mlp(self.mlp_norm(x)).astype(x.dtype)

    def __call__(self, x: jax.Array, *, segment_ids: Optional[jax.Array] = None,
                 keep: Optional[jax.Array] = None, return_cache: bool = False,
                 cache_length: Optional[int] = None):
        """x [B, T, D] -> x [B, T, D] (and the layer's cache). keep [B, T] bool: where False
        (padding) the token mixer's output is replaced by zero, as fla's repadding does."""
        h = self.attn_norm(x)
        if self.is_attention:
            out = self.attn(h, segment_ids=segment_ids, return_cache=return_cache,
                            cache_length=cache_length)
        else:
            out = self.attn(h, segment_ids=segment_ids, return_cache=return_cache)
        mixed, cache = out if return_cache else (out, None)
        x = self._residual(x, mixed, keep)
        return (x, cache) if return_cache else x

    def init_cache(self, batch: int, cache_length: int, dtype) -> LayerCache:
        if self.is_attention:
            return self.attn.init_cache(batch, cache_length, dtype)
        return self.attn.init_cache(batch, dtype)

    def step(self, x_t: jax.Array, cache: LayerCache):
        """x_t [B, D] -> (x_t [B, D], new cache)."""
        mixed, cache = self.attn.step(self.attn_norm(x_t), cache)
        return self._residual(x_t, mixed, None), cache


class GatedDeltaProductModel(nnx.Module):
    """fla's GatedDeltaProductModel: embeddings, blocks, final norm (no head)."""

    def __init__(self, config: GatedDeltaProductConfig, *, dtype=None, param_dtype=jnp.float32,
                 chunk_size: int = 64, implementation: Optional[str] = None, rngs: nnx.Rngs):
        self.pad_token_id = config.pad_token_id
        self.embeddings = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                    param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([
            Block(config, i, dtype=dtype, param_dtype=param_dtype, chunk_size=chunk_size,
                  implementation=implementation, rngs=rngs)
            for i in range(config.num_hidden_layers)])
        self.norm = nnx.RMSNorm(config.hidden_size, epsilon=config.norm_eps, dtype=dtype,
                                param_dtype=param_dtype, rngs=rngs)

    def embed(self, input_ids: jax.Array) -> jax.Array:
        """input_ids [...] int -> [..., D]. As torch's ``padding_idx``, the row of
        ``pad_token_id`` gets no gradient."""
        x = self.embeddings(input_ids)
        if self.pad_token_id is not None:
            x = jnp.where((input_ids == self.pad_token_id)[..., None], jax.lax.stop_gradient(x), x)
        return x


class GatedDeltaProductForCausalLM(nnx.Module):
    """fla's GatedDeltaProductForCausalLM in Flax NNX (see the module docstring).

    Args:
      config: a GatedDeltaProductConfig (fla's fields).
      dtype: computation dtype (None: the parameters'); param_dtype: parameter dtype.
      chunk_size, implementation: passed to every GatedDeltaProduct layer
        (``implementation=None``: Pallas on GPU, jnp elsewhere).
      rngs: parameter init, as fla's ``_init_weights``: every linear, convolution and embedding
        weight ~ N(0, initializer_range), biases 0, norms 1; A_log and dt_bias as the layer's.

    Load fla checkpoints with ``GatedDeltaProductForCausalLM.from_pretrained(directory)`` and
    write them with ``model.save_pretrained(directory)`` (``gdp_jax.models.convert``).
    """

    def __init__(self, config: GatedDeltaProductConfig, *, dtype=None, param_dtype=jnp.float32,
                 chunk_size: int = 64, implementation: Optional[str] = None, rngs: nnx.Rngs):
        if not isinstance(config, GatedDeltaProductConfig):
            raise TypeError(f"config: expected a GatedDeltaProductConfig, got "
                            f"{type(config).__name__}")
        self.config = config
        self.model = GatedDeltaProductModel(config, dtype=dtype, param_dtype=param_dtype,
                                            chunk_size=chunk_size, implementation=implementation,
                                            rngs=rngs)
        self.lm_head = None if config.tie_word_embeddings else nnx.Linear(
            config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype,
            param_dtype=param_dtype, rngs=rngs)
        self._fla_init(rngs)

    def _fla_init(self, rngs: nnx.Rngs) -> None:
        std = self.config.initializer_range
        for path, var in nnx.to_flat_state(nnx.state(self, nnx.Param)):
            name = path[-1]
            value = var.get_value()
            if name in ("kernel", "embedding"):
                new = std * jax.random.normal(rngs.params(), value.shape, jnp.float32)
            elif name == "bias":
                new = jnp.zeros(value.shape, jnp.float32)
            else:
                continue
            var.set_value(new.astype(value.dtype))

    # -- helpers -------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def logits(self, h: jax.Array) -> jax.Array:
        """h [..., D] (after the final norm) -> logits [..., V] in the computation dtype."""
        if self.lm_head is None:
            return self.model.embeddings.attend(h)
        return self.lm_head(h)

    def _check_inputs(self, input_ids, attention_mask, segment_ids):
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise ValueError(f"input_ids: expected an int array [B, T], got "
                             f"{input_ids.dtype}{list(input_ids.shape)}")
        batch, tokens = input_ids.shape
        mask = None
        if attention_mask is not None:
            mask = check_attention_mask(attention_mask, batch, tokens)
        if segment_ids is not None:
            segment_ids = jnp.asarray(segment_ids)
            if segment_ids.shape != (batch, tokens) or not jnp.issubdtype(segment_ids.dtype,
                                                                          jnp.integer):
                raise ValueError(f"segment_ids: expected an int array [B, T] = "
                                 f"{[batch, tokens]}, got {segment_ids.dtype}"
                                 f"{list(segment_ids.shape)}")
        return input_ids, mask, segment_ids

    def _run(self, input_ids, segment_ids, keep, return_cache, cache_length):
        """The stack on an unpadded (or compacted) layout -> final-normed h [B, T, D] (and an
        LMCache)."""
        x = self.model.embed(input_ids)
        caches = []
        for layer in self.model.layers:
            out = layer(x, segment_ids=segment_ids, keep=keep, return_cache=return_cache,
                        cache_length=cache_length)
            if return_cache:
                x, c = out
                caches.append(c)
            else:
                x = out
        h = self.model.norm(x)
        return (h, tuple(caches)) if return_cache else h

    # -- full sequence -------------------------------------------------------------------------

    def hidden_states(self, input_ids: jax.Array, *, attention_mask: Optional[jax.Array] = None,
                      segment_ids: Optional[jax.Array] = None) -> jax.Array:
        """input_ids [B, T] int -> the final norm's output [B, T, D]."""
        input_ids, mask, segment_ids = self._check_inputs(input_ids, attention_mask, segment_ids)
        if mask is None:
            return self._run(input_ids, segment_ids, None, False, None)
        comp = compact_padding(mask, segment_ids)
        h = self._run(jnp.take_along_axis(input_ids, comp.perm, axis=1), comp.segment_ids,
                      comp.mask, False, None)
        return gather_tokens(h, comp.inverse)

    def __call__(self, input_ids: jax.Array, *, attention_mask: Optional[jax.Array] = None,
                 segment_ids: Optional[jax.Array] = None) -> jax.Array:
        """input_ids [B, T] int -> logits [B, T, V] (computation dtype).

        attention_mask [B, T] 0/1 (optional): padding, as fla (see the module docstring).
        segment_ids [B, T] int (optional): packed sequences; no token mixer crosses a segment
        start (the attention layers' RoPE positions restart there too).
        """
        return self.logits(self.hidden_states(input_ids, attention_mask=attention_mask,
                                              segment_ids=segment_ids))

    # -- decoding ------------------------------------------------------------------------------

    def prefill(self, input_ids: jax.Array, *, attention_mask: Optional[jax.Array] = None,
                segment_ids: Optional[jax.Array] = None, cache_length: Optional[int] = None):
        """Run a prompt: input_ids [B, T] -> (logits [B, V] of each row's last real token,
        LMCache ready for ``step``).

        cache_length: S, the attention layers' KV slots (T + the tokens to decode; default T;
        ignored without attention layers). Rows may be padded anywhere (attention_mask); the
        cache holds each row's last segment of real tokens.
        """
        input_ids, mask, segment_ids = self._check_inputs(input_ids, attention_mask, segment_ids)
        tokens = input_ids.shape[1]
        length = tokens if cache_length is None else int(cache_length)
        if length < tokens:
            raise ValueError(f"cache_length: expected at least T = {tokens}, got {length}")
        keep = None
        if mask is not None:
            comp = compact_padding(mask, segment_ids)
            input_ids = jnp.take_along_axis(input_ids, comp.perm, axis=1)
            segment_ids, keep = comp.segment_ids, comp.mask
        h, cache = self._run(input_ids, segment_ids, keep, True, length)
        if mask is not None:
            has_real = jnp.any(mask, axis=1)
            cache = tuple(_zero_rows(c, has_real) if isinstance(c, GDPCache) else c
                          for c in cache)
        return self.logits(h[:, -1]), cache

    def init_cache(self, batch: int, cache_length: int, dtype=None) -> LMCache:
        """A fresh LMCache (nothing seen): GDP states zero, S = cache_length empty KV slots.
        dtype: of the conv and KV caches (default the embedding's computation dtype)."""
        if dtype is None:
            dtype = self.model.embeddings.dtype or self.model.embeddings.embedding.get_value().dtype
        return tuple(layer.init_cache(batch, cache_length, dtype) for layer in self.model.layers)

    def step(self, tokens: jax.Array, cache: LMCache):
        """One token per row: tokens [B] int, cache -> (logits [B, V], new cache)."""
        x = self.model.embed(tokens)
        new = []
        for layer, c in zip(self.model.layers, cache):
            x, c = layer.step(x, c)
            new.append(c)
        return self.logits(self.model.norm(x)), tuple(new)

    # -- checkpoints ---------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, directory, **kwargs) -> "GatedDeltaProductForCausalLM":
        """``gdp_jax.models.convert.from_pretrained``: a fla checkpoint directory -> model."""
        from gdp_jax.models.convert import from_pretrained
        return from_pretrained(directory, **kwargs)

    def save_pretrained(self, directory, **kwargs) -> None:
        """``gdp_jax.models.convert.save_pretrained``: write config.json + model.safetensors in
        fla's names, for fla's ``from_pretrained``."""
        from gdp_jax.models.convert import save_pretrained
        save_pretrained(self, directory, **kwargs)


def _zero_rows(cache: GDPCache, keep_rows: jax.Array) -> GDPCache:
    """Zero every array of a GDPCache in the rows where keep_rows [B] is False."""
    def f(c):
        if c is None:
            return None
        return jnp.where(keep_rows.reshape((-1,) + (1,) * (c.ndim - 1)), c, jnp.zeros((), c.dtype))
    return GDPCache(*(f(c) for c in cache))


def init_model(config: GatedDeltaProductConfig, *, seed: int = 0, **kwargs
               ) -> GatedDeltaProductForCausalLM:
    """A randomly initialised model (fla's init, see the class), built under one ``nnx.jit``:
    one compiled program instead of one dispatch per parameter (seconds faster on a CPU).
    kwargs: dtype, param_dtype, chunk_size, implementation."""
    return nnx.jit(lambda: GatedDeltaProductForCausalLM(config, rngs=nnx.Rngs(seed), **kwargs))()
