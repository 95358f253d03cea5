"""The Gated DeltaProduct recurrence of SPEC.md, token by token: the ground truth of every test.

Deliberately naive (a ``lax.scan`` over tokens, no chunked algebra), so it shares no code path with
the kernels it checks. Run it in float64 for references (``dtype=jnp.float64`` turns on 64-bit
mode just for this call) or float32 for quick looks.
"""
from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from gdp_jax._src import validation as val
from gdp_jax._src.segments import segment_starts
from gdp_jax.ops.cumsum import chunk_local_log2_cumsum


class RecurrenceOutputs(NamedTuple):
    """Everything chunk_gdp_fwd_o needs, as SPEC's "Chunked form" defines it.

    o:           [B, T, H, V]      scale * S^T q[t], read after all M steps of token t.
    h:           [B, NT, H, K, V]  state just before token c*chunk_size (zero at a segment start).
    v_new:       [B, T*M, H, V]    corrected values beta * (v - S^T k).
    g:           [B, T, H]         chunk-local cumulative log2 decays (zeros when g_raw is None).
    final_state: [B, H, K, V]      state after each row's last token.
    """
    o: jax.Array
    h: jax.Array
    v_new: jax.Array
    g: jax.Array
    final_state: jax.Array


def recurrence(q, k, v, g_raw=None, beta=None, *, num_householder: Optional[int] = None,
               scale: Optional[float] = None, initial_state=None, segment_ids=None,
               chunk_size: int = 64, dtype=jnp.float64) -> RecurrenceOutputs:
    """Runs SPEC's recurrence and returns o, h, v_new, g and the final state (see RecurrenceOutputs).

    Args:
      q: [B, T, H, K]. k: [B, T*M, H, K]. v: [B, T*M, H, V] raw values.
      g_raw: [B, T, H] natural-log forget gates (<= 0), or None for no gating.
      beta: [B, T*M, H] step sizes, or None for all ones.
      initial_state: [B, H, K, V] state before the first segment of each row, or None for zeros.
      segment_ids: [B, T] integer packing, or None for one sequence per row.
      chunk_size: the chunk grid that h and g are reported on.
      dtype: the arithmetic dtype of the whole evaluation (float64 by default).
    """
    batch, tokens, heads, key_dim = val.check_float_array("q", q, 4, "B, T, H, K")
    _, positions, _, _ = val.check_float_array("k", k, 4, "B, T*M, H, K")
    m = val.infer_num_householder(num_householder, tokens, positions)
    value_dim = val.check_float_array("v", v, 4, "B, T*M, H, V")[3]
    val.check_shape("k", k, (batch, tokens * m, heads, key_dim), "B, T*M, H, K")
    val.check_shape("v", v, (batch, tokens * m, heads, value_dim), "B, T*M, H, V")
    if g_raw is not None:
        val.check_shape("g_raw", g_raw, (batch, tokens, heads), "B, T, H")
    if beta is not None:
        val.check_shape("beta", beta, (batch, tokens * m, heads), "B, T*M, H")
    if initial_state is not None:
        val.check_shape("initial_state", initial_state, (batch, heads, key_dim, value_dim), "B, H, K, V")
    if segment_ids is not None:
        val.check_segment_ids(segment_ids, batch, tokens)
    chunk_size = val.check_chunk_size(chunk_size)
    scale = val.check_scale(scale, key_dim)

    wide = jnp.dtype(dtype) == jnp.float64
    with (jax.enable_x64(True) if wide else contextlib.nullcontext()):
        cast = lambda x: jnp.asarray(x, dtype)
        g_raw = jnp.zeros((batch, tokens, heads), dtype) if g_raw is None else cast(g_raw)
        beta = jnp.ones((batch, tokens * m, heads), dtype) if beta is None else cast(beta)
        state0 = (jnp.zeros((batch, heads, key_dim, value_dim), dtype) if initial_state is None
                  else cast(initial_state))
        starts = (jnp.zeros((batch, tokens), bool) if segment_ids is None
                  else segment_starts(jnp.asarray(segment_ids)).at[:, 0].set(False))
        return _recurrence(cast(q), cast(k), cast(v), g_raw, beta, state0, starts,
                           m=m, scale=scale, chunk_size=chunk_size)


@functools.partial(jax.jit, static_argnames=("m", "scale", "chunk_size"))
def _recurrence(q, k, v, g_raw, beta, state0, starts, *, m, scale, chunk_size):
    batch, tokens, heads, key_dim = q.shape
    num_chunks = -(-tokens // chunk_size)
    pad = num_chunks * chunk_size - tokens
    precision = jax.lax.Precision.HIGHEST

    # Padding tokens leave the state alone: gate exp(0) = 1, beta = 0 so v_new = 0, no reset.
    def to_chunks(x, per_token):
        x = jnp.pad(x, [(0, 0), (0, pad * per_token)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((batch, num_chunks, chunk_size, per_token) + x.shape[2:])
        return jnp.moveaxis(x, (1, 2), (0, 1))  # [NT, BT, B, per_token, ...]

    xs = (to_chunks(q, 1)[:, :, :, 0], to_chunks(k, m), to_chunks(v, m), to_chunks(beta, m),
          to_chunks(g_raw, 1)[:, :, :, 0], to_chunks(starts, 1)[:, :, :, 0])

    def token_step(state, x):
        q_t, k_t, v_t, beta_t, g_t, start_t = x
        state = jnp.where(start_t[:, None, None, None], 0, state)      # a segment carries nothing in
        state = jnp.exp(g_t)[..., None, None] * state                  # gate once per token
        v_new_t = []
        for step in range(m):                                           # M Householder steps
            kj = k_t[:, step]
            vj = beta_t[:, step, :, None] * (
                v_t[:, step] - jnp.einsum("bhkv,bhk->bhv", state, kj, precision=precision))
            state = state + jnp.einsum("bhk,bhv->bhkv", kj, vj, precision=precision)
            v_new_t.append(vj)
        o_t = scale * jnp.einsum("bhkv,bhk->bhv", state, q_t, precision=precision)
        return state, (o_t, jnp.stack(v_new_t, axis=1))

    def chunk_step(state, x):
        start_c = x[-1][0]
        state = jnp.where(start_c[:, None, None, None], 0, state)      # h is taken after the reset
        h_c = state
        state, (o_c, v_new_c) = jax.lax.scan(token_step, state, x)
        return state, (h_c, o_c, v_new_c)

    final_state, (h, o, v_new) = jax.lax.scan(chunk_step, state0, xs)

    def from_chunks(x, per_token):  # [NT, BT, B, per_token, ...] -> [B, T*per_token, ...]
        x = jnp.moveaxis(x, (0, 1), (1, 2))
        x = x.reshape((batch, num_chunks * chunk_size * per_token) + x.shape[4:])
        return x[:, :tokens * per_token]

    return RecurrenceOutputs(
        o=from_chunks(o[:, :, :, None], 1),
        h=jnp.moveaxis(h, 0, 1),
        v_new=from_chunks(v_new, m),
        g=chunk_local_log2_cumsum(g_raw, chunk_size),
        final_state=final_state,
    )
