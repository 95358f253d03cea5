"""Context parallelism: the full op with the token axis T split into contiguous blocks over devices.

``gdp_jax.sharding.sharded_chunk_gated_delta_product(..., token_axis=...)`` maps
``context_parallel_gdp`` (below) over the mesh with ``shard_map``; this module is its per-device
body. Device d of the n devices along the token axis holds tokens [d*T_b, (d+1)*T_b) of every row,
T_b = T / n a multiple of chunk_size, so its chunks are the global grid's chunks
[d*T_b/BT, (d+1)*T_b/BT) and the chunk-local decays (stage 1) and the chunk output (stage 4) need
nothing from other devices. Only the state walk (stage 3) crosses blocks.

The walk is affine in the state (docs/math.md §5): per row and head, the state after block d is

    S_out(d) = A_d S_in(d) + S0_d,      A_d [K, K],  S0_d [K, V]

where S0_d is the block's own zero-start state and A_d the product of its gated Householder steps
(zeroed by any segment start inside the block: then nothing before it survives). The same holds at
every chunk boundary and every position inside the block: h[c] = h0[c] + P[c] S_in and
v_new[j] = v_new0[j] + r[j] S_in, with P[c] [K, K] the product of the steps before chunk c and
r[j] = -(w_j^T P[c]) [1, K] the row that S_in adds to position j's corrected value.

One local pass computes all of it. The walk is linear in (values, state) jointly and acts on the
state's columns independently, so running stages 2-3 ONCE on the block with the values extended by
K zero columns and the initial state extended by the identity,

    v_ext = [v | 0_K]   [B, T_b*M, H, V+K],      S_ext(0) = [0_{K x V} | I_K]   [B, H, K, V+K],

gives h_ext[c] = [h0[c] | P[c]], v_new_ext = [v_new0 | r] and final_ext = [S0 | A]: the first V
columns are the zero-start walk, the last K columns are the walk applied to I, i.e. the linear map
itself (u of the zero columns is zero, so only the state term moves them). Segment starts need
nothing extra: a start at a chunk boundary zeroes the carried state, a start inside a chunk zeroes
w's rows and the surviving factor d, in all V+K columns alike.

Then, per device:

1. exchange the summaries: an all_gather over the token axis of final_ext [B, H, K, V+K] float32
   (K(K+V) numbers per row and head; never anything of size T), and of one int32 pair per row
   (the block's first and last segment id);
2. combine them in order, on every device (n tiny [K, K] x [K, V] products):
       S_in(0) = initial_state (or 0);
       S_in(d+1) = 0 if a segment starts exactly at block d+1's first token
                   (its first id != block d's last id: the one reset the local pass cannot see),
                   else A_d S_in(d) + S0_d;
       final_state = A_{n-1} S_in(n-1) + S0_{n-1}       (the same on every device)
3. finish locally from the true entering state, with no second walk. The output stage (chunk_o)
   is linear in (v_new, h) and acts on their value columns independently, so running it once on
   the local pass' outputs as they are, v_new_ext = [v_new0 | r] and h_ext = [h0 | P], gives
   [o0 | o_r] [B, T_b, H, V+K], and the block's output is

       o = chunk_o(q, k, v_new0 + r S_in, h0 + P S_in) = o0 + o_r S_in     (an einsum over K)

   The true h and v_new are never formed: the finish touches the token stream only, [T_b, K] x
   [K, V] per head, where forming them would read and write [T_b*M, V+K] and [NT_b, K, V+K].

Cost over the plain op per device: the local pass and the output stage run V+K wide instead of V
(for K = V: twice the walk's and chunk_o's width; the WY stage's w and its inverse unchanged), plus
the finish's [T_b, K] x [K, V] product. Communication: one all_gather of n*B*H*K*(K+V) float32
forward, its reduce-scatter backward.

Where V+K, padded to the kernels' tile width, exceeds the Pallas kernels' 256 but K and V alone do
not (e.g. K = V = 256, or K = 128 with V = 256), the pass runs as two calls of stages 2-3 on the
Pallas path, [v] from zero and [0_K] from I (the WY stage runs twice), and the output stage as two
calls likewise; otherwise ``_src.dispatch`` would send the extended calls to the jnp stages.

Gradients: plain autodiff through the body. The local pass is ``chunk_states`` (its custom_vjp on
the Pallas path, autodiff of the jnp stages on "xla"), the combine a ``lax.scan``, the all_gather
transposes to a reduce-scatter of the summaries' cotangents: the reverse-direction summaries
(dS at each block's end, as the cotangents of [S0 | A]) travel back over the same state-sized
collective, and each device then runs the reverse walk on its block alone.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from gdp_jax._src import dispatch
from gdp_jax._src.pallas import HIGHEST
from gdp_jax._src.segments import segment_runs
from gdp_jax.ops.chunk_o import chunk_o
from gdp_jax.ops.cumsum import chunk_local_log2_cumsum
from gdp_jax.ops.gated_delta_product import chunk_states
from gdp_jax.ops.l2norm import l2norm

__all__ = ["BlockPass", "block_pass", "combine_blocks", "context_parallel_gdp", "finish",
           "split_block_pass"]


class BlockPass(NamedTuple):
    """One block's zero-start walk and its linear part (module docstring), column groups of the
    extended width V+K: ``h`` is ([h0 | P],) [B, NT_b, H, K, V+K] from one call, or (h0, P) from
    two; ``v_new`` likewise ([v_new0 | r],) [B, T_b*M, H, V+K] or (v_new0, r) (float32 on the jnp
    path, the Pallas path's dtypes there); ``summary`` [S0 | A] [B, H, K, V+K] float32; ``k`` as
    ``chunk_states`` returns it (pass it on to ``chunk_o``).
    """
    h: tuple
    v_new: tuple
    summary: jax.Array
    k: jax.Array


def split_block_pass(key_dim: int, value_dim: int, dtype, implementation: str) -> bool:
    """Whether ``block_pass`` runs as two calls: on the Pallas path, where the extended width V+K
    would leave the kernels' range (``dispatch.KERNEL_MAX_WIDTH``) but K and V alone fit."""
    return (dispatch.triton_counterpart(implementation) == "pallas"
            and dispatch.kernel_dtype_supported(dtype)
            and dispatch.kernel_widths_supported(key_dim, value_dim)
            and dispatch.kernel_widths_supported(key_dim, key_dim)
            and not dispatch.kernel_widths_supported(key_dim, value_dim + key_dim))


def block_pass(k, v, beta, g, runs, *, chunk_size: int, num_householder: int,
               implementation: str, split: Optional[bool] = None) -> BlockPass:
    """Stages 1-3 on one block, returning its zero-start walk and its linear part.

    k [B, P, H, K], v [B, P, H, V], beta [B, P, H], g [B, T_b, H] natural-log gates or None, runs
    [B, T_b] local run numbers or None (checked inputs, as for ``chunk_states``). ``split`` None
    decides by ``split_block_pass``; True runs two calls ([v] from zero, [0_K] from I), False one
    call V+K wide. Differentiable.
    """
    batch, _, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    if split is None:
        split = split_block_pass(key_dim, value_dim, k.dtype, implementation)
    stage = dict(chunk_size=chunk_size, num_householder=num_householder,
                 implementation=implementation)
    eye = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (batch, heads, key_dim, key_dim))
    zeros = jnp.zeros(v.shape[:-1] + (key_dim,), v.dtype)
    if split:
        h0, v_new0, s0, k_out = chunk_states(k, v, beta, g, runs, None, **stage)
        # k's second use: its cotangent (from the linear part) enters this call's VJP; the output
        # stage's share enters the first call's through k_out.
        carry_h, carry_v, a, _ = chunk_states(k, zeros, beta, g, runs, eye, **stage)
        return BlockPass((h0, carry_h), (v_new0, carry_v), jnp.concatenate([s0, a], axis=-1),
                         k_out)
    v_ext = jnp.concatenate([v, zeros], axis=-1)
    state_ext = jnp.concatenate(
        [jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32), eye], axis=-1)
    h_ext, v_new_ext, final_ext, k_out = chunk_states(k, v_ext, beta, g, runs, state_ext, **stage)
    return BlockPass((h_ext,), (v_new_ext,), final_ext, k_out)


