"""Stage 3 of Gated DeltaProduct: walk the chunks of each row in order, carrying the state.

For chunk c (first token c0, last position of the chunk ``last``; padding repeats the last real
token's decay and run so it changes nothing), with w and u from stage 2:

    h[c]          = state carried in, zeroed if a segment starts exactly at c0 (c > 0);
                    initial_state (or zero) for c = 0
    v_new[chunk]  = u - w h[c]
    state out     = d h[c] + sum_j kd[j] v_new[j]^T, where
        d     = [same(last, c0)] 2^gamma_last                (h[c] survives only if no segment
                                                               starts after c0 in the chunk)
        kd[j] = [same(j, last)] 2^(gamma_last - gamma_j) k[j]  (only the last segment is carried)

and the final state is the state out of the last chunk: the state after each row's last token.

Gradients: ``chunk_h`` wraps the walk in one custom_vjp whose backward is either the VJP of the jnp
scan (recomputed) or the reverse-walk kernel of chunk_h_bwd_pallas.py (its docstring derives the
VJP), which starts from the forward's h and v_new.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from gdp_jax._chunking import expand, from_chunks, to_chunks
from gdp_jax.wy import chunk_decays

_HIGHEST = jax.lax.Precision.HIGHEST


def chunk_h_xla(k, w, u, g, runs, initial_state: Optional[jax.Array], *, chunk_size: int,
                num_householder: int):
    """(h [B, NT, H, K, V], v_new [B, T*M, H, V], final_state [B, H, K, V]), all float32.

    k [B, T*M, H, K]; w [B, T*M, H, K] and u [B, T*M, H, V] from ``wy.wy_xla``; g [B, T, H]
    chunk-local log2 decays or None; runs [B, T] int32 run numbers or None; initial_state
    [B, H, K, V] or None. A ``lax.scan`` over chunks: exact gradients by autodiff.
    """
    batch, positions, heads, key_dim = k.shape
    value_dim = u.shape[-1]
    m = num_householder
    tokens = positions // m
    f32 = jnp.float32
    kc = to_chunks(k.astype(f32), chunk_size, m)                  # [B, NT, H, L, K]
    wc = to_chunks(w.astype(f32), chunk_size, m)
    uc = to_chunks(u.astype(f32), chunk_size, m)                  # [B, NT, H, L, V]
    gc, rc = chunk_decays(g, runs, batch, tokens, heads, chunk_size)   # [B, NT, H, BT], [B, NT, BT]
    gamma = expand(gc, m, axis=3)                                 # [B, NT, H, L]
    run = expand(rc, m, axis=2)[:, :, None]                       # [B, NT, 1, L]
    carried = (run == run[..., -1:]).astype(f32)                   # same segment as the last position
    survives = (run[..., 0] == run[..., -1]).astype(f32)           # [B, NT, 1]: no start after c0
    d = survives * jnp.exp2(gamma[..., -1])                       # [B, NT, H]
    kd = (carried * jnp.exp2(gamma[..., -1:] - gamma))[..., None] * kc
    # A segment starting exactly at c0 (c > 0) zeroes the state carried in.
    reset = jnp.concatenate([jnp.zeros((batch, 1), bool), rc[:, 1:, 0] != rc[:, :-1, -1]], axis=1)

    state0 = (jnp.zeros((batch, heads, key_dim, value_dim), f32) if initial_state is None
              else initial_state.astype(f32))
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (wc, uc, kd, d, reset))

    def step(state, x):
        w_c, u_c, kd_c, d_c, reset_c = x
        state = jnp.where(reset_c[:, None, None, None], 0.0, state)
        v_new = u_c - jnp.einsum("bhlk,bhkv->bhlv", w_c, state, precision=_HIGHEST)
        out = d_c[..., None, None] * state + jnp.einsum("bhlk,bhlv->bhkv", kd_c, v_new,
                                                        precision=_HIGHEST)
        return out, (state, v_new)

    final_state, (h, v_new) = jax.lax.scan(step, state0, xs)
    return jnp.moveaxis(h, 0, 1), from_chunks(jnp.moveaxis(v_new, 0, 1), positions), final_state


def chunk_h(k, w, u, g, runs, initial_state, *, chunk_size: int, num_householder: int,
            implementation: str, backward: Optional[str] = None):
    """Stage 3 under one custom_vjp. The forward runs ``implementation`` ("xla", or the Pallas
    kernel as "pallas"/"interpret"); the backward runs ``backward``:

      "pallas"/"interpret": the reverse-walk kernel of chunk_h_bwd_pallas.py (compiled or
        interpreted) plus its chunk-parallel epilogue kernel, from the forward's h and v_new (saved
        as residuals, nothing recomputed);
      "xla": the VJP of the jnp scan, recomputed from the primals.

    ``backward=None`` picks: plain autodiff (no custom_vjp) for implementation="xla"; the
    interpreted kernel for "interpret"; for "pallas" the compiled kernel once
    ``chunk_h_bwd_pallas.USE_ON_GPU`` is set, the jnp VJP until then.

    Same arguments and results as ``chunk_h_xla``; cotangents take their primals' dtypes.
    """
    backward = backward_implementation(implementation, backward)
    if backward is None:   # plain autodiff, no recomputation
        return chunk_h_xla(k, w, u, g, runs, initial_state, chunk_size=chunk_size,
                           num_householder=num_householder)
    return _chunk_h(k, w, u, g, runs, initial_state,
                    (chunk_size, num_householder, implementation, backward))


def backward_implementation(implementation: str, backward: Optional[str] = None) -> Optional[str]:
    """The backward chunk_h runs (see ``chunk_h``); None means plain autodiff of chunk_h_xla."""
    if backward is not None:
        return backward
    if implementation == "xla":
        return None
    from gdp_jax import chunk_h_bwd_pallas
    if implementation == "pallas" and not chunk_h_bwd_pallas.USE_ON_GPU:
        return "xla"
    return implementation


def _chunk_h_forward(k, w, u, g, runs, initial_state, config):
    chunk_size, num_householder, implementation, _ = config
    kwargs = dict(chunk_size=chunk_size, num_householder=num_householder)
    if implementation == "xla":
        return chunk_h_xla(k, w, u, g, runs, initial_state, **kwargs)
    from gdp_jax.chunk_h_pallas import chunk_h_pallas
    return chunk_h_pallas(k, w, u, g, runs, initial_state,
                          interpret=implementation == "interpret", **kwargs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _chunk_h(k, w, u, g, runs, initial_state, config):
    return _chunk_h_forward(k, w, u, g, runs, initial_state, config)


def _chunk_h_fwd(k, w, u, g, runs, initial_state, config):
    outputs = _chunk_h_forward(k, w, u, g, runs, initial_state, config)
    if config[3] == "xla":
        return outputs, (k, w, u, g, runs, initial_state)
    h, v_new, _ = outputs
    # The kernel needs the forward's h and v_new, not u: keep only u's dtype (a scalar).
    return outputs, (k, w, jnp.zeros((), u.dtype), g, runs, initial_state, h, v_new)


def _chunk_h_bwd(config, residuals, cotangents):
    chunk_size, num_householder, _, backward = config
    kwargs = dict(chunk_size=chunk_size, num_householder=num_householder)
    if backward != "xla":
        k, w, u_dtype, g, runs, initial_state, h, v_new = residuals
        from gdp_jax.chunk_h_bwd_pallas import chunk_h_bwd_pallas
        dk, dw, du, dg, dinit = chunk_h_bwd_pallas(
            k, w, g, runs, h, v_new, *cotangents, with_initial_state=initial_state is not None,
            interpret=backward == "interpret", **kwargs)
        cast = lambda x, primal: None if primal is None else x.astype(primal.dtype)
        return (cast(dk, k), cast(dw, w), cast(du, u_dtype), cast(dg, g), None,
                cast(dinit, initial_state))

    k, w, u, g, runs, initial_state = residuals
    names = ["k", "w", "u"] + (["g"] if g is not None else []) \
        + (["initial_state"] if initial_state is not None else [])
    primals = dict(k=k, w=w, u=u, g=g, initial_state=initial_state)

    def jnp_path(*args):
        full = dict(primals, **dict(zip(names, args)))
        return chunk_h_xla(full["k"], full["w"], full["u"], full["g"], runs, full["initial_state"],
                           **kwargs)

    _, vjp = jax.vjp(jnp_path, *[primals[n] for n in names])
    grads = dict(zip(names, vjp(cotangents)))
    cast = lambda name: None if primals[name] is None else grads[name].astype(primals[name].dtype)
    return cast("k"), cast("w"), cast("u"), cast("g"), None, cast("initial_state")


_chunk_h.defvjp(_chunk_h_fwd, _chunk_h_bwd)
