"""The ops under jax_enable_x64, as a user who builds a float64 reference beside them runs them.

64-bit mode makes Python-int indices int64, while Pallas' program ids stay int32; the interpreter
slices a ref with all its indices in one dynamic_slice, which refuses the mix. Every kernel's
indices must agree (chunk_o_pallas._index). float64 inputs are not what the compiled kernels were
built for (2- and 4-byte tiles, float32 accumulation): "pallas" and "interpret" run the jnp path
for them (this host has no GPU, so a "pallas" call that reached a kernel would fail here).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax.chunk_o_bwd_pallas import BwdKernelConfig, chunk_o_bwd_pallas
from gdp_jax.chunk_o_pallas import chunk_o_pallas, kernel_config
from gdp_jax.segments import segment_runs
from helpers import make_problem, rel_err

KEY_DIM, VALUE_DIM, CHUNK, M = 32, 32, 16, 2


@pytest.fixture(scope="module")
def problem():
    return make_problem(71, batch=2, tokens=45, heads=2, key_dim=KEY_DIM, value_dim=VALUE_DIM, m=M,
                        chunk_size=CHUNK, gated=True, segments=True)


def _primals(p):
    return [p[name] for name in ("q", "k", "v", "h", "g")]


def _in_both_modes(fn):
    """fn's outputs (a tuple of arrays), jitted, with 64-bit mode off and then on."""
    off = [np.asarray(x) for x in jax.jit(fn)()]
    with jax.enable_x64(True):
        on = [np.asarray(x) for x in jax.jit(fn)()]
    return off, on


# The index sources that differ: the loop over several chunks per program (its trip count comes
# from a program id), the loop over K, the loop over value columns, v loaded before the K loop.
@pytest.mark.parametrize("overrides", [
    dict(block_k=0, chunks_per_program=4), dict(block_k=16, chunks_per_program=2),
    dict(block_k=16, value_step=16), dict(block_k=16, block_v=16, value_blocks_per_program=1,
                                          prefetch_values=True)])
def test_forward_kernel(problem, overrides):
    config = kernel_config(KEY_DIM, VALUE_DIM, CHUNK, M, **overrides)
    runs = segment_runs(problem["segment_ids"])
    off, on = _in_both_modes(lambda: (chunk_o_pallas(
        *_primals(problem), runs, scale=KEY_DIM ** -0.5, chunk_size=CHUNK, num_householder=M,
        interpret=True, config=config),))
    assert rel_err(on[0], problem["o_ref"]) < 1e-5
    np.testing.assert_array_equal(on[0], off[0])


# The fused kernel and the role kernels (whose static copy index is made from a program id).
@pytest.mark.parametrize("variant,roles", [("fused", None), ("roles", "dh|dq|dkv/m"),
                                           ("split_state", "dq|dkv/m")])
def test_backward_kernels(problem, variant, roles):
    config = BwdKernelConfig(block_k=16, block_v=16, variant=variant, roles=roles, num_warps=4,
                             num_stages=1)
    runs = segment_runs(problem["segment_ids"])
    do = jnp.asarray(np.random.default_rng(5).normal(size=problem["o_ref"].shape), jnp.float32)
    off, on = _in_both_modes(lambda: chunk_o_bwd_pallas(
        *_primals(problem), runs, do, scale=KEY_DIM ** -0.5, chunk_size=CHUNK, num_householder=M,
        interpret=True, config=config))
    for name, got, want in zip(("dq", "dk", "dv", "dh", "dg"), on, off):
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_chunk_o_op_float32_and_float64_inputs(problem):
    """The op under 64-bit mode: float32 inputs through the interpreted kernels equal the same call
    without it; float64 inputs give float64 outputs and gradients, the jnp path's on every
    implementation (the fixture's inputs are float32-rounded, hence the reference's 1e-6)."""
    segment_ids = problem["segment_ids"]

    def value_and_grads(implementation, dtype):
        def loss(q, k, v, h, g):
            o = gdp_jax.chunk_gdp_fwd_o(q, k, v, h, g, segment_ids=segment_ids, chunk_size=CHUNK,
                                        implementation=implementation)
            return jnp.sum(o * o), o
        args = [jnp.asarray(np.asarray(x, np.float64), dtype) for x in _primals(problem)]
        (_, o), grads = jax.value_and_grad(loss, argnums=range(5), has_aux=True)(*args)
        return (o,) + grads

    off, on = _in_both_modes(lambda: value_and_grads("interpret", jnp.float32))
    for got, want in zip(on, off):
        np.testing.assert_array_equal(got, want)
    with jax.enable_x64(True):
        results = {impl: jax.jit(lambda impl=impl: value_and_grads(impl, jnp.float64))()
                   for impl in ("xla", "pallas", "interpret")}
    for impl, outs in results.items():
        assert all(x.dtype == jnp.float64 for x in outs), impl
        assert rel_err(outs[0], problem["o_ref"]) < 1e-6, impl
        for got, want in zip(outs, results["xla"]):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=impl)


def test_full_op(problem):
    """chunk_gated_delta_product, forward and all gradients, through the interpreted kernels under
    64-bit mode, equals the same call without it; float64 inputs run the jnp stages on every
    implementation."""
    rng = np.random.default_rng(9)
    batch, tokens, heads = problem["q"].shape[:3]
    k = rng.normal(size=(batch, tokens * M, heads, KEY_DIM))
    args = [rng.normal(size=(batch, tokens, heads, KEY_DIM)), k / np.linalg.norm(k, axis=-1, keepdims=True),
            rng.normal(size=(batch, tokens * M, heads, VALUE_DIM)),
            -rng.uniform(0, 0.25, size=(batch, tokens, heads)),
            rng.uniform(0.05, 1.95, size=(batch, tokens * M, heads)),
            0.5 * rng.normal(size=(batch, heads, KEY_DIM, VALUE_DIM))]

    def value_and_grads(implementation, dtype):
        def loss(q, k, v, g, beta, h0):
            o, final_state = gdp_jax.chunk_gated_delta_product(
                q, k, v, g, beta, initial_state=h0, output_final_state=True,
                segment_ids=problem["segment_ids"], chunk_size=CHUNK, implementation=implementation)
            return jnp.sum(o * o) + jnp.sum(final_state), (o, final_state)
        (_, aux), grads = jax.value_and_grad(loss, argnums=range(6), has_aux=True)(
            *[jnp.asarray(x, dtype) for x in args])
        return aux + grads

    # Not bit for bit: the full op's pure jnp path ("xla") also moves by float32 rounding between
    # the two modes (up to 4e-6 here); which of its stages does was not traced.
    off, on = _in_both_modes(lambda: value_and_grads("interpret", jnp.float32))
    for got, want in zip(on, off):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, np.abs(want).max()))
    with jax.enable_x64(True):
        results = {impl: jax.jit(lambda impl=impl: value_and_grads(impl, jnp.float64))()
                   for impl in ("xla", "pallas", "interpret")}
    for impl, outs in results.items():
        # final_state is float32 by contract; o and every gradient follow their float64 inputs.
        assert [x.dtype for x in outs] == [jnp.float64, jnp.float32] + [jnp.float64] * 6, impl
        for got, want in zip(outs, results["xla"]):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=impl)
