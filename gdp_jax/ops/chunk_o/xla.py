"""The jnp path of chunk_gdp_fwd_o: SPEC's chunked form as batched einsums (any backend).

Differentiated by plain autodiff under implementation="xla".
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def chunk_o_xla(q, k, v, h, g, runs, *, scale: float, chunk_size: int,
                num_householder: int) -> jax.Array:
    """The jnp path: SPEC's chunked form as batched einsums over a [B, NT, BT, ...] view.

    Same arguments as ``pallas_fwd.chunk_o_fwd_pallas`` (g float32 or None, runs int32 run numbers or None);
    returns o [B, T, H, V] in v's dtype, accumulated in float32.
    """
    batch, tokens, heads, key_dim = q.shape
    value_dim, m, bt, out_dtype = v.shape[-1], num_householder, chunk_size, v.dtype
    num_chunks = -(-tokens // bt)
    pad = num_chunks * bt - tokens

    def chunked(x, per_token):  # [B, T*per_token, ...] -> [B, NT, BT, per_token, ...], zero-padded
        x = jnp.pad(x, [(0, 0), (0, pad * per_token)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape((batch, num_chunks, bt, per_token) + x.shape[2:])

    if jax.default_backend() == "cpu":
        # XLA:CPU has no bf16 x bf16 -> f32 dot for every layout; f32 operands are exact anyway.
        q, k, v, h = (x.astype(jnp.promote_types(x.dtype, jnp.float32)) for x in (q, k, v, h))
    qc = chunked(q, 1)[:, :, :, 0]                                   # [B, NT, BT, H, K]
    kc, vc = chunked(k, m), chunked(v, m)                            # [B, NT, BT, M, H, *]
    causal = jnp.tril(jnp.ones((bt, bt), bool))                      # [t, s], diagonal included
    # Padding rows t >= T are masked too: their g is 0, so 2^(g[t]-g[s]) could overflow there.
    real_row = (jnp.arange(num_chunks * bt) < tokens).reshape(num_chunks, bt)
    pair_mask = causal & real_row[:, :, None]                        # [NT, t, s]
    pair_mask = jnp.broadcast_to(pair_mask[None, :, None], (batch, num_chunks, 1, bt, bt))
    row_weight = jnp.ones((batch, num_chunks, 1, bt), jnp.float32)    # weight of q[t]·h[c]
    if runs is not None:
        rc = chunked(runs, 1)[:, :, :, 0]                            # [B, NT, BT]
        pair_mask = pair_mask & (rc[:, :, None, :, None] == rc[:, :, None, None, :])
        row_weight = row_weight * (rc == rc[:, :, :1])[:, :, None, :]
    pair_weight = pair_mask.astype(jnp.float32)
    if g is not None:
        gc = jnp.moveaxis(chunked(g, 1)[:, :, :, 0], 3, 2)          # [B, NT, H, BT]
        # where() before exp2 would still differentiate exp2 of the masked entries; mask the
        # exponent instead so no inf (and no NaN gradient) ever appears.
        exponent = jnp.where(pair_mask, gc[..., :, None] - gc[..., None, :], 0.0)
        pair_weight = jnp.where(pair_mask, jnp.exp2(exponent), 0.0)
        row_weight = row_weight * jnp.exp2(gc)

    f32 = jnp.float32
    scores = jnp.einsum("bnthk,bnsmhk->bnhtsm", qc, kc, preferred_element_type=f32)
    intra = jnp.einsum("bnhtsm,bnsmhv->bnthv", scores * pair_weight[..., None], vc,
                       preferred_element_type=f32)
    inter = jnp.einsum("bnthk,bnhkv->bnthv", qc, h, preferred_element_type=f32)
    inter = inter * jnp.moveaxis(row_weight, 2, 3)[..., None]
    o = scale * (inter + intra)
    return o.reshape(batch, num_chunks * bt, heads, value_dim)[:, :tokens].astype(out_dtype)
