"""Flax NNX layer around gdp_jax's Gated DeltaProduct op (needs ``flax``; ``import gdp_jax`` does not).

``GatedDeltaProduct`` follows flash-linear-attention's layer of the same name: q/k/v/beta
projections with M Householder copies per token, a Mamba-style forget gate (A_log, dt_bias),
short causal depthwise convolutions with SiLU, L2-normalised q/k, a gated RMSNorm on the output
and an output projection. ``segment_ids`` pack several sequences into one row: the op restarts its
state at every segment start and the short convolutions never read across one.

Decoding: ``init_cache`` (or ``__call__(..., return_cache=True)`` after a prefill) gives a
``GDPCache``; ``step(x_t, cache)`` consumes one token and matches the full forward token by token.

Names: B batch, T tokens, D hidden size, H heads, K head (key) dim, V value head dim,
M num_householder, W conv_size.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from gdp_jax.layers.short_conv import ShortConvolution
from gdp_jax.ops.decode import recurrent_gdp_step
from gdp_jax.ops.gated_delta_product import chunk_gated_delta_product

__all__ = ["GDPCache", "GatedDeltaProduct"]


class GDPCache(NamedTuple):
    """Decode cache of one GatedDeltaProduct layer (a pytree).

    state: [B, H, K, V] float32 recurrent state.
    conv_q, conv_k, conv_v: [B, W-1, C] the last W-1 pre-convolution inputs of each short
      convolution (C = H*K, M*H*K, M*H*V), oldest first; zeros before the sequence start.
      ``None`` when the layer has no short convolutions.
    """
    state: jax.Array
    conv_q: Optional[jax.Array]
    conv_k: Optional[jax.Array]
    conv_v: Optional[jax.Array]


def _dt_bias_init(heads: int, key: jax.Array, dt_min=1e-3, dt_max=0.1, dt_floor=1e-4):
    """fla/Mamba init: dt ~ log-uniform(dt_min, dt_max), dt_bias = softplus^{-1}(dt)."""
    u = jax.random.uniform(key, (heads,))
    dt = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = jnp.maximum(dt, dt_floor)
    return dt + jnp.log(-jnp.expm1(-dt))


class GatedDeltaProduct(nnx.Module):
    """Gated DeltaProduct token mixer (fla's ``GatedDeltaProduct`` layer), Flax NNX.

    Args:
      hidden_size: D.
      num_heads: H.
      head_dim: K (query/key width per head).
      expand_v: V = int(K * expand_v) (value width per head).
      num_householder: M Householder steps per token.
      use_forget_gate: g = -exp(A_log) * softplus(a_proj(x) + dt_bias) per token and head; off:
        g = None (no decay).
      allow_neg_eigval: beta = 2 sigmoid(b_proj(x)) in (0, 2); else sigmoid in (0, 1).
      use_short_conv: causal depthwise convolutions (width conv_size) + SiLU on q, k, v.
      use_output_gate: o = RMSNorm_V(o) * silu(g_proj(x)); off: o = RMSNorm_V(o).
      norm_eps: epsilon of the output RMSNorm.
      chunk_size, implementation: passed to ``chunk_gated_delta_product`` (None: Pallas on GPU,
        jnp elsewhere).
      dtype / param_dtype: computation and parameter dtypes of the sub-layers.
    """

    def __init__(self, hidden_size: int, *, num_heads: int = 4, head_dim: int = 64,
                 expand_v: float = 1.0, num_householder: int = 2, use_forget_gate: bool = True,
                 allow_neg_eigval: bool = True, use_short_conv: bool = True, conv_size: int = 4,
                 use_output_gate: bool = True, norm_eps: float = 1e-5, chunk_size: int = 64,
                 implementation: Optional[str] = None, dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.head_v_dim = int(head_dim * expand_v)
        self.num_householder = num_householder
        self.use_forget_gate, self.allow_neg_eigval = use_forget_gate, allow_neg_eigval
        self.use_short_conv, self.conv_size = use_short_conv, conv_size
        self.use_output_gate = use_output_gate
        self.chunk_size, self.implementation = chunk_size, implementation
        h, k, v, m = num_heads, head_dim, self.head_v_dim, num_householder
        self.q_dim, self.k_dim, self.v_dim = h * k, m * h * k, m * h * v
        lin = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = nnx.Linear(hidden_size, self.q_dim, use_bias=False, **lin)
        self.k_proj = nnx.Linear(hidden_size, self.k_dim, use_bias=False, **lin)
        self.v_proj = nnx.Linear(hidden_size, self.v_dim, use_bias=False, **lin)
        self.b_proj = nnx.Linear(hidden_size, m * h, use_bias=False, **lin)
        if use_forget_gate:
            self.a_proj = nnx.Linear(hidden_size, h, use_bias=False, **lin)
            a = jax.random.uniform(rngs.params(), (h,), minval=1.0, maxval=16.0)
            self.A_log = nnx.Param(jnp.log(a).astype(param_dtype))
            self.dt_bias = nnx.Param(_dt_bias_init(h, rngs.params()).astype(param_dtype))
        if use_short_conv:
            conv = dict(kernel_size=conv_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            self.q_conv = ShortConvolution(self.q_dim, **conv)
            self.k_conv = ShortConvolution(self.k_dim, **conv)
            self.v_conv = ShortConvolution(self.v_dim, **conv)
        if use_output_gate:
            self.g_proj = nnx.Linear(hidden_size, h * v, use_bias=False, **lin)
        self.o_norm = nnx.RMSNorm(v, epsilon=norm_eps, dtype=dtype, param_dtype=param_dtype,
                                  rngs=rngs)
        self.o_proj = nnx.Linear(h * v, hidden_size, use_bias=False, **lin)

    # -- pieces shared by the full forward and the decode step --------------------------------

    def _gate(self, x: jax.Array) -> Optional[jax.Array]:
        """x [..., D] -> natural-log forget gate [..., H] float32 (<= 0), or None."""
        if not self.use_forget_gate:
            return None
        a = self.a_proj(x).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        return -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a)

    def _beta(self, x: jax.Array) -> jax.Array:
        """x [..., D] -> [..., M*H] step sizes in (0, 2) or (0, 1), float32."""
        b = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
        return 2.0 * b if self.allow_neg_eigval else b

    def _output(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """o [..., H, V], x [..., D] -> y [..., D]: gated RMSNorm over V, then o_proj."""
        o = self.o_norm(o)
        if self.use_output_gate:
            gate = self.g_proj(x).reshape(o.shape)
            o = o * jax.nn.silu(gate)
        return self.o_proj(o.reshape(o.shape[:-2] + (-1,)))

    # -- full sequence ------------------------------------------------------------------------

    def __call__(self, x: jax.Array, *, segment_ids: Optional[jax.Array] = None,
                 return_cache: bool = False):
        """x [B, T, D] -> y [B, T, D] (and a GDPCache for decoding on, if return_cache).

        segment_ids [B, T] int (optional): packed sequences; nothing crosses a segment start,
        neither the recurrent state nor the short convolutions. The returned cache holds the
        state and conv inputs of each row's last segment, ready for ``step``.
        """
        batch, tokens, _ = x.shape
        h, kd, vd, m = self.num_heads, self.head_dim, self.head_v_dim, self.num_householder
        q_in, k_in, v_in = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.use_short_conv:
            q = self.q_conv(q_in, segment_ids)
            k = self.k_conv(k_in, segment_ids)
            v = self.v_conv(v_in, segment_ids)
        else:
            q, k, v = q_in, k_in, v_in
        q = q.reshape(batch, tokens, h, kd)
        k = k.reshape(batch, tokens * m, h, kd)      # [B, T, M, H, K] -> position t*M + m
        v = v.reshape(batch, tokens * m, h, vd)
        beta = self._beta(x).reshape(batch, tokens * m, h)
        g = self._gate(x)
        o, final_state = chunk_gated_delta_product(
            q, k, v, g, beta, num_householder=m, segment_ids=segment_ids,
            output_final_state=return_cache, use_qk_l2norm=True, chunk_size=self.chunk_size,
            implementation=self.implementation)
        y = self._output(o, x)
        if not return_cache:
            return y
        conv = (None, None, None)
        if self.use_short_conv:
            conv = tuple(self._tail(z, segment_ids) for z in (q_in, k_in, v_in))
        return y, GDPCache(final_state, *conv)

    def _tail(self, z: jax.Array, segment_ids: Optional[jax.Array]) -> jax.Array:
        """[B, T, C] -> [B, W-1, C]: the last W-1 inputs, zeroed where outside the last segment."""
        batch, tokens, _ = z.shape
        w1 = self.conv_size - 1
        zp = jnp.pad(z, ((0, 0), (w1, 0), (0, 0)))[:, tokens:]
        if segment_ids is not None:
            keep = _same_segment_taps(segment_ids, batch, tokens, self.conv_size)[:, -1, 1:]
            zp = jnp.where(keep[..., None], zp, jnp.zeros((), z.dtype))
        return zp

    # -- decoding ------------------------------------------------------------------------------

    def init_cache(self, batch: int, dtype=jnp.float32) -> GDPCache:
        """A zero cache for a fresh sequence (also what to pass at a segment start)."""
        state = jnp.zeros((batch, self.num_heads, self.head_dim, self.head_v_dim), jnp.float32)
        if not self.use_short_conv:
            return GDPCache(state, None, None, None)
        zeros = lambda c: jnp.zeros((batch, self.conv_size - 1, c), dtype)
        return GDPCache(state, zeros(self.q_dim), zeros(self.k_dim), zeros(self.v_dim))

    def step(self, x_t: jax.Array, cache: GDPCache):
        """One token: x_t [B, D], cache -> (y_t [B, D], new cache). Matches ``__call__`` on the
        same sequence token by token."""
        batch = x_t.shape[0]
        h, kd, vd, m = self.num_heads, self.head_dim, self.head_v_dim, self.num_householder
        q, k, v = self.q_proj(x_t), self.k_proj(x_t), self.v_proj(x_t)
        conv = (None, None, None)
        if self.use_short_conv:
            q, cq = self.q_conv.step(q, cache.conv_q)
            k, ck = self.k_conv.step(k, cache.conv_k)
            v, cv = self.v_conv.step(v, cache.conv_v)
            conv = (cq, ck, cv)
        q = q.reshape(batch, h, kd)
        k = k.reshape(batch, m, h, kd)
        v = v.reshape(batch, m, h, vd)
        beta = self._beta(x_t).reshape(batch, m, h)
        o, state = recurrent_gdp_step(q, k, v, self._gate(x_t), beta, cache.state,
                                      num_householder=m, use_qk_l2norm=True)
        return self._output(o, x_t), GDPCache(state, *conv)
