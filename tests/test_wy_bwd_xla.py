"""wy.wy_bwd_xla (the GPU path's WY backward for compiled float32 inputs, written out) against autodiff of wy.wy_xla, on the
sub-chunk grid it serves (M = 1), for every cotangent, on fresh random inputs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax.wy import wy_bwd_xla, wy_xla
from gdp_jax.wy_pallas import expanded_log2_decays
from helpers import rel_err


@pytest.mark.parametrize("sub_chunk,gated,segments", [(16, True, True), (16, False, False),
                                                      (64, True, False), (64, False, True)])
def test_wy_bwd_xla_matches_autodiff(sub_chunk, gated, segments):
    rng = np.random.default_rng(sub_chunk + 2 * gated + segments)
    batch, positions, heads, key_dim, value_dim = 2, 3 * sub_chunk, 2, 32, 16
    k = rng.normal(size=(batch, positions, heads, key_dim))
    k = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), jnp.float32)
    v = jnp.asarray(rng.normal(size=(batch, positions, heads, value_dim)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.05, 1.95, size=(batch, positions, heads)), jnp.float32)
    gamma = None
    if gated:   # M = 2 tokens' gates on the expanded stream, sub-chunk-local cumsum
        gates = -rng.uniform(0.01, 0.5, size=(batch, positions // 2, heads))
        gamma = expanded_log2_decays(jnp.asarray(gates, jnp.float32), 2, positions, sub_chunk)
    runs = None
    if segments:  # starts inside sub-chunks and on their boundaries
        runs = jnp.asarray(np.sort(rng.integers(0, 7, size=(batch, positions)), axis=1), jnp.int32)
        runs = runs.at[:, sub_chunk:].add(1)
    dw = jnp.asarray(rng.normal(size=k.shape), jnp.float32)
    du = jnp.asarray(rng.normal(size=v.shape), jnp.float32)
    primals = (k, v, beta) + (() if gamma is None else (gamma,))

    def forward(k, v, beta, gamma=None):
        return wy_xla(k, v, beta, gamma, runs, chunk_size=sub_chunk, num_householder=1)

    want = jax.jit(lambda *p: jax.vjp(forward, *p)[1]((dw, du)))(*primals)   # eager is slow
    got = jax.jit(lambda *a: wy_bwd_xla(*a, runs, dw, du, chunk_size=sub_chunk))(k, v, beta, gamma)
    assert (got[3] is None) == (gamma is None)
    for name, a, b in zip(("dk", "dv", "dbeta", "dgamma"), got, want):
        assert a.shape == b.shape and a.dtype == jnp.float32, name
        assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))
