"""Padding masks as segments: the token permutation shared by the layers and the causal LM.

fla drops the padding tokens of a ``[B, T]`` 0/1 ``attention_mask`` (``unpad_hidden_states``), runs
each row's remaining tokens as one sequence (``cu_seqlens``) and scatters zeros back at the padding
positions. Here the same is done without changing shapes: a stable permutation moves each row's
padding tokens to the front, in order, and its real tokens behind them, in order (a left-padded
layout); the padding then becomes a segment of its own, so nothing crosses from it into the real
tokens, and the real tokens' last segment ends the row, where the decode caches are read. Holes in
the mask (padding between real tokens) are dropped as fla drops them.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from gdp_jax._src.segments import segment_runs

__all__ = ["Compaction", "check_attention_mask", "compact_padding", "gather_tokens"]


class Compaction(NamedTuple):
    """How a padded batch was rearranged (all [B, T]).

    perm: int32, token ``perm[b, i]`` of the input sits at position i of the compacted row.
    inverse: int32, the compacted position of input token t (``inverse[b, perm[b, i]] == i``).
    mask: bool, True at the compacted row's real tokens (a suffix of each row).
    segment_ids: int32, 0 on the padding prefix and 1 + the run number of the real token's
      segment (runs of equal input segment ids among the real tokens) elsewhere.
    """
    perm: jax.Array
    inverse: jax.Array
    mask: jax.Array
    segment_ids: jax.Array


def check_attention_mask(attention_mask, batch: int, tokens: int) -> jax.Array:
    """attention_mask [B, T] of 0/1 (any int or bool dtype) -> bool [B, T]; ValueError/TypeError
    naming the argument otherwise."""
    mask = jnp.asarray(attention_mask)
    if mask.ndim != 2 or mask.shape != (batch, tokens):
        raise ValueError(f"attention_mask: expected shape [B, T] = {(batch, tokens)}, got "
                         f"{tuple(mask.shape)}")
    if not (jnp.issubdtype(mask.dtype, jnp.integer) or mask.dtype == jnp.bool_):
        raise TypeError(f"attention_mask: expected an integer or bool 0/1 array, got {mask.dtype}")
    return mask != 0


def compact_padding(mask: jax.Array, segment_ids: Optional[jax.Array] = None) -> Compaction:
    """mask [B, T] bool (True = real token), segment_ids [B, T] int or None -> Compaction.

    The padding prefix and the first real segment always get different ids, so the ops see a
    segment start there; a row without real tokens is all padding (one segment of id 0).
    """
    perm = jnp.argsort(mask.astype(jnp.int32), axis=1, stable=True).astype(jnp.int32)
    inverse = jnp.argsort(perm, axis=1).astype(jnp.int32)
    mask_c = jnp.take_along_axis(mask, perm, axis=1)
    if segment_ids is None:
        seg = mask_c.astype(jnp.int32)
    else:
        ids_c = jnp.take_along_axis(jnp.asarray(segment_ids), perm, axis=1)
        num_pad = jnp.sum(~mask_c, axis=1, keepdims=True)
        first_real = jnp.take_along_axis(ids_c, jnp.minimum(num_pad, mask.shape[1] - 1), axis=1)
        # the padding prefix takes the first real token's id, so runs count real-token starts only
        runs = segment_runs(jnp.where(mask_c, ids_c, first_real))
        seg = jnp.where(mask_c, runs + 1, 0).astype(jnp.int32)
    return Compaction(perm, inverse, mask_c, seg)


def gather_tokens(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [B, T, ...], index [B, T] int -> x[b, index[b, t], ...]."""
    idx = index.reshape(index.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)