def combine_blocks(s0_all, a_all, starts, initial_state):
    """The state entering each block, and the state after the last.

    s0_all [n, B, H, K, V], a_all [n, B, H, K, K] (block d's S0 and A, in block order); starts
    [n, B] bool, True where a segment starts exactly at block d's first token (ignored for d = 0),
    or None; initial_state [B, H, K, V] or None. Returns (s_in [n, B, H, K, V], final [B, H, K, V]),
    float32: s_in[0] = initial_state (or 0), s_in[d+1] = 0 where starts[d+1], else
    A_d s_in[d] + S0_d; final = A_{n-1} s_in[n-1] + S0_{n-1}.
    """
    f32 = jnp.float32
    state = (jnp.zeros(s0_all.shape[1:], f32) if initial_state is None
             else initial_state.astype(f32))
    if starts is None:
        starts = jnp.zeros(s0_all.shape[:2], bool)
    starts = starts.at[0].set(False)          # block 0 enters with initial_state

    def step(s, x):
        s0, a, start = x
        s = jnp.where(start[:, None, None, None], 0.0, s)
        return s0 + jnp.einsum("bhkj,bhjv->bhkv", a, s, precision=HIGHEST), s

    final, s_in = jax.lax.scan(step, state, (s0_all.astype(f32), a_all.astype(f32), starts))
    return s_in, final


