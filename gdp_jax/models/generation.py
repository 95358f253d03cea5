"""generate: prefill with the chunked op, then a jitted decode loop (``lax.while_loop``) over the cache.

    out = generate(model, input_ids, max_new_tokens=32)                       # greedy
    out = generate(model, [[5, 6, 7], [8, 9]], 32, temperature=0.8, top_k=40, rng=0)
    out.tokens        # [B, N] new tokens, pad_token_id after a row's eos
    out.sequences     # [B, T + N] = concat(prompt (padded), tokens), as Hugging Face returns
    out.lengths       # [B] new tokens up to and including eos (N where none came)

As Hugging Face's ``generate`` (which fla uses): greedy takes the first maximal logit (argmax);
sampling divides the logits by ``temperature``, keeps those at least the k-th largest (top_k)
and draws from the softmax; a row that produced an eos token continues with pad_token_id; the
loop stops when every row has, or after max_new_tokens. Prompts of different lengths come as a
list of token lists (left-padded here) or as a padded array with ``attention_mask`` (padding
anywhere; each row's real tokens form its prompt).

Two compiled programs per shape: the prefill (``model.prefill``: the chunked op over the prompt,
the first token) and the decode loop (``model.step`` per token inside ``lax.while_loop``; the
model's parameters and cache stay on the device, no Python per token).

The model's structure (``nnx.split``'s graph traversal, tens of milliseconds for a 12-layer
model) is read once per model and kept while the model lives; each call re-reads the values of
the same Variables, so training between calls is seen, and a call that finds a Variable
replaced (a submodule swapped, new weights assigned as new Variables) splits again. Static
attributes (a layer's ``implementation``, ``chunk_size``) are read with the split: after changing
one in place, pass ``nnx.clone(model)``. Models of one structure (same config, dtypes and shapes)
share the compiled programs.
"""
from __future__ import annotations

import functools
import weakref
from typing import NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdp_jax.models.modeling import GatedDeltaProductForCausalLM

__all__ = ["GenerateOutput", "generate", "pad_prompts", "sample_logits"]


class _FromConfig:
    def __repr__(self):
        return "FROM_CONFIG"


FROM_CONFIG = _FromConfig()
"""Default of eos_token_id / pad_token_id: take the model config's value."""


class GenerateOutput(NamedTuple):
    """tokens [B, N] int32 (pad_token_id after eos); sequences [B, T + N] int32 (the prompt as
    given, padding included, then tokens); lengths [B] int32 (tokens up to and including eos)."""
    tokens: jax.Array
    sequences: jax.Array
    lengths: jax.Array


