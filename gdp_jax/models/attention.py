"""Softmax attention with RoPE and grouped kv heads: fla's ``fla.layers.attn.Attention`` in Flax NNX.

The hybrid layers of a GatedDeltaProduct model (config ``attn``) are this layer. fla runs it
through flash-attn; here it is ``jax.nn.dot_product_attention`` with an explicit mask (causal,
same segment, optional sliding window), so it runs on any backend.

Names: B batch, T tokens, D hidden size, N query heads, G kv heads (num_kv_heads, dividing N),
Dh = D // N head dim, S cache length.

fla's semantics, and where this layer states them its own way:
- q = q_proj(x), k = k_proj(x), v = v_proj(x) (bias if qkv_bias), per head of Dh; query head n
  reads kv head n // (N / G) (flash-attn's grouping, also jax.nn.dot_product_attention's).
- RoPE over the whole head, GPT-NeoX halves (not interleaved), inv_freq = 1 / theta^(2i/Dh), the
  angle tables in float32 rounded to the activations' dtype, as fla's RotaryEmbedding.
  Positions count from 0 at each segment start (fla: from each cu_seqlens start; with
  padding, from each row's first real token); RoPE scores depend only on position differences,
  so any per-sequence offset gives the same attention. One difference: where an attention_mask
  has holes inside a row (padding between real tokens), positions here count real tokens only,
  while fla's rotary offsets column indices per row, so the distance across a hole differs.
  Left and right padding (what tokenizers and generate make) agree.
- softmax(q k^T / sqrt(Dh)) over the keys of the same segment at or before the query, and, with
  window_size w, at most w - 1 tokens before it (flash-attn's window (w - 1, 0)).
- o_proj(o) without bias.
Padding (``attention_mask``) is the model's business: it moves padding into a segment of its own
before calling this layer (``gdp_jax.layers.padding``).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from gdp_jax._src.segments import segment_runs

__all__ = ["Attention", "KVCache", "rope_tables", "apply_rope", "segment_positions"]


class KVCache(NamedTuple):
    """Decode cache of one attention layer (a pytree).

    k, v: [B, S, G, Dh] keys (after RoPE) and values, slot i holding the token decoded i-th
      (prefill tokens first).
    valid: [B, S] bool, the slots a new token may attend to (the row's last segment so far).
    position: [B] int32, the RoPE position of the next token.
    index: [] int32, the slot the next token is written to (the same for every row).
    """
    k: jax.Array
    v: jax.Array
    valid: jax.Array
    position: jax.Array
    index: jax.Array


def segment_positions(segment_ids: Optional[jax.Array], batch: int, tokens: int) -> jax.Array:
    """[B, T] int32: each token's index within its segment (0 at every segment start)."""
    t = jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (batch, tokens))
    if segment_ids is None:
        return t
    ids = jnp.asarray(segment_ids)
    starts = jnp.concatenate([jnp.ones((batch, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    return t - jax.lax.cummax(jnp.where(starts, t, 0), axis=1)


def rope_tables(positions: jax.Array, head_dim: int, theta: float, dtype):
    """positions [...] int -> (cos, sin) [..., Dh/2] in ``dtype`` (computed in float32)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(freqs).astype(dtype), jnp.sin(freqs).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, Dh], cos/sin [B, T, Dh/2] -> rotated x (GPT-NeoX halves), in float32 then x's
    dtype."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    c = cos.astype(jnp.float32)[..., None, :]
    s = sin.astype(jnp.float32)[..., None, :]
    x1, x2 = x32[..., :half], x32[..., half:]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """fla's softmax attention layer (RoPE, grouped kv heads, causal, segments), Flax NNX.

    Args:
      hidden_size: D (= N * Dh).
      num_heads: N query heads.
      num_kv_heads: G kv heads (default N); must divide N.
      qkv_bias: biases on q_proj, k_proj, v_proj.
      window_size: sliding window w (each token sees itself and w - 1 before it), or None.
      rope_theta: RoPE base.
      max_position_embeddings: kept for fla's signature (the RoPE tables are computed per call).
      dtype / param_dtype: computation and parameter dtypes.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: Optional[int] = None, *,
                 qkv_bias: bool = False, window_size: Optional[int] = None,
                 rope_theta: float = 10000.0, max_position_embeddings: Optional[int] = None,
                 dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or hidden_size % num_heads:
            raise ValueError(f"num_heads: expected a positive divisor of hidden_size="
                             f"{hidden_size}, got {num_heads}")
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads: expected a positive divisor of num_heads="
                             f"{num_heads}, got {num_kv_heads}")
        if window_size is not None and window_size <= 0:
            raise ValueError(f"window_size: expected a positive int or None, got {window_size}")
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        if self.head_dim % 2:
            raise ValueError(f"num_heads: head dim hidden_size // num_heads must be even (RoPE), "
                             f"got {self.head_dim}")
        self.kv_dim = num_kv_heads * self.head_dim
        self.qkv_bias, self.window_size = qkv_bias, window_size
        self.rope_theta = float(rope_theta)
        self.max_position_embeddings = max_position_embeddings
        lin = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = nnx.Linear(hidden_size, hidden_size, use_bias=qkv_bias, **lin)
        self.k_proj = nnx.Linear(hidden_size, self.kv_dim, use_bias=qkv_bias, **lin)
        self.v_proj = nnx.Linear(hidden_size, self.kv_dim, use_bias=qkv_bias, **lin)
        self.o_proj = nnx.Linear(hidden_size, hidden_size, use_bias=False, **lin)

    def _project(self, x: jax.Array, positions: jax.Array):
        """x [B, T, D], positions [B, T] -> q [B, T, N, Dh], k, v [B, T, G, Dh] (RoPE applied)."""
        batch, tokens, _ = x.shape
        q = self.q_proj(x).reshape(batch, tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(batch, tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, tokens, self.num_kv_heads, self.head_dim)
        cos, sin = rope_tables(positions, self.head_dim, self.rope_theta, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _attend(self, q, k, v, mask):
        """q [B, T, N, Dh], k/v [B, S, G, Dh], mask [B, T, S] bool -> o [B, T, N, Dh]."""
        v = v.astype(q.dtype)
        return jax.nn.dot_product_attention(q, k.astype(q.dtype), v, mask=mask[:, None],
                                            implementation="xla")

    def __call__(self, x: jax.Array, *, segment_ids: Optional[jax.Array] = None,
                 return_cache: bool = False, cache_length: Optional[int] = None):
        """x [B, T, D] -> y [B, T, D] (and a KVCache of S = cache_length slots, if return_cache).

        segment_ids [B, T] int (optional): tokens attend only within their segment; the cache
        keeps each row's last segment (its slots valid, the rest not).
        """
        batch, tokens, _ = x.shape
        positions = segment_positions(segment_ids, batch, tokens)
        q, k, v = self._project(x, positions)
        t = jnp.arange(tokens)
        mask = t[None, :] <= t[:, None]                                    # [T, S] causal
        if self.window_size is not None:
            mask &= t[:, None] - t[None, :] < self.window_size
        mask = jnp.broadcast_to(mask, (batch, tokens, tokens))
        runs = None
        if segment_ids is not None:
            runs = segment_runs(jnp.asarray(segment_ids))
            mask &= runs[:, :, None] == runs[:, None, :]
        o = self._attend(q, k, v, mask)
        y = self.o_proj(o.reshape(batch, tokens, self.hidden_size))
        if not return_cache:
            return y
        length = tokens if cache_length is None else cache_length
        if length < tokens:
            raise ValueError(f"cache_length: expected at least T = {tokens}, got {length}")
        pad = ((0, 0), (0, length - tokens), (0, 0), (0, 0))
        valid = jnp.ones((batch, tokens), bool) if runs is None else runs == runs[:, -1:]
        valid = jnp.pad(valid, ((0, 0), (0, length - tokens)))
        cache = KVCache(jnp.pad(k, pad), jnp.pad(v, pad), valid,
                        positions[:, -1] + 1, jnp.asarray(tokens, jnp.int32))
        return y, cache

    def init_cache(self, batch: int, length: int, dtype=jnp.float32) -> KVCache:
        """An empty cache of ``length`` slots for a fresh sequence."""
        shape = (batch, length, self.num_kv_heads, self.head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                       jnp.zeros((batch, length), bool), jnp.zeros((batch,), jnp.int32),
                       jnp.zeros((), jnp.int32))

    def step(self, x_t: jax.Array, cache: KVCache):
        """One token: x_t [B, D], cache -> (y_t [B, D], new cache); matches ``__call__`` token by
        token. The cache must have a free slot (index < S)."""
        batch = x_t.shape[0]
        q, k, v = self._project(x_t[:, None], cache.position[:, None])
        idx = cache.index
        k_cache = jax.lax.dynamic_update_slice_in_dim(cache.k, k.astype(cache.k.dtype), idx, 1)
        v_cache = jax.lax.dynamic_update_slice_in_dim(cache.v, v.astype(cache.v.dtype), idx, 1)
        valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, jnp.ones((batch, 1), bool),
                                                    idx, 1)
        mask = valid
        if self.window_size is not None:
            slots = jnp.arange(valid.shape[1])
            mask = mask & (idx - slots < self.window_size)[None, :]
        o = self._attend(q, k_cache, v_cache, mask[:, None, :])
        y = self.o_proj(o.reshape(batch, self.hidden_size))
        return y, KVCache(k_cache, v_cache, valid, cache.position + 1, idx + 1)