def finish(o_zero, o_carry, s_in):
    """o = o_zero + o_carry @ s_in per row and head (o_zero [B, T_b, H, V], o_carry [B, T_b, H, K],
    s_in [B, H, K, V] float32), in o_zero's dtype. Float32 IEEE dots for float32 outputs; for
    16-bit ones float32 operands at the default precision (TF32 on a GPU; XLA's CPU dots take no
    16-bit operands with a float32 result)."""
    spec = "bthj,bhjv->bthv"
    if jnp.dtype(o_carry.dtype).itemsize == 2:
        term = jnp.einsum(spec, o_carry.astype(jnp.float32), s_in)
    else:
        term = jnp.einsum(spec, o_carry.astype(jnp.float32), s_in, precision=HIGHEST)
    return (o_zero.astype(jnp.float32) + term).astype(o_zero.dtype)


def context_parallel_gdp(q, k, v, g, beta, segment_ids, initial_state, *,
                         token_axis: Sequence[str], output_final_state: bool, scale: float,
                         chunk_size: int, num_householder: int, use_qk_l2norm: bool,
                         implementation: str, split: Optional[bool] = None):
    """``chunk_gated_delta_product`` on this device's block of T, inside ``shard_map`` with the
    mesh axes ``token_axis`` (a tuple of names, major first) manual. Returns (o, final_state):
    o [B, T_b, H, V] for the block; final_state [B, H, K, V] float32 (the whole sequence's, the
    same on every device of the token axis) or None unless ``output_final_state``.

    Inputs are the block's (local shapes, T_b a multiple of chunk_size) and already checked, as by
    ``sharding._prepare`` on the global shapes; ``scale`` resolved, ``implementation`` resolved.
    initial_state is the whole row's (replicated over the token axis; used by block 0).
    """
    token_axis = tuple(token_axis)
    value_dim = v.shape[-1]
    if use_qk_l2norm:
        q, k = l2norm(q, implementation), l2norm(k, implementation)
    runs = None if segment_ids is None else segment_runs(jnp.asarray(segment_ids))
    local = block_pass(k, v, beta, g, runs, chunk_size=chunk_size, num_householder=num_householder,
                       implementation=implementation, split=split)

    # 1. Exchange: [S0 | A] of every block (one state-sized all_gather) and each block's first and
    #    last segment id (one int32 pair per row), in block order along the token axis.
    summaries = jax.lax.all_gather(local.summary, token_axis, axis=0)    # [n, B, H, K, V+K]
    starts = None
    if segment_ids is not None:
        ids = jnp.asarray(segment_ids).astype(jnp.int32)
        edges = jax.lax.all_gather(jnp.stack([ids[:, 0], ids[:, -1]], axis=-1), token_axis,
                                   axis=0)                                 # [n, B, 2]
        starts = jnp.concatenate([jnp.zeros_like(edges[:1, :, 0], bool),
                                  edges[1:, :, 0] != edges[:-1, :, 1]], axis=0)
    # 2. Combine in order (every device runs the same n small steps).
    s_in_all, final = combine_blocks(summaries[..., :value_dim], summaries[..., value_dim:],
                                     starts, initial_state)
    s_in = s_in_all[jax.lax.axis_index(token_axis)]
    # 3. The output stage once on the local pass' outputs as they are, [v_new0 | r] and [h0 | P]:
    #    it is linear in (v_new, h) column by column, so it gives [o0 | o_r], and the block's true
    #    output is o0 + o_r S_in (h and v_new from S_in are never formed).
    g_log2 = None if g is None else chunk_local_log2_cumsum(g.astype(jnp.float32), chunk_size)
    outs = [chunk_o(q, local.k, v_new.astype(v.dtype), h, g_log2, runs, scale=scale,
                    chunk_size=chunk_size, num_householder=num_householder,
                    implementation=implementation)
            for h, v_new in zip(local.h, local.v_new)]
    o_zero, o_carry = ((outs[0][..., :value_dim], outs[0][..., value_dim:]) if len(outs) == 1
                       else outs)
    return finish(o_zero, o_carry, s_in), (final if output_final_state else None)
