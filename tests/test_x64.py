"""The ops under jax_enable_x64, as a user who builds a float64 reference beside them runs them.

64-bit mode makes Python-int indices int64, while Pallas' program ids stay int32; the interpreter
slices a ref with all its indices in one dynamic_slice, which refuses the mix, so every kernel's
indices must agree (``_src.pallas.index``). float64 inputs are not what the compiled kernels were
built for (2- and 4-byte tiles, float32 accumulation): "pallas" and "interpret" run the jnp path
for them (this host has no GPU, so a "pallas" call that reached a kernel would fail here).
"""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
import gdp_jax._src.mosaic
from gdp_jax.ops.chunk_o import pallas_bwd, pallas_fwd
from cases import (GRAD_NAMES, Case, assert_all_close, assert_close, build, cotangent,
                   recurrence_grads, tolerance)

CASE = Case(45, 32, 32, 2, 16)          # ragged T, g, segments


def _in_both_modes(fn):
    """fn's outputs (a tuple of arrays), jitted, with 64-bit mode off and then on."""
    off = [np.asarray(x) for x in jax.jit(fn)()]
    with jax.enable_x64(True):
        on = [np.asarray(x) for x in jax.jit(fn)()]
    return off, on


# The forward kernel's index sources that differ: the loop over several chunks per program (its
# trip count comes from a program id), with and without the loop over K, and the loop over value
# columns (the other variants' offsets are static).
@pytest.mark.parametrize("sizes", [
    pallas_fwd.BlockSizes(block_v=32, value_blocks_per_program=1, chunks_per_program=4),
    pallas_fwd.BlockSizes(block_v=32, value_blocks_per_program=1, block_k=16, value_step=16,
                          chunks_per_program=2),
], ids=["chunks-4", "k-loop-value-step-chunks-2"])
def test_forward_kernel(sizes):
    p = build(CASE)
    off, on = _in_both_modes(lambda: (pallas_fwd.chunk_o_fwd_pallas(
        p.q, p.k, p.v_new, p.h, p.g, p.runs, scale=p.scale, chunk_size=16, num_householder=2,
        interpret=True, block_sizes=sizes),))
    assert_close(on[0], p.ref["o"], tolerance("float32"))
    chex.assert_trees_all_equal(on, off)


# The fused kernel and the split one (whose static copy index is made from a program id).
@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_backward_kernels(split):
    p = build(CASE)
    sizes = pallas_bwd.BlockSizes(block_k=16, block_v=16, num_warps=4, split=split)
    do = cotangent(p.ref["o"].shape, 5)
    off, on = _in_both_modes(lambda: pallas_bwd.chunk_o_bwd_pallas(
        p.q, p.k, p.v_new, p.h, p.g, p.runs, do, scale=p.scale, chunk_size=16, num_householder=2,
        interpret=True, block_sizes=sizes))
    chex.assert_trees_all_equal(on, off)


@pytest.mark.skipif(not gdp_jax._src.mosaic.has_interpreter(),
                    reason="this jax has no Mosaic GPU interpreter")
def test_mosaic_forward_kernel():
    """The Mosaic GPU forward's indices (grid axis indices, slot and chunk offsets) under 64-bit
    mode: the same bits as without it."""
    p = build(Case(100, 64, 64, 3, 64, dtype="bfloat16"))
    off, on = _in_both_modes(lambda: (gdp_jax.chunk_gdp_fwd_o(
        *p.chunk_o_args(), segment_ids=p.segment_ids, implementation="mosaic_interpret"),))
    assert_close(on[0], p.ref["o"], tolerance("bfloat16"))
    chex.assert_trees_all_equal(on, off)


