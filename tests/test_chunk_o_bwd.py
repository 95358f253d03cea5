"""chunk_gdp_fwd_o's gradients on CPU: the public op's custom_vjp ("xla": autodiff of the jnp path;
"interpret": the Pallas backward kernel interpreted) and ``chunk_o_bwd_pallas`` called directly,
fused and split (``BlockSizes(split=True)``), with key and value blocks.

Reference: float64 autodiff of ``cases.dense_chunked_form``, an independent dense statement of
SPEC's chunked form, itself checked against the recurrence below.
"""
import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax.ops.chunk_o.pallas_bwd import BlockSizes, chunk_o_bwd_pallas, default_block_sizes
from gdp_jax.ops.cumsum import chunk_local_log2_cumsum
from cases import (CHUNK_O_NAMES, Case, assert_all_close, assert_close, build, cotangent,
                   dense_chunked_form, dense_chunked_grads, random_segment_ids, run_numbers, seed_of,
                   tolerance)

IMPLEMENTATIONS = ["xla", "interpret"]
GRAD_CASE = Case(77, 32, 16, 2, 16)        # g, segments, initial state, float32


def test_dense_chunked_form_matches_recurrence():
    """The gradient reference is only as good as its forward: it reproduces the recurrence."""
    p = build(GRAD_CASE)
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in p.chunk_o_args()]
        runs = run_numbers(p.raw["segment_ids"], GRAD_CASE.batch, GRAD_CASE.tokens)
        o = dense_chunked_form(*args, runs, scale=p.scale, chunk_size=16)
    assert_close(o, p.ref["o"], tolerance("float32"))      # inputs were rounded to float32


def _reference(p, do, names=CHUNK_O_NAMES, **overrides):
    args = dict(zip(CHUNK_O_NAMES, p.chunk_o_args()), **overrides)
    _, grads = dense_chunked_grads(*[args[n] for n in CHUNK_O_NAMES], p.segment_ids, do,
                                   scale=p.scale, chunk_size=p.case.chunk_size)
    return {n: grads[n] for n in names}


def _op(implementation, chunk_size=16):
    return functools.partial(gdp_jax.chunk_gdp_fwd_o, chunk_size=chunk_size,
                             implementation=implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("gated", [True, False], ids=["g", "nog"])
def test_op_gradients(implementation, gated):
    """Gradients in q, k, v, h (and g): each in its primal's dtype and shape; without g the
    cotangent of g is None. Integer segment_ids ride along through grad and jit."""
    p = build(GRAD_CASE)
    do = cotangent(p.ref["o"].shape, 1)
    g = p.g if gated else None
    names = CHUNK_O_NAMES if gated else CHUNK_O_NAMES[:4]

    def loss(q, k, v, h, g, segment_ids):
        return jnp.sum(_op(implementation)(q, k, v, h, g, segment_ids=segment_ids) * do)

    if gated:
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(p.q, p.k, p.v_new, p.h, g,
                                                                 p.segment_ids)
    else:
        _, vjp = jax.vjp(jax.jit(lambda *a: _op(implementation)(*a, segment_ids=p.segment_ids)),
                         p.q, p.k, p.v_new, p.h, None)
        *grads, dg = vjp(do)
        assert dg is None
    grads = dict(zip(names, grads))
    for name, x in zip(names, (p.q, p.k, p.v_new, p.h, g)):
        chex.assert_equal_shape([grads[name], x])
        chex.assert_type(grads[name], x.dtype)
    assert_all_close(grads, _reference(p, do, names, g=g), tolerance("float32"))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_op_gradient_dtypes_follow_primals_bf16(implementation):
    """bf16 q, k, v with float32 h and g: each cotangent takes its own primal's dtype."""
    p = build(GRAD_CASE.replace(dtype="bfloat16"))
    h = p.h.astype(jnp.float32)
    do = cotangent(p.ref["o"].shape, 3, jnp.bfloat16)
    o, vjp = jax.vjp(jax.jit(lambda *a: _op(implementation)(*a, segment_ids=p.segment_ids)),
                     p.q, p.k, p.v_new, h, p.g)
    chex.assert_type(o, jnp.bfloat16)
    grads = vjp(do)
    chex.assert_type(grads, [jnp.bfloat16] * 3 + [jnp.float32] * 2)
    assert_all_close(dict(zip(CHUNK_O_NAMES, grads)), _reference(p, do, h=h),
                     tolerance("bfloat16"))


def _rows_as_leading_axis(p):
    """[B, ...] -> [B, 1, ...]: vmap over B, each call sees batch size 1 with its own packing."""
    return [x[:, None] for x in (p.q, p.k, p.v_new, p.h, p.g, p.segment_ids)]


@pytest.mark.parametrize("implementation", ["interpret"])
def test_vmap_over_differently_packed_rows(implementation):
    """jit(vmap) of the op over rows packed differently (forward), and grad of it: vmap of the
    Pallas kernels (an extra grid axis) and of the custom_vjp (the jnp path under vmap is plain
    JAX; its forward under vmap: test_full_op.py)."""
    p = build(GRAD_CASE)
    assert not np.array_equal(p.segment_ids[0], p.segment_ids[1])
    one_row = lambda q, k, v, h, g, ids: _op(implementation)(q, k, v, h, g, segment_ids=ids)
    rows = _rows_as_leading_axis(p)
    o = jax.jit(jax.vmap(one_row))(*rows)
    chex.assert_shape(o, (2, 1) + p.ref["o"].shape[1:])
    assert_close(o[:, 0], p.ref["o"], tolerance("float32"))

    do = cotangent(p.ref["o"].shape, 4)
    loss = lambda *a: jnp.sum(jax.vmap(one_row)(*a) * do[:, None])
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*rows)
    assert_all_close({n: x[:, 0] for n, x in zip(CHUNK_O_NAMES, grads)}, _reference(p, do),
                     tolerance("float32"))


