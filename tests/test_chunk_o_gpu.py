"""The Pallas kernel compiled for the GPU (implementation="pallas") against the float64 recurrence.

Skipped without a GPU; run on the H200 before resolving anything that touches a kernel.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from helpers import make_problem, rel_err

pytestmark = pytest.mark.gpu
TOL = {np.float32: 2e-3, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}   # SPEC: tf32 dots / half inputs


def _run(p, **kw):
    return gdp_jax.chunk_gdp_fwd_o(p["q"], p["k"], p["v"], p["h"], p["g"], segment_ids=p["segment_ids"],
                                   chunk_size=p["chunk_size"], implementation="pallas", **kw)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("gated,segments", [(True, True), (False, False), (True, False), (False, True)])
def test_large_against_recurrence(dtype, m, gated, segments):
    p = make_problem(10 * m + gated + 2 * segments, batch=2, tokens=2048 - 37 * (m == 3), heads=4,
                     key_dim=128, value_dim=128, m=m, chunk_size=64, gated=gated, segments=segments,
                     dtype=dtype)
    o = _run(p)
    assert o.dtype == p["v"].dtype and o.shape == p["o_ref"].shape
    assert rel_err(o, p["o_ref"]) < TOL[dtype]


@pytest.mark.parametrize("key_dim,value_dim,chunk_size", [(256, 256, 64), (64, 128, 32), (96, 48, 16),
                                                          (128, 64, 128), (16, 256, 64)])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_widths_and_chunks(key_dim, value_dim, chunk_size, dtype):
    p = make_problem(key_dim + value_dim + chunk_size, batch=2, tokens=333, heads=3, key_dim=key_dim,
                     value_dim=value_dim, m=2, chunk_size=chunk_size, dtype=dtype)
    assert rel_err(_run(p), p["o_ref"]) < TOL[dtype]


def test_jit_vmap_grad_on_gpu():
    p = make_problem(7, batch=3, tokens=200, heads=2, key_dim=64, value_dim=64, m=2, chunk_size=64)
    args = (p["q"], p["k"], p["v"], p["h"], p["g"], p["segment_ids"])

    def op(q, k, v, h, g, seg, impl):
        return gdp_jax.chunk_gdp_fwd_o(q[None], k[None], v[None], h[None], g[None], segment_ids=seg[None],
                                       chunk_size=64, implementation=impl)[0]

    for_rows = lambda impl: jax.jit(jax.vmap(lambda *a: op(*a, impl)))
    assert rel_err(for_rows("pallas")(*args), p["o_ref"]) < 2e-3

    def loss(impl):
        return lambda q, k, v, h, g, seg: jnp.sum(jax.vmap(lambda *a: op(*a, impl))(q, k, v, h, g, seg) ** 2)

    grads = jax.jit(jax.grad(loss("pallas"), argnums=(0, 1, 2, 3, 4)))(*args)
    grads_xla = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2, 3, 4)))(*args)
    for a, b in zip(grads, grads_xla):
        assert rel_err(a, b) < 2e-3
