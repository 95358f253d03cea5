"""Flax NNX layer around gdp_jax's Gated DeltaProduct op (needs ``flax``; ``import gdp_jax`` does not).

``GatedDeltaProduct`` follows flash-linear-attention's layer of the same name: q/k/v/beta
projections with M Householder copies per token, a Mamba-style forget gate (A_log, dt_bias),
short causal depthwise convolutions with SiLU (without them: SiLU alone, as fla; linear with
``no_conv_activation=None``), L2-normalised q/k, a gated RMSNorm on the output and an output
projection; ``num_v_heads`` value heads may share each q/k head. ``segment_ids`` pack several
sequences into one row: the op restarts its state at every segment start and the short
convolutions never read across one. ``attention_mask`` marks padding, which is dropped as fla
drops it (``gdp_jax.layers.padding``).

Decoding: ``init_cache`` (or ``__call__(..., return_cache=True)`` after a prefill) gives a
``GDPCache``; ``step(x_t, cache)`` consumes one token and matches the full forward token by token.

Names: B batch, T tokens, D hidden size, H q/k heads, HV value heads (num_v_heads, a multiple
of H; H by default), K head (key) dim, V value head dim, M num_householder, W conv_size.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from gdp_jax.layers.padding import check_attention_mask, compact_padding, gather_tokens
from gdp_jax.layers.short_conv import ShortConvolution, _same_segment_taps
from gdp_jax.ops.decode import recurrent_gdp_step
from gdp_jax.ops.gated_delta_product import chunk_gated_delta_product

__all__ = ["GDPCache", "GatedDeltaProduct"]


class GDPCache(NamedTuple):
    """Decode cache of one GatedDeltaProduct layer (a pytree).

    state: [B, HV, K, V] float32 recurrent state.
    conv_q, conv_k, conv_v: [B, W-1, C] the last W-1 pre-convolution inputs of each short
      convolution (C = H*K, M*H*K, M*HV*V), oldest first; zeros before the sequence start.
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


