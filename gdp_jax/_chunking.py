"""Layout helpers shared by the jnp stages: native [B, T*P, H, ...] <-> per-chunk [B, NT, H, BT*P, ...].

P is the number of stream positions per token (1 on the token stream, M on the expanded stream).
The last partial chunk is padded: with zeros (``mode="constant"``) or by repeating the last real
token (``mode="edge"``, for decays and segment run numbers, so padding neither decays nor resets).
``tile_width`` is the Pallas kernels' rule for K and V widths.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


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


def tile_width(n: int) -> int:
    """The width the Pallas kernels give a K or V axis of size n: the next power of two, at least
    16 (Triton's dot tile rule); the padding is zeros, which change no dot product."""
    return max(16, 1 << (n - 1).bit_length())


# The widest K or V the compiled Pallas kernels are built for: every kernel's Triton IR was
# compiled offline for sm_90a up to this width (benchmarks/codegen.py) and run on an H200 up to
# it. Wider calls run the jnp stages instead (chunk_o.py, chunk.py).
KERNEL_MAX_WIDTH = 256


def kernel_widths_supported(key_dim: int, value_dim: int) -> bool:
    """Whether K and V, padded to tile widths, are within KERNEL_MAX_WIDTH."""
    return max(tile_width(key_dim), tile_width(value_dim)) <= KERNEL_MAX_WIDTH


def kernel_dtype_supported(dtype) -> bool:
    """Whether the Pallas kernels, compiled or interpreted, take inputs of this dtype: 2- and
    4-byte floats. float64 (under jax_enable_x64) runs the jnp stages in float64 instead (chunk_o.py,
    chunk.py); the kernels accumulate in float32 and have no 8-byte tiles."""
    return jnp.dtype(dtype).itemsize <= 4