def test_checkpoint_under_grad():
    """jax.checkpoint around the op's custom_vjp (the jnp path under it is plain autodiff)."""
    p = build(GRAD_CASE)
    do = cotangent(p.ref["o"].shape, 5)
    op = jax.checkpoint(_op("interpret"))
    loss = lambda q, k, v, h, g, ids: jnp.sum(op(q, k, v, h, g, segment_ids=ids) * do)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*p.chunk_o_args(), p.segment_ids)
    assert_all_close(dict(zip(CHUNK_O_NAMES, grads)), _reference(p, do), tolerance("float32"))


# ---------------------------------------------------------------------------------------------
# chunk_o_bwd_pallas called directly (interpreted). The VJP needs no consistent (h, v_new), so
# these inputs skip the recurrence: random q, k, v, h, decays and packings of the case.

def kernel_inputs(case: Case, *, h_dtype=None, g=None):
    """(q, k, v, h, g, runs, do) in the case's dtype (h in ``h_dtype`` if given; g float32);
    the same values for the same arguments (tests on one case share inputs and reference)."""
    if g is None:
        return _kernel_inputs(case, None if h_dtype is None else jnp.dtype(h_dtype))
    return _kernel_inputs.__wrapped__(case, h_dtype, g)


@functools.lru_cache(maxsize=None)
def _kernel_inputs(case: Case, h_dtype, g=None):
    rng = np.random.default_rng(seed_of("chunk_o_bwd", case.id, h_dtype))
    b, t, hd, kd, vd, m = case.batch, case.tokens, case.heads, case.key_dim, case.value_dim, case.m
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
    k = normal(b, t * m, hd, kd)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    if g is None and case.gated:
        g_raw = -rng.uniform(0.0, 0.25, size=(b, t, hd)).astype(np.float32)
        g = chunk_local_log2_cumsum(jnp.asarray(g_raw), case.chunk_size)
    runs = None
    if case.segments:
        runs = gdp_jax.segment_runs(jnp.asarray(random_segment_ids(rng, b, t, case.chunk_size)))
    cast = lambda x, dtype=case.jnp_dtype: jnp.asarray(x, dtype)
    return (cast(normal(b, t, hd, kd)), cast(k), cast(normal(b, t * m, hd, vd)),
            cast(0.5 * normal(b, case.num_chunks, hd, kd, vd), h_dtype or case.jnp_dtype),
            g, runs, cast(normal(b, t, hd, vd)))


def bound_kernel(case, block_sizes):
    """chunk_o_bwd_pallas(q, k, v, h, g, runs, do) interpreted, with the case's static options."""
    return functools.partial(chunk_o_bwd_pallas, scale=case.key_dim ** -0.5,
                             chunk_size=case.chunk_size, num_householder=case.m, interpret=True,
                             block_sizes=block_sizes)


def check_kernel(case, block_sizes=None, *, h_dtype=None, g=None, kernel=None):
    """The kernel's (dq, dk, dv, dh, dg) against float64 autodiff of the dense form: shapes,
    dtypes (the primals', dg float32) and SPEC's bound for the case's dtype."""
    q, k, v, h, g, runs, do = args = kernel_inputs(case, h_dtype=h_dtype, g=g)
    got = dict(zip(CHUNK_O_NAMES, (kernel or bound_kernel(case, block_sizes))(*args)))
    want = _kernel_reference(case, args)
    for name, primal in zip(CHUNK_O_NAMES, (q, k, v, h, g)):
        if primal is None:
            assert got[name] is None, name
            continue
        chex.assert_equal_shape([got[name], primal])
        chex.assert_type(got[name], jnp.float32 if name == "g" else primal.dtype)
    assert_all_close(got, want, tolerance(case.dtype))


_KERNEL_REFERENCES = {}


def _kernel_reference(case, args):
    """float64 autodiff of the dense form at kernel_inputs' values, once per input set."""
    if id(args) not in _KERNEL_REFERENCES:
        q, k, v, h, g, runs, do = args
        _KERNEL_REFERENCES[id(args)] = (args, dense_chunked_grads(
            q, k, v, h, g, runs, do, scale=case.key_dim ** -0.5, chunk_size=case.chunk_size)[1])
    return _KERNEL_REFERENCES[id(args)][1]