def _positive_int(name: str, value) -> int:
    """value as an int >= 1, else ValueError/TypeError naming the argument."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name}: expected a positive int, got {value!r}")
    if int(value) < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)


class GatedDeltaProduct(nnx.Module):
    """Gated DeltaProduct token mixer (fla's ``GatedDeltaProduct`` layer), Flax NNX.

    Args:
      hidden_size: D.
      num_heads: H (query/key heads).
      head_dim: K (query/key width per head).
      expand_v: V = int(K * expand_v) (value width per head).
      num_v_heads: HV value heads (default H), a multiple of H: value head i reads q/k head
        i // (HV // H), as fla repeats q and k. The state, beta, gate, output gate and o_proj
        are per value head.
      num_householder: M Householder steps per token.
      use_forget_gate: g = -exp(A_log) * softplus(a_proj(x) + dt_bias) per token and head; off:
        g = None (no decay).
      allow_neg_eigval: beta = 2 sigmoid(b_proj(x)) in (0, 2); else sigmoid in (0, 1).
      use_short_conv: causal depthwise convolutions (width conv_size) + SiLU on q, k, v.
      conv_bias: a bias in each short convolution (fla's ``conv_bias``).
      no_conv_activation: what replaces the convolutions when use_short_conv=False: "silu" (the
        default, fla's layer: SiLU on each of the q, k, v projections) or None (the projections
        as they are, linear; the state-tracking example needs arbitrary key directions).
      use_output_gate: o = RMSNorm_V(o) * silu(g_proj(x)); off: o = RMSNorm_V(o).
      norm_eps: epsilon of the output RMSNorm.
      chunk_size, implementation: passed to ``chunk_gated_delta_product`` (None: Pallas on GPU,
        jnp elsewhere).
      dtype / param_dtype: computation and parameter dtypes of the sub-layers.
    """

    def __init__(self, hidden_size: int, *, num_heads: int = 4, head_dim: int = 64,
                 expand_v: float = 1.0, num_v_heads: Optional[int] = None,
                 num_householder: int = 2, use_forget_gate: bool = True,
                 allow_neg_eigval: bool = True, use_short_conv: bool = True, conv_size: int = 4,
                 conv_bias: bool = False, no_conv_activation: Optional[str] = "silu",
                 use_output_gate: bool = True, norm_eps: float = 1e-5,
                 chunk_size: int = 64, implementation: Optional[str] = None, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        hidden_size, num_heads, head_dim, num_householder, conv_size = (
            _positive_int(name, value) for name, value in (
                ("hidden_size", hidden_size), ("num_heads", num_heads), ("head_dim", head_dim),
                ("num_householder", num_householder), ("conv_size", conv_size)))
        num_v_heads = num_heads if num_v_heads is None else _positive_int("num_v_heads",
                                                                          num_v_heads)
        if num_v_heads % num_heads:
            raise ValueError(f"num_v_heads: expected a multiple of num_heads={num_heads} "
                             f"(or None), got {num_v_heads!r}")
        if not math.isclose(head_dim * expand_v, round(head_dim * expand_v), rel_tol=1e-5) \
                or round(head_dim * expand_v) < 1:
            raise ValueError(f"expand_v: head_dim * expand_v must be a positive integer, got "
                             f"{head_dim} * {expand_v!r}")
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.num_v_heads = num_v_heads
        self.head_v_dim = int(head_dim * expand_v)
        self.num_householder = num_householder
        self.use_forget_gate, self.allow_neg_eigval = use_forget_gate, allow_neg_eigval
        if no_conv_activation not in (None, "silu"):
            raise ValueError(f"no_conv_activation: expected None or 'silu', got "
                             f"{no_conv_activation!r}")
        self.use_short_conv, self.conv_size, self.conv_bias = use_short_conv, conv_size, conv_bias
        self.no_conv_activation = no_conv_activation
        self.use_output_gate = use_output_gate
        self.chunk_size, self.implementation = chunk_size, implementation
        h, hv, k, v, m = num_heads, num_v_heads, head_dim, self.head_v_dim, num_householder
        self.q_dim, self.k_dim, self.v_dim = h * k, m * h * k, m * hv * v
        lin = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = nnx.Linear(hidden_size, self.q_dim, use_bias=False, **lin)
        self.k_proj = nnx.Linear(hidden_size, self.k_dim, use_bias=False, **lin)
        self.v_proj = nnx.Linear(hidden_size, self.v_dim, use_bias=False, **lin)
        self.b_proj = nnx.Linear(hidden_size, m * hv, use_bias=False, **lin)
        if use_forget_gate:
            self.a_proj = nnx.Linear(hidden_size, hv, use_bias=False, **lin)
            a = jax.random.uniform(rngs.params(), (hv,), minval=1.0, maxval=16.0)
            self.A_log = nnx.Param(jnp.log(a).astype(param_dtype))
            self.dt_bias = nnx.Param(_dt_bias_init(hv, rngs.params()).astype(param_dtype))
        if use_short_conv:
            conv = dict(kernel_size=conv_size, use_bias=conv_bias, dtype=dtype,
                        param_dtype=param_dtype, rngs=rngs)
            self.q_conv = ShortConvolution(self.q_dim, **conv)
            self.k_conv = ShortConvolution(self.k_dim, **conv)
            self.v_conv = ShortConvolution(self.v_dim, **conv)
        if use_output_gate:
            self.g_proj = nnx.Linear(hidden_size, hv * v, use_bias=False, **lin)
        self.o_norm = nnx.RMSNorm(v, epsilon=norm_eps, dtype=dtype, param_dtype=param_dtype,
                                  rngs=rngs)
        self.o_proj = nnx.Linear(hv * v, hidden_size, use_bias=False, **lin)

    # -- pieces shared by the full forward and the decode step --------------------------------

    def _gate(self, x: jax.Array) -> Optional[jax.Array]:
        """x [..., D] -> natural-log forget gate [..., HV] float32 (<= 0), or None."""
        if not self.use_forget_gate:
            return None
        a = self.a_proj(x).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        return -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a)

    def _beta(self, x: jax.Array) -> jax.Array:
        """x [..., D] -> [..., M*HV] step sizes in (0, 2) or (0, 1), float32."""
        b = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
        return 2.0 * b if self.allow_neg_eigval else b

    def _no_conv(self, z: jax.Array) -> jax.Array:
        """The q/k/v projection without short convolutions: as is, or SiLU (fla's layer)."""
        return jax.nn.silu(z) if self.no_conv_activation == "silu" else z

    def _repeat_heads(self, z: jax.Array) -> jax.Array:
        """[..., H, K] -> [..., HV, K]: q/k head h serves value heads h*G .. h*G+G-1, G = HV/H."""
        groups = self.num_v_heads // self.num_heads
        return z if groups == 1 else jnp.repeat(z, groups, axis=-2)

    def _output(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """o [..., HV, V], x [..., D] -> y [..., D]: gated RMSNorm over V, then o_proj."""
        o = self.o_norm(o)
        if self.use_output_gate:
            gate = self.g_proj(x).reshape(o.shape)
            o = o * jax.nn.silu(gate)
        return self.o_proj(o.reshape(o.shape[:-2] + (-1,)))

    # -- full sequence ------------------------------------------------------------------------

    def __call__(self, x: jax.Array, *, segment_ids: Optional[jax.Array] = None,
                 attention_mask: Optional[jax.Array] = None, return_cache: bool = False):
        """x [B, T, D] -> y [B, T, D] (and a GDPCache for decoding on, if return_cache).

        segment_ids [B, T] int (optional): packed sequences; nothing crosses a segment start,
        neither the recurrent state nor the short convolutions. The returned cache holds the
        state and conv inputs of each row's last segment, ready for ``step``.

        attention_mask [B, T] 0/1 (optional; 0 = padding): as fla, padding tokens are dropped,
        each row's real tokens run as one sequence (split further by segment_ids, if given), and
        y is zero at padding positions. The cache then holds each row's last real segment (zero
        for a row without real tokens), whether the padding is on the left, the right or inside.
        """
        if x.ndim != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected shape [B, T, D] with D = {self.hidden_size}, got "
                             f"{tuple(x.shape)}")
        batch, tokens, _ = x.shape
        if segment_ids is not None and jnp.shape(segment_ids) != (batch, tokens):
            raise ValueError(f"segment_ids: expected shape [B, T] = {(batch, tokens)}, got "
                             f"{tuple(jnp.shape(segment_ids))}")
        if attention_mask is None:
            return self._forward(x, segment_ids, return_cache)
        mask = check_attention_mask(attention_mask, batch, tokens)
        comp = compact_padding(mask, segment_ids)
        out = self._forward(gather_tokens(x, comp.perm), comp.segment_ids, return_cache)
        y_c, cache = out if return_cache else (out, None)
        y = gather_tokens(y_c, comp.inverse)
        y = jnp.where(mask[..., None], y, jnp.zeros((), y.dtype))
        if not return_cache:
            return y
        has_real = jnp.any(mask, axis=1)

        def zero_rows(c):   # a row without real tokens keeps a fresh (zero) cache
            if c is None:
                return None
            keep = has_real.reshape((batch,) + (1,) * (c.ndim - 1))
            return jnp.where(keep, c, jnp.zeros((), c.dtype))
        return y, GDPCache(*(zero_rows(c) for c in cache))

    def _qkv(self, x: jax.Array):
        """x [..., D] -> the q, k, v projections [..., H*K], [..., M*H*K], [..., M*HV*V]."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def _forward(self, x: jax.Array, segment_ids: Optional[jax.Array], return_cache: bool):
        """The full-sequence forward on unpadded rows: x [B, T, D] -> y (and a GDPCache)."""
        batch, tokens, _ = x.shape
        hk, hv = self.num_heads, self.num_v_heads
        kd, vd, m = self.head_dim, self.head_v_dim, self.num_householder
        q_in, k_in, v_in = self._qkv(x)
        if self.use_short_conv:
            q = self.q_conv(q_in, segment_ids)
            k = self.k_conv(k_in, segment_ids)
            v = self.v_conv(v_in, segment_ids)
        else:
            q, k, v = self._no_conv(q_in), self._no_conv(k_in), self._no_conv(v_in)
        q = self._repeat_heads(q.reshape(batch, tokens, hk, kd))
        k = self._repeat_heads(k.reshape(batch, tokens * m, hk, kd))  # position t*M + m
        v = v.reshape(batch, tokens * m, hv, vd)
        beta = self._beta(x).reshape(batch, tokens * m, hv)
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
        """A zero cache for a fresh sequence (also what to pass at a segment start): state
        [B, HV, K, V] float32, conv inputs [B, W-1, C] in ``dtype``."""
        state = jnp.zeros((batch, self.num_v_heads, self.head_dim, self.head_v_dim), jnp.float32)
        if not self.use_short_conv:
            return GDPCache(state, None, None, None)
        zeros = lambda c: jnp.zeros((batch, self.conv_size - 1, c), dtype)
        return GDPCache(state, zeros(self.q_dim), zeros(self.k_dim), zeros(self.v_dim))

    def step(self, x_t: jax.Array, cache: GDPCache):
        """One token: x_t [B, D], cache -> (y_t [B, D], new cache). Matches ``__call__`` on the
        same sequence token by token."""
        batch = x_t.shape[0]
        hk, hv = self.num_heads, self.num_v_heads
        kd, vd, m = self.head_dim, self.head_v_dim, self.num_householder
        q, k, v = self._qkv(x_t)
        conv = (None, None, None)
        if self.use_short_conv:
            q, cq = self.q_conv.step(q, cache.conv_q)
            k, ck = self.k_conv.step(k, cache.conv_k)
            v, cv = self.v_conv.step(v, cache.conv_v)
            conv = (cq, ck, cv)
        else:
            q, k, v = self._no_conv(q), self._no_conv(k), self._no_conv(v)
        q = self._repeat_heads(q.reshape(batch, hk, kd))
        k = self._repeat_heads(k.reshape(batch, m, hk, kd))
        v = v.reshape(batch, m, hv, vd)
        beta = self._beta(x_t).reshape(batch, m, hv)
        o, state = recurrent_gdp_step(q, k, v, self._gate(x_t), beta, cache.state,
                                      num_householder=m, use_qk_l2norm=True)
        return self._output(o, x_t), GDPCache(state, *conv)