def pad_prompts(prompts: Sequence[Sequence[int]], pad_token_id: int = 0):
    """Token lists of different lengths -> (input_ids [B, T] int32 left-padded, attention_mask
    [B, T] int32), T the longest prompt."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("input_ids: expected a non-empty list of non-empty token lists")
    tokens = max(len(p) for p in prompts)
    ids = np.full((len(prompts), tokens), pad_token_id, np.int32)
    mask = np.zeros((len(prompts), tokens), np.int32)
    for i, p in enumerate(prompts):
        ids[i, tokens - len(p):] = np.asarray(p, np.int32)
        mask[i, tokens - len(p):] = 1
    return ids, mask


def sample_logits(logits: jax.Array, key: Optional[jax.Array], *, greedy: bool,
                  temperature=1.0, top_k: Optional[int] = None) -> jax.Array:
    """logits [B, V] -> tokens [B] int32: argmax if greedy, else a draw from
    softmax(logits / temperature) restricted to the top_k largest (ties at the k-th kept)."""
    logits = logits.astype(jnp.float32)
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class _Structure:
    """A model's graphdef and its state's treedef: jit's static argument. One instance per
    distinct structure (``_structure``), hashed by identity, so that jit's cache lookup does not
    hash the graphdef on every call and models of one architecture share compiled programs."""
    __slots__ = ("graphdef", "treedef")

    def __init__(self, graphdef, treedef):
        self.graphdef, self.treedef = graphdef, treedef

    def merge(self, leaves):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))


_STRUCTURES: dict = {}


def _structure(graphdef, treedef) -> _Structure:
    key = (graphdef, treedef)
    if key not in _STRUCTURES:
        _STRUCTURES[key] = _Structure(graphdef, treedef)
    return _STRUCTURES[key]


class _Split:
    """One model's nnx.split: its _Structure and the live Variables behind the state's leaves
    (in leaf order, with their paths)."""
    __slots__ = ("structure", "paths", "variables")

    def __init__(self, model):
        graphdef, state = nnx.split(model)
        self.paths = [path for path, _ in nnx.to_flat_state(state)]
        _, treedef = jax.tree.flatten(state)
        self.structure = _structure(graphdef, treedef)
        self.variables = [_lookup(model, path) for path in self.paths]
        if len(self.variables) != treedef.num_leaves:     # one array per Variable
            raise AssertionError("generate: a Variable with other than one array leaf")

    def leaves(self, model) -> Optional[list]:
        """The current values of the model's Variables, or None if any is no longer the one
        cached (the model's structure changed)."""
        out = []
        for path, cached in zip(self.paths, self.variables):
            try:
                live = _lookup(model, path)
            except (AttributeError, KeyError, IndexError, TypeError):
                return None
            if live is not cached:
                return None
            value = live.get_raw_value()   # get_value's checks cost ~6 us a Variable
            out.append(value if isinstance(value, (jax.Array, np.ndarray)) else live.get_value())
        return out


def _lookup(node, path):
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


_SPLITS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _split(model) -> tuple:
    """(_Structure, leaves) for model, reusing the split cached for it while its Variables are
    the same objects."""
    entry = _SPLITS.get(model)
    leaves = None if entry is None else entry.leaves(model)
    if leaves is None:
        entry = _Split(model)
        _SPLITS[model] = entry
        leaves = entry.leaves(model)
    return entry.structure, leaves


def _is_eos(tokens, eos: jax.Array):
    """tokens [B], eos [E] int32 (-1 entries match nothing) -> [B] bool."""
    return jnp.any(tokens[:, None] == eos[None, :], axis=1)


@functools.partial(jax.jit, static_argnames=("structure", "cache_length", "greedy", "top_k"))
def _prefill(structure, leaves, input_ids, attention_mask, key, temperature, eos, *, cache_length,
             greedy, top_k):
    model = structure.merge(leaves)
    logits, cache = model.prefill(input_ids, attention_mask=attention_mask,
                                  cache_length=cache_length)
    key, sub = jax.random.split(key)
    first = sample_logits(logits, sub, greedy=greedy, temperature=temperature, top_k=top_k)
    return first, cache, _is_eos(first, eos), key


@functools.partial(jax.jit, static_argnames=("structure", "max_new_tokens", "greedy", "top_k"))
def _decode(structure, leaves, first, cache, done, key, temperature, pad, eos, *, max_new_tokens,
            greedy, top_k):
    model = structure.merge(leaves)
    batch = first.shape[0]
    out = jnp.full((batch, max_new_tokens), pad, jnp.int32).at[:, 0].set(first)

    def cond(carry):
        i, _, _, done, _, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, tok, cache, done, key, out = carry
        logits, cache = model.step(tok, cache)
        key, sub = jax.random.split(key)
        nxt = sample_logits(logits, sub, greedy=greedy, temperature=temperature, top_k=top_k)
        nxt = jnp.where(done, pad, nxt)
        out = jax.lax.dynamic_update_slice_in_dim(out, nxt[:, None], i, axis=1)
        return i + 1, nxt, cache, done | _is_eos(nxt, eos), key, out

    carry = (jnp.asarray(1, jnp.int32), first, cache, done, key, out)
    return jax.lax.while_loop(cond, body, carry)[-1]


def _eos_tuple(value) -> tuple:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        ids = tuple(value)
    else:
        ids = (value,)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"eos_token_id: expected an int, a list of ints or None, got {value!r}")
        if i < 0:
            raise ValueError(f"eos_token_id: expected token ids >= 0, got {value!r}")
    return tuple(int(i) for i in ids)


