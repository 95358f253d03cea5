"""Array layouts shared by the stages: chunk views, tile widths, padding, l2norm.

P below is the number of stream positions per token: 1 on the token stream, M on the expanded
stream. Padding of a last partial chunk is zeros (``mode="constant"``) or a repeat of the last real
token (``mode="edge"``: for decays and segment run numbers, so padding neither decays nor resets).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

L2NORM_EPS = 1e-6


def to_chunks(x: jax.Array, chunk_size: int, per_token: int = 1, *, mode: str = "constant") -> jax.Array:
    """[B, T*P, H, ...] -> [B, NT, H, BT*P, ...]; [B, T] (no head axis) -> [B, NT, BT*P]."""
    batch, positions = x.shape[:2]
    tokens = positions // per_token
    num_chunks = -(-tokens // chunk_size)
    pad = (num_chunks * chunk_size - tokens) * per_token
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), mode=mode)
    x = x.reshape((batch, num_chunks, chunk_size * per_token) + x.shape[2:])
    return jnp.moveaxis(x, 3, 2) if x.ndim >= 4 else x


def from_chunks(x: jax.Array, positions: int) -> jax.Array:
    """[B, NT, H, BT*P, ...] -> [B, T*P, H, ...] cut to ``positions`` = T*P."""
    x = jnp.moveaxis(x, 2, 3)
    x = x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])
    return x[:, :positions]


def expand(x: jax.Array, per_token: int, axis: int) -> jax.Array:
    """Repeats each token's entry ``per_token`` times along ``axis`` (token -> expanded stream)."""
    return jnp.repeat(x, per_token, axis=axis) if per_token > 1 else x


def chunk_decays(g: Optional[jax.Array], runs: Optional[jax.Array], batch: int, tokens: int,
                 heads: int, chunk_size: int):
    """Per-chunk float32 decays [B, NT, H, BT] and int32 run numbers [B, NT, BT] of the jnp stages
    (padding repeats the last real token: it neither decays nor starts a segment). None -> zeros."""
    g = jnp.zeros((batch, tokens, heads), jnp.float32) if g is None else g.astype(jnp.float32)
    runs = jnp.zeros((batch, tokens), jnp.int32) if runs is None else runs.astype(jnp.int32)
    return to_chunks(g, chunk_size, mode="edge"), to_chunks(runs, chunk_size, mode="edge")


def tile_width(n: int) -> int:
    """The width the Pallas kernels give a K or V axis of size n: the next power of two, at least
    16 (Triton's dot tile rule); the padding is zeros, which change no dot product."""
    return max(16, 1 << (n - 1).bit_length())


def pad_last(x: jax.Array, width: int) -> jax.Array:
    """Zero-pads the last axis to ``width``."""
    extra = width - x.shape[-1]
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)]) if extra else x


def pad_state(x: jax.Array, key_width: int, value_width: int) -> jax.Array:
    """Zero-pads a [..., K, V] state to [..., key_width, value_width]."""
    extra = (key_width - x.shape[-2], value_width - x.shape[-1])
    return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, extra[0]), (0, extra[1])]) if any(extra) else x


def chunk_state_index(h_ndim: int, batch, chunk, head) -> tuple:
    """The leading index of one chunk's state where the chunk_o kernels read h: h [B, NT, H, K, V]
    as given, or the [B, NT, S, H, K, V] view of the states before every sub-chunk (S a chunk,
    the first the chunk's own: index 0 of S). Both are read in place; h is never reshaped into
    the other form, which would copy it outside jit."""
    return (batch, chunk, head) if h_ndim == 5 else (batch, chunk, 0, head)


def compact_state_shape(h: jax.Array) -> tuple:
    """(B, NT, H, K, V) of h [B, NT, H, K, V] or its [B, NT, S, H, K, V] view: the shape of dh."""
    return h.shape[:2] + h.shape[-3:]


def stream_layout(x: jax.Array, padded_width: int, pad_tokens: int, num_householder: int) -> jax.Array:
    """[B, T*M, H, X] -> [B, T + pad_tokens, M, H, padded_width]: zero rows past T and zero columns
    past X, in x's dtype (a free reshape after the pad; the walk kernels upcast what they load)."""
    batch, positions, heads, width = x.shape
    m = num_householder
    x = jnp.pad(x, ((0, 0), (0, pad_tokens * m), (0, 0), (0, padded_width - width)))
    return x.reshape(batch, positions // m + pad_tokens, m, heads, padded_width)


def l2norm_scale(sum_of_squares: jax.Array, eps: float = L2NORM_EPS) -> jax.Array:
    """(sum_of_squares + eps)^(-1/2): l2norm's factor of a row, from its float32 sum of squares
    (the WY kernel has it on its gram's diagonal)."""
    return jax.lax.rsqrt(sum_of_squares + eps)


def l2norm_factor(x: jax.Array, eps: float = L2NORM_EPS) -> jax.Array:
    """(sum_d x_d^2 + eps)^(-1/2) over the last axis of x [..., D], float32 [...]: what
    ``l2norm`` multiplies each row by."""
    x32 = x.astype(jnp.float32)
    return l2norm_scale(jnp.sum(x32 * x32, axis=-1), eps)


def l2norm(x: jax.Array, eps: float = L2NORM_EPS) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, computed in float32, returned in x's dtype
    (flash-linear-attention's formula)."""
    return l2norm_and_factor(x, eps)[0]


def l2norm_and_factor(x: jax.Array, eps: float = L2NORM_EPS):
    """(``l2norm(x)``, ``l2norm_factor(x)``): the rows and the float32 factors [...] that made
    them, for a VJP that applies the normalisation's Jacobian inside a kernel."""
    factor = l2norm_factor(x, eps)
    return (x.astype(jnp.float32) * factor[..., None]).astype(x.dtype), factor
