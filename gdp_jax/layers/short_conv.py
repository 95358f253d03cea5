"""Causal depthwise short convolution with SiLU that never reads across a segment start (Flax NNX)."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from gdp_jax._src.segments import segment_runs

__all__ = ["ShortConvolution"]


def _same_segment_taps(segment_ids: Optional[jax.Array], batch: int, tokens: int,
                       width: int) -> jax.Array:
    """[B, T, W] bool: tap i of token t reads token s = t - (W-1) + i; True when s >= 0 and s is in
    t's segment (always True for s >= 0 when segment_ids is None)."""
    if segment_ids is None:
        runs = jnp.zeros((batch, tokens), jnp.int32)
    else:
        runs = segment_runs(jnp.asarray(segment_ids))
    padded = jnp.concatenate([jnp.full((batch, width - 1), -1, jnp.int32), runs], axis=1)
    src = jnp.stack([padded[:, i:i + tokens] for i in range(width)], axis=-1)  # [B, T, W]
    return src == runs[..., None]


class ShortConvolution(nnx.Module):
    """Causal depthwise 1-D convolution over T followed by SiLU (fla's ShortConvolution).

    Holds its weights in an ``nnx.Conv`` (kernel [W, 1, C]; tap W-1 is the current token: fla's
    Conv1d weight [C, 1, W] transposed; ``use_bias``: a per-channel bias [C] added before the
    SiLU, fla's ``conv_bias``, off by default) but applies them as W shifted multiply-adds
    accumulated in float32 (or wider), as fla's causal-conv kernel does: one fused elementwise
    pass, where a grouped convolution with C groups is cuDNN's slow path (benchmarks/RESULTS.md,
    the causal LM's prefill).
    """

    def __init__(self, channels: int, kernel_size: int = 4, *, rngs: nnx.Rngs,
                 use_bias: bool = False, dtype=None, param_dtype=jnp.float32):
        self.channels, self.kernel_size = channels, kernel_size
        self.use_bias = use_bias
        self.conv = nnx.Conv(channels, channels, kernel_size=(kernel_size,),
                             feature_group_count=channels, padding="VALID", use_bias=use_bias,
                             dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array, segment_ids: Optional[jax.Array] = None) -> jax.Array:
        """x [B, T, C] -> silu(causal depthwise conv(x)) [B, T, C].

        With segment_ids [B, T], taps whose source token lies in another segment read zero (as
        if each segment were its own zero-padded sequence)."""
        width = self.kernel_size
        batch, tokens, _ = x.shape
        xp = jnp.pad(x, ((0, 0), (width - 1, 0), (0, 0)))
        taps = [xp[:, i:i + tokens] for i in range(width)]  # oldest first, each [B, T, C]
        if segment_ids is not None:
            mask = _same_segment_taps(segment_ids, batch, tokens, width)  # [B, T, W]
            taps = [jnp.where(mask[..., i, None], t, jnp.zeros((), t.dtype))
                    for i, t in enumerate(taps)]
        return self._apply_taps(taps)

    def _apply_taps(self, taps) -> jax.Array:
        """W arrays [..., C] (oldest first) -> silu(sum_i taps[i] * kernel[i] + bias) [..., C]."""
        kernel = self.conv.kernel[...][:, 0, :]  # [W, C]
        dtype = self.conv.dtype or jnp.result_type(taps[0].dtype, kernel.dtype)
        acc_dtype = jnp.promote_types(dtype, jnp.float32)
        kernel = kernel.astype(acc_dtype)
        y = sum(t.astype(acc_dtype) * kernel[i] for i, t in enumerate(taps))
        if self.use_bias:
            y = y + self.conv.bias[...].astype(acc_dtype)
        return jax.nn.silu(y).astype(dtype)

    def step(self, x_t: jax.Array, conv_state: jax.Array):
        """x_t [B, C], conv_state [B, W-1, C] -> (silu(conv) [B, C], new conv_state [B, W-1, C])."""
        x_t = x_t.astype(conv_state.dtype)
        y = self._apply_taps([conv_state[:, i] for i in range(self.kernel_size - 1)] + [x_t])
        return y, jnp.concatenate([conv_state, x_t[:, None]], axis=1)[:, 1:]   # W = 1: [B, 0, C]