def _blocks(block_k=16, block_v=16, split=False):
    return BlockSizes(block_k=block_k, block_v=block_v, num_warps=4, split=split)


# Every (g, segments) combination with M = 1..3, ragged and whole last chunks, chunk 16 and 32,
# K != V both ways; the fused and the split structure on the same inputs (one reference), with a
# single block and with K and V split into 16-wide blocks (2 x 4 at K = 32, V = 64).
_A = Case(77, 32, 64, 3, 16)                                           # g, segments
_B = Case(64, 16, 32, 2, 32, gated=False, segments=False)
_C = Case(77, 32, 16, 1, 16, segments=False)
_D = Case(64, 16, 32, 3, 32, gated=False)
KERNEL_CASES = {
    "fused-default-M3-g-seg": (_A, None),
    "fused-blocks-2x4-M3-g-seg": (_A, _blocks()),
    "split-blocks-2x4-M3-g-seg": (_A, _blocks(split=True)),
    "fused-default-M2-nog-noseg": (_B, None),
    "split-one-block-M2-nog-noseg": (_B, _blocks(16, 32, split=True)),
    "fused-default-M1-g-noseg": (_C, None),
    "split-blocks-M1-g-noseg": (_C, _blocks(split=True)),
    "fused-default-M3-nog-seg": (_D, None),
    "split-blocks-M3-nog-seg": (_D, _blocks(split=True)),
}


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_float32(name):
    case, block_sizes = KERNEL_CASES[name]
    check_kernel(case, block_sizes)


@pytest.mark.parametrize("split,m,h_dtype", [(False, 3, None), (True, 2, jnp.float32)],
                         ids=["fused-M3-h-bf16", "split-M2-h-f32"])
def test_kernel_bfloat16(split, m, h_dtype):
    """bf16 q, k, v, do (bf16 dots, float32 accumulation); h in bf16 or float32."""
    check_kernel(Case(77, 32, 16, m, 16, dtype="bfloat16"),
                 _blocks(16, 16, split=split), h_dtype=h_dtype)


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_strong_decay_in_partial_chunk_stays_finite(split):
    """Padding rows of the last chunk must not form 2^(0 - g[s]) = inf (inf * 0 = NaN in dk, dv, dg):
    two steps of -100 (log2) near the end of the partial last chunk put g below -128 there."""
    case = Case(40, 16, 16, 2, 16, gated=False, segments=False, batch=1)
    steps = np.full((1, case.tokens, case.heads), -0.5, np.float32)
    steps[:, case.tokens - 2:] = -100.0
    g = jnp.asarray(np.concatenate([np.cumsum(steps[:, i:i + 16], axis=1)
                                    for i in range(0, case.tokens, 16)], axis=1))
    assert float(g.min()) < -128
    check_kernel(case, _blocks(split=split), g=g)   # rel_err refuses NaN and inf


class KernelJitTest(chex.TestCase):
    """The kernel call eager and under jit (the split structure: its wrapper also sums the two dg
    slots), against the reference."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_kernel_with_and_without_jit(self):
        case = Case(50, 16, 16, 2, 16, batch=1)
        check_kernel(case, kernel=self.variant(bound_kernel(case, _blocks(split=True))))


def test_default_block_sizes_table():
    """The backward's launch table (RESULTS.md, "chunk_o backward launch table")."""
    table = lambda *a: dataclasses.astuple(default_block_sizes(*a))
    # (block_k, block_v, num_warps, num_stages, split)
    assert table(64, 64, 64, 2) == (64, 64, 4, 1, False)       # 16-bit, chunk 64, small: fused
    assert table(128, 128, 64, 2) == (128, 128, 4, 1, True)    # 16-bit, chunk <= 64: split
    assert table(128, 128, 32, 2) == (128, 128, 4, 1, True)
    assert table(64, 64, 32, 2) == (64, 64, 4, 1, True)        # "small" is chunk 64 only
    assert table(256, 256, 64, 2) == (64, 64, 4, 1, True)      # K = 256: 64 keys, 64 values
    assert table(256, 256, 64, 2, False) == (128, 64, 4, 1, True)   # 64-wide keys gated only
    assert table(256, 256, 32, 2) == (128, 64, 4, 1, True)     # 64-wide keys at chunk 64 only
    assert table(128, 128, 64, 4) == (128, 128, 8, 1, False)   # float32: fused, 8 warps
    assert table(128, 128, 16, 4) == (128, 128, 4, 1, False)
    assert table(256, 256, 128, 4) == (64, 64, 8, 1, False)    # float32 at chunk 128: 64 x 64
    assert table(128, 128, 128, 2) == (128, 128, 8, 1, False)  # chunk 128: fused
    for key_dim in (16, 64, 128, 256):
        for value_dim in (16, 64, 256):
            for chunk_size in (16, 64, 128):
                for itemsize in (2, 4):
                    default_block_sizes(key_dim, value_dim, chunk_size, itemsize).check(
                        key_dim, value_dim)