def generate(model: GatedDeltaProductForCausalLM,
             input_ids: Union[jax.Array, np.ndarray, Sequence[Sequence[int]]],
             max_new_tokens: int, *, attention_mask: Optional[jax.Array] = None,
             eos_token_id=FROM_CONFIG, pad_token_id=FROM_CONFIG, temperature: float = 0.0,
             top_k: Optional[int] = None, rng: Union[None, int, jax.Array] = None,
             ) -> GenerateOutput:
    """Generate max_new_tokens tokens after each prompt (see the module docstring).

    Args:
      model: a GatedDeltaProductForCausalLM.
      input_ids: [B, T] int array (with attention_mask for padding) or a list of B token lists
        (left-padded with pad_token_id here).
      max_new_tokens: N >= 1.
      attention_mask: [B, T] 0/1, only with an array input_ids.
      eos_token_id: int, list of ints or None (never stop); default the config's.
      pad_token_id: the token after eos; default the config's, else the first eos, else 0.
      temperature: 0 (default) for greedy decoding, > 0 to sample.
      top_k: sample among the k largest logits (None: all); needs temperature > 0.
      rng: a jax PRNG key or an int seed, required when sampling.

    Returns:
      GenerateOutput(tokens [B, N], sequences [B, T + N], lengths [B]), int32.
    """
    if not isinstance(model, GatedDeltaProductForCausalLM):
        raise TypeError(f"model: expected a GatedDeltaProductForCausalLM, got "
                        f"{type(model).__name__}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)
    config = model.config
    eos = _eos_tuple(config.eos_token_id if eos_token_id is FROM_CONFIG else eos_token_id)
    if pad_token_id is FROM_CONFIG:
        pad_token_id = config.pad_token_id
        if pad_token_id is None:
            pad_token_id = eos[0] if eos else 0
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, (int, np.integer)):
        raise TypeError(f"pad_token_id: expected an int, got {pad_token_id!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or temperature < 0:
        raise ValueError(f"temperature: expected a number >= 0, got {temperature!r}")
    greedy = temperature == 0
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
            raise ValueError(f"top_k: expected an int >= 1 or None, got {top_k!r}")
        if greedy:
            raise ValueError("top_k: needs temperature > 0 (temperature=0 is greedy decoding)")
        top_k = min(int(top_k), config.vocab_size)
    if greedy:
        key = jax.random.key(0)
    elif rng is None:
        raise ValueError("rng: sampling (temperature > 0) needs a PRNG key or an int seed")
    elif isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        key = jax.random.key(int(rng))
    else:
        key = rng

    if isinstance(input_ids, (list, tuple)):
        if attention_mask is not None:
            raise ValueError("attention_mask: give it only with an array input_ids (a list of "
                             "prompts is padded here)")
        input_ids, attention_mask = pad_prompts(input_ids, int(pad_token_id))
    input_ids = jnp.asarray(input_ids)
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"input_ids: expected an int array [B, T] or a list of token lists, got "
                         f"{input_ids.dtype}{list(input_ids.shape)}")
    input_ids = input_ids.astype(jnp.int32)
    if attention_mask is not None:
        attention_mask = jnp.asarray(attention_mask)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask: expected shape {list(input_ids.shape)}, got "
                             f"{list(attention_mask.shape)}")
        attention_mask = attention_mask.astype(jnp.int32)

    structure, leaves = _split(model)
    tokens_in = input_ids.shape[1]
    temp = jnp.asarray(1.0 if greedy else temperature, jnp.float32)
    eos_ids = jnp.asarray(eos if eos else (-1,), jnp.int32)   # -1 matches no token
    first, cache, done, key = _prefill(
        structure, leaves, input_ids, attention_mask, key, temp, eos_ids,
        cache_length=tokens_in + max_new_tokens, greedy=greedy, top_k=top_k)
    if max_new_tokens == 1:
        tokens = first[:, None]
    else:
        tokens = _decode(structure, leaves, first, cache, done, key, temp,
                         jnp.asarray(pad_token_id, jnp.int32), eos_ids,
                         max_new_tokens=max_new_tokens, greedy=greedy, top_k=top_k)
    is_eos = jnp.any(tokens[..., None] == eos_ids, axis=-1)
    lengths = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, max_new_tokens)
    return GenerateOutput(tokens, jnp.concatenate([input_ids, tokens], axis=1),
                          lengths.astype(jnp.int32))