def test_chunk_o_op_float32_and_float64_inputs():
    """The op under 64-bit mode: float32 inputs through the interpreted kernels give the same bits
    as without it; float64 inputs give float64 outputs and gradients, the jnp path's on every
    implementation."""
    p = build(CASE)

    def value_and_grads(implementation, dtype):
        def loss(q, k, v, h, g):
            o = gdp_jax.chunk_gdp_fwd_o(q, k, v, h, g, segment_ids=p.segment_ids, chunk_size=16,
                                        implementation=implementation)
            return jnp.sum(o * o), o
        args = [jnp.asarray(np.asarray(x, np.float64), dtype) for x in p.chunk_o_args()]
        (_, o), grads = jax.value_and_grad(loss, argnums=range(5), has_aux=True)(*args)
        return (o,) + grads

    off, on = _in_both_modes(lambda: value_and_grads("interpret", jnp.float32))
    chex.assert_trees_all_equal(on, off)
    with jax.enable_x64(True):
        results = {impl: jax.jit(functools.partial(value_and_grads, impl, jnp.float64))()
                   for impl in ("xla", "pallas", "interpret")}
    for impl, outs in results.items():
        chex.assert_type(outs, [jnp.float64] * 6)
        assert_close(outs[0], p.ref["o"], tolerance("float64"), impl)
        chex.assert_trees_all_equal(outs, results["xla"])


def test_full_op():
    """chunk_gated_delta_product, forward and all gradients, through the interpreted kernels (WY,
    walk and chunk_o, forward and backward) under 64-bit mode: the recurrence's o, final state
    and gradients (float32 inputs). float64 inputs run the jnp stages: float64 o and gradients,
    float32 final state (by contract)."""
    p = build(Case(21, 16, 16, 2, 16))
    do, dfinal, expected = recurrence_grads(p)

    def value_and_grads(implementation, dtype):
        def loss(q, k, v, g, beta, h0):
            o, final_state = gdp_jax.chunk_gated_delta_product(
                q, k, v, g, beta, initial_state=h0, output_final_state=True,
                segment_ids=p.segment_ids, chunk_size=16, implementation=implementation)
            return (jnp.sum(o * do.astype(dtype)) + jnp.sum(final_state * dfinal.astype(np.float32)),
                    (o, final_state))
        args = [jnp.asarray(np.asarray(x, np.float64), dtype) for x in (*p.full_args(), p.initial_state)]
        (_, aux), grads = jax.value_and_grad(loss, argnums=range(6), has_aux=True)(*args)
        return aux + grads

    with jax.enable_x64(True):
        on = jax.jit(functools.partial(value_and_grads, "interpret", jnp.float32))()
        chex.assert_type(on, [jnp.float32] * 8)
        assert_close(on[0], p.ref["o"], tolerance("float32"), "o")
        assert_close(on[1], p.ref["final_state"], tolerance("float32"), "final_state")
        assert_all_close(dict(zip(GRAD_NAMES, on[2:])), expected, tolerance("float32"))
        # "pallas" and "interpret" take the jnp path for float64 by the same rule
        # (dispatch.states_implementation and chunk_o_implementation: test_full_op.py and
        # test_chunk_o.py; chunk_o's "pallas" float64 call runs above).
        # The dtypes of o, the final state and every gradient (traced only), and the values of o
        # and the final state (the float64 inputs' jnp stages compute in float32, as for float32
        # inputs, whose gradients are checked above).
        shapes = jax.eval_shape(functools.partial(value_and_grads, "xla", jnp.float64))
        f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
        o, final_state = jax.jit(lambda *a: gdp_jax.chunk_gated_delta_product(
            *a[:5], initial_state=a[5], output_final_state=True, segment_ids=p.segment_ids,
            chunk_size=16, implementation="xla"))(*[f64(x) for x in (*p.full_args(), p.initial_state)])
    chex.assert_type(shapes, [jnp.float64, jnp.float32] + [jnp.float64] * 6)
    chex.assert_type([o, final_state], [jnp.float64, jnp.float32])
    assert_close(o, p.ref["o"], tolerance("float64"), "o")
    assert_close(final_state, p.ref["final_state"], tolerance("float64"), "final_state")
