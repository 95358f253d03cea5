"""chunk_gdp_fwd_o's Mosaic GPU kernels on CPU, in Mosaic GPU's interpreter
(implementation="mosaic_interpret", or the kernel functions with interpret=True), and the routing
rule of "mosaic".

The interpreter runs the kernels' copies, indexing, masks and sums; the compiled form's register
layouts, transposed wgmma operands and synchronisation are checked by the GPU tests
(test_gpu.py). References are the float64 recurrence (forward) and float64 autodiff of the dense
chunked form (gradients).
"""
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax._src import dispatch, mosaic
from gdp_jax._src.layout import l2norm_and_factor
from gdp_jax._src.segments import segment_runs
from gdp_jax.ops.chunk_o import mosaic_bwd
from gdp_jax.ops.chunk_o.mosaic_bwd import chunk_o_bwd_mosaic
from gdp_jax.ops.chunk_o.mosaic_fwd import BlockSizes, chunk_o_fwd_mosaic, default_block_sizes
from cases import (CHUNK_O_NAMES, Case, assert_all_close, assert_close, build, case_id,
                   cotangent, dense_chunked_grads, rel_err, run_chunk_o, tolerance)
from test_chunk_o_bwd import check_kernel, kernel_inputs
from test_full_op import check_gradients, kernel_names

needs_interpreter = pytest.mark.skipif(not mosaic.has_interpreter(),
                                       reason="this jax has no Mosaic GPU interpreter")

# 16-bit inputs at chunk 64 (what the kernel takes): every M with and without g and segments,
# ragged T and whole chunks, K != V both ways, widths padded to 64 (48, 100) and the 64-wide
# value programs of K = 256.
CASES = [
    Case(150, 64, 128, 2, 64, dtype="bfloat16"),
    Case(128, 128, 64, 3, 64, dtype="bfloat16", segments=False),
    Case(77, 48, 100, 1, 64, dtype="float16", gated=False),
    Case(64, 64, 64, 1, 64, dtype="bfloat16", gated=False, segments=False, heads=3),
    Case(70, 256, 192, 3, 64, dtype="bfloat16", batch=1, heads=1),
]


def assert_runs_mosaic(case):
    """The case reaches the Mosaic kernel: without this a routing change would let the tests below
    pass on the Triton kernel."""
    assert dispatch.chunk_o_implementation(
        "mosaic_interpret", case.jnp_dtype, case.key_dim, case.value_dim, case.chunk_size,
        case.jnp_dtype) == "mosaic_interpret", case


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_against_recurrence(case):
    assert_runs_mosaic(case)
    p = build(case)
    o = run_chunk_o(p, "mosaic_interpret")
    chex.assert_shape(o, (case.batch, case.tokens, case.heads, case.value_dim))
    chex.assert_type(o, case.jnp_dtype)
    assert_close(o, p.ref["o"], tolerance(case.dtype), "o")


@needs_interpreter
def test_many_segments_and_one_token_chunk():
    """Segments of 1-9 tokens (several per chunk, some crossing chunk boundaries) and T = 2 chunks
    + 1 token: the state term reaches only the segment live at each chunk's start."""
    case = Case(129, 64, 64, 2, 64, dtype="bfloat16")
    rng = np.random.default_rng(3)
    ids = np.cumsum(rng.random((case.batch, case.tokens)) < 0.3, axis=1).astype(np.int32)
    assert (ids[:, -1] > 20).all()
    p = build(case, segment_ids=ids)
    assert_close(run_chunk_o(p, "mosaic_interpret"), p.ref["o"], tolerance(case.dtype))


@needs_interpreter
@pytest.mark.parametrize("sizes", [BlockSizes(block_v=64, slots=1),
                                   BlockSizes(block_v=64, slots=3),
                                   BlockSizes(block_v=128, slots=1, h_in_copy_slots=True),
                                   BlockSizes(block_v=64, slots=2, h_in_copy_slots=True)],
                         ids=["one_slot", "three_slots", "h_in_one_slot", "h_in_two_slots"])
def test_block_sizes_in_interpreter(sizes):
    """The slot schedule (copies reusing a slot after both its reads), value programs narrower
    than V, and h loaded into the slots once the copies are read give the same outputs as the
    default launch."""
    case = Case(100, 64, 128, 3, 64, dtype="bfloat16", batch=1)
    p = build(case)
    q, k, v, h, g = p.chunk_o_args()
    runs = segment_runs(jnp.asarray(p.segment_ids))
    kwargs = dict(scale=p.scale, chunk_size=64, num_householder=3, interpret=True)
    got = chunk_o_fwd_mosaic(q, k, v, h, g, runs, block_sizes=sizes, **kwargs)
    want = chunk_o_fwd_mosaic(q, k, v, h, g, runs, **kwargs)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert_close(got, p.ref["o"], tolerance(case.dtype))


@needs_interpreter
def test_jit_vmap_grad():
    """jit(vmap) over differently packed rows, and gradients of every input (the Mosaic backward,
    interpreted) against float64 autodiff of the dense chunked form."""
    case = Case(100, 64, 64, 2, 64, dtype="bfloat16", batch=2, heads=1)
    p = build(case)
    op = lambda q, k, v, h, g, seg: gdp_jax.chunk_gdp_fwd_o(
        q[None], k[None], v[None], h[None], g[None], segment_ids=seg[None], chunk_size=64,
        implementation="mosaic_interpret")[0]
    args = (*p.chunk_o_args(), jnp.asarray(p.segment_ids))
    assert_close(jax.jit(jax.vmap(op))(*args), p.ref["o"], tolerance("bfloat16"))
    do = cotangent(p.ref["o"].shape, 1)
    loss = lambda *a: jnp.sum(jax.vmap(op)(*a).astype(jnp.float32) * do)
    grads = jax.jit(jax.grad(loss, argnums=range(5)))(*args)
    for name, grad, primal in zip(CHUNK_O_NAMES, grads, p.chunk_o_args()):
        chex.assert_type(grad, primal.dtype)
    _, want = dense_chunked_grads(*p.chunk_o_args(), p.segment_ids, do, scale=p.scale,
                                  chunk_size=64)
    assert_all_close(dict(zip(CHUNK_O_NAMES, grads)), want, tolerance("bfloat16"))


# The backward called directly on kernel_inputs (random q, k, v, h, decays, packings): every M
# with and without g and segments, ragged and whole last chunks, K != V both ways, padded widths;
# the one-kernel form up to K = V = 128, the two-kernel form past it (K or V alone wide, both).
BWD_CASES = [
    Case(150, 64, 128, 2, 64, dtype="bfloat16"),
    Case(128, 128, 64, 3, 64, dtype="bfloat16", segments=False),
    Case(77, 64, 64, 1, 64, dtype="float16", gated=False),
    Case(64, 64, 64, 2, 64, dtype="bfloat16", gated=False, segments=False, heads=3),
    Case(70, 128, 128, 3, 64, dtype="bfloat16", batch=1, heads=1),
    Case(150, 192, 128, 2, 64, dtype="bfloat16"),
    Case(70, 256, 256, 3, 64, dtype="bfloat16", batch=1, heads=1),
    Case(77, 64, 256, 1, 64, dtype="float16", gated=False),
    Case(128, 256, 64, 2, 64, dtype="bfloat16", gated=False, segments=False),
]


def mosaic_bwd_kernel(case):
    return lambda *args, **kw: chunk_o_bwd_mosaic(*args, scale=case.key_dim ** -0.5, chunk_size=64,
                                                  num_householder=case.m, interpret=True, **kw)


@needs_interpreter
@pytest.mark.parametrize("case", BWD_CASES, ids=case_id)
def test_backward_kernel(case):
    check_kernel(case, kernel=mosaic_bwd_kernel(case))


@needs_interpreter
@pytest.mark.parametrize("case", [Case(150, 64, 128, 2, 64, dtype="bfloat16"),
                                  Case(77, 128, 64, 1, 64, dtype="float16", gated=False)],
                         ids=case_id)
def test_backward_two_kernels_at_narrow_widths(case):
    """The two-kernel form where the default launches one: the same sums, any width."""
    check_kernel(case, kernel=lambda *args: chunk_o_bwd_mosaic(
        *args, scale=case.key_dim ** -0.5, chunk_size=64, num_householder=case.m, interpret=True,
        block_sizes=mosaic_bwd.BlockSizes(two_kernels=True)))


@needs_interpreter
@pytest.mark.parametrize("case,slots", [(Case(150, 64, 128, 3, 64, dtype="bfloat16"), 2),
                                        (Case(100, 128, 64, 2, 64, dtype="float16", gated=False), 2),
                                        (Case(64, 64, 64, 3, 64, dtype="bfloat16", segments=False), 3)],
                         ids=lambda x: f"slots{x}" if isinstance(x, int) else case_id(x))
def test_backward_kv_slots(case, slots):
    """The one kernel with several k / v slots (copy m in slot m % slots): the same sums."""
    check_kernel(case, kernel=lambda *args: chunk_o_bwd_mosaic(
        *args, scale=case.key_dim ** -0.5, chunk_size=64, num_householder=case.m, interpret=True,
        block_sizes=mosaic_bwd.BlockSizes(two_kernels=False, slots=slots)))


@needs_interpreter
@pytest.mark.parametrize("case", [Case(150, 64, 128, 2, 64, dtype="bfloat16", gated=False),
                                  Case(100, 128, 64, 3, 64, dtype="float16", segments=False)],
                         ids=case_id)
def test_backward_q_factor(case):
    """q_factor: given l2norm's rows q = r x of raw queries x and their factors r, dq is the
    cotangent of x: r (dq - y (y·dq)) with y = x r in float64 and dq float64 autodiff of the
    dense form at the q the kernel reads. dk, dv, dh and dg are the plain call's, bit for bit."""
    q, k, v, h, g, runs, do = kernel_inputs(case)
    rng = np.random.default_rng(7)
    x = jnp.asarray(np.asarray(q, np.float32) * rng.uniform(0.3, 3.0, size=q.shape[:3] + (1,)),
                    q.dtype)
    q_n, factor = l2norm_and_factor(x)
    call = lambda **kw: mosaic_bwd_kernel(case)(q_n, k, v, h, g, runs, do, **kw)
    got, plain = call(q_factor=factor), call()
    dq = dense_chunked_grads(q_n, k, v, h, g, runs, do, scale=case.key_dim ** -0.5,
                             chunk_size=64)[1]["q"]
    x64 = np.asarray(x, np.float64)
    r64 = 1.0 / np.sqrt(np.sum(x64 * x64, axis=-1, keepdims=True) + 1e-6)
    y = x64 * r64
    want = r64 * (dq - y * np.sum(y * dq, axis=-1, keepdims=True))
    chex.assert_type(got[0], q.dtype)
    assert_close(got[0], want, tolerance(case.dtype), "dq (raw queries)")
    assert rel_err(plain[0], want) > 0.1                      # the projection is really applied
    chex.assert_trees_all_equal(got[1:], plain[1:])


def test_backward_q_factor_needs_one_kernel():
    case = Case(64, 192, 64, 1, 64, dtype="bfloat16", gated=False, segments=False)
    q, k, v, h, g, runs, do = kernel_inputs(case)
    with pytest.raises(ValueError, match="q_factor needs the one-kernel backward"):
        chunk_o_bwd_mosaic(q, k, v, h, g, runs, do, scale=0.1, chunk_size=64, num_householder=1,
                           interpret=True, q_factor=jnp.ones(q.shape[:3]))
    q, k, v, h, g, runs, do = kernel_inputs(Case(64, 64, 64, 1, 64, dtype="bfloat16",
                                                 gated=False, segments=False))
    with pytest.raises(ValueError, match=r"q_factor must be \[B, T, H\]"):
        chunk_o_bwd_mosaic(q, k, v, h, g, runs, do, scale=0.1, chunk_size=64, num_householder=1,
                           interpret=True, q_factor=jnp.ones(q.shape[:2]))
    rule = functools.partial(dispatch.queries_l2norm_vjp_in_chunk_o_kernel, gated=False)
    assert rule("mosaic", 128, 100) and rule("mosaic_interpret", 48, 64)
    assert not rule("mosaic", 192, 64) and not rule("pallas", 64, 64)
    assert not rule("interpret", 64, 64) and not rule("xla", 64, 64)
    assert not dispatch.queries_l2norm_vjp_in_chunk_o_kernel("mosaic", 128, 128, gated=True)


def test_backward_block_sizes_rule_and_check():
    rule = mosaic_bwd.default_block_sizes
    assert rule(128, 128, 2) == mosaic_bwd.BlockSizes(two_kernels=False, slots=1)
    assert rule(64, 64, 2) == mosaic_bwd.BlockSizes(two_kernels=False, slots=2)
    assert rule(64, 64, 3) == mosaic_bwd.BlockSizes(two_kernels=False, slots=2)
    assert rule(64, 64, 1) == mosaic_bwd.BlockSizes(two_kernels=False, slots=1)
    assert rule(64, 128, 3) == mosaic_bwd.BlockSizes(two_kernels=False, slots=1)
    assert rule(192, 64, 2) == mosaic_bwd.BlockSizes(two_kernels=True)
    assert rule(64, 256, 3) == mosaic_bwd.BlockSizes(two_kernels=True)
    with pytest.raises(ValueError, match="one kernel takes K, V up to 128; got K = 256"):
        mosaic_bwd.BlockSizes(two_kernels=False).check(256, 64, 2)
    with pytest.raises(ValueError, match=r"slots must be in \[1, M = 2\]; got 3"):
        mosaic_bwd.BlockSizes(two_kernels=False, slots=3).check(64, 64, 2)
    with pytest.raises(ValueError, match="the two kernels take 1"):
        mosaic_bwd.BlockSizes(two_kernels=True, slots=2).check(64, 64, 2)


@needs_interpreter
def test_backward_strong_decay_in_partial_chunk_stays_finite():
    """Padding rows of the last chunk must not form 2^(0 - g[s]) = inf (NaN in dk, dv, dg): its
    last two tokens decay by 2^-100 each, the rest by 2^-0.1."""
    case = Case(100, 64, 64, 2, 64, dtype="bfloat16", batch=1, gated=False, segments=False)
    steps = np.full((1, 100, 2), -0.1, np.float32)
    steps[:, 98:] = -100.0
    g = jnp.asarray(np.concatenate([np.cumsum(steps[:, i:i + 64], axis=1)
                                    for i in range(0, 100, 64)], axis=1))
    check_kernel(case, g=g, kernel=mosaic_bwd_kernel(case))


@needs_interpreter
def test_backward_routing_reaches_the_kernel():
    """The op's backward under "mosaic_interpret" is the Mosaic backward wherever the Mosaic
    forward runs (K, V up to 256), the Triton kernel elsewhere: without this a routing change
    would let the op-level tests pass on the Triton kernel."""
    bf16, f32 = jnp.dtype("bfloat16"), jnp.dtype("float32")
    rule = dispatch.chunk_o_backward_implementation
    assert rule("mosaic_interpret", bf16, 128, 100, 64) == "mosaic_interpret"
    assert rule("mosaic_interpret", bf16, 192, 64, 64) == "mosaic_interpret"
    assert rule("mosaic", bf16, 64, 256, 64) == "mosaic"
    assert rule("mosaic", bf16, 64, 320, 64) == "pallas"
    assert rule("mosaic", bf16, 64, 64, 32) == "pallas"
    assert rule("mosaic", f32, 64, 64, 64) == "pallas"
    assert rule("interpret", bf16, 64, 64, 64) == "interpret"
    assert rule("xla", bf16, 64, 64, 64) == "xla"


@pytest.mark.parametrize("dtype,key_dim,value_dim,chunk_size,mosaic", [
    ("bfloat16", 256, 256, 64, True),
    ("float16", 192, 64, 64, True),          # K pads past 128
    ("bfloat16", 64, 200, 64, True),         # V pads to 256
    ("bfloat16", 128, 128, 64, False),       # level with Triton there: Triton stays
    ("bfloat16", 100, 64, 64, False),
    ("float32", 256, 256, 64, False),        # no 4-byte Mosaic kernel
    ("bfloat16", 256, 256, 128, False),      # chunk 128
    ("bfloat16", 64, 320, 64, False),        # past 256: no kernel takes it
])
def test_pallas_takes_the_mosaic_forward_past_128(dtype, key_dim, value_dim, chunk_size, mosaic,
                                                  monkeypatch):
    """"pallas" runs chunk_o's forward on Mosaic GPU where K or V pads above 128 and the Mosaic
    kernel runs it, on jax >= 0.11; elsewhere, and where the forward takes l2norm's factors
    (``scaled``, the Triton kernel's alone), the Triton forward or its fallback."""
    args = (jnp.dtype(dtype), key_dim, value_dim, chunk_size)
    monkeypatch.setattr(dispatch, "mosaic_by_default", lambda: False)
    triton = dispatch.chunk_o_implementation("pallas", *args)
    assert triton == ("xla" if value_dim > 256 else "pallas")
    monkeypatch.setattr(dispatch, "mosaic_by_default", lambda: True)
    assert dispatch.chunk_o_implementation("pallas", *args) == ("mosaic" if mosaic else triton)
    assert dispatch.chunk_o_implementation("pallas", *args, scaled=True) == triton
    assert dispatch.chunk_o_implementation("interpret", *args) in ("interpret", "xla")


@pytest.mark.parametrize("dtype,h_dtype,key_dim,value_dim,chunk_size,mosaic", [
    ("bfloat16", "bfloat16", 128, 100, 64, True),
    ("float16", "float16", 64, 64, 64, True),
    ("bfloat16", "bfloat16", 192, 128, 64, True),      # past 128: the two-kernel backward
    ("bfloat16", "bfloat16", 256, 256, 64, True),
    ("bfloat16", "bfloat16", 64, 320, 64, False),      # past 256: no Mosaic kernel
    ("bfloat16", "float32", 128, 128, 64, False),      # h of another dtype
    ("float32", "float32", 64, 64, 64, False),
    ("bfloat16", "bfloat16", 64, 64, 32, False),
])
def test_pallas_takes_the_mosaic_backward_where_it_runs(dtype, h_dtype, key_dim, value_dim,
                                                       chunk_size, mosaic, monkeypatch):
    """"pallas" (None's choice on a GPU) runs chunk_o's backward on Mosaic GPU where that kernel
    runs (one kernel or two), on jax >= 0.11 (where it was run and timed), and the Triton
    backward elsewhere."""
    assert dispatch.mosaic_by_default() == (
        tuple(map(int, jax.__version__.split(".")[:2])) >= (0, 11))
    args = (jnp.dtype(dtype), key_dim, value_dim, chunk_size, jnp.dtype(h_dtype))
    for by_default in (True, False):
        monkeypatch.setattr(dispatch, "mosaic_by_default", lambda: by_default)
        want = "mosaic" if mosaic and by_default else "pallas"
        assert dispatch.chunk_o_backward_implementation("pallas", *args) == want


@needs_interpreter
def test_full_op():
    """The full op with implementation="mosaic_interpret": chunk_o's forward on the Mosaic kernel,
    the other stages as for "interpret", against the float64 recurrence."""
    case = Case(90, 64, 64, 2, 64, dtype="bfloat16", batch=1)
    p = build(case)
    o, final = gdp_jax.chunk_gated_delta_product(
        *p.full_args(), initial_state=p.initial_state, segment_ids=p.segment_ids,
        output_final_state=True, chunk_size=64, implementation="mosaic_interpret")
    assert_close(o, p.ref["o"], tolerance("bfloat16"), "o")
    assert_close(final, p.ref["final_state"], tolerance("bfloat16"), "final_state")


@needs_interpreter
def test_full_op_gradients_past_128():
    """The route "pallas" takes past K = 128 on a GPU (jax >= 0.11), interpreted: chunk_o's
    Mosaic forward reading the walk's sub-chunk states in place with h in the copy slots, and
    the two-kernel Mosaic backward; every input's gradient against float64 autodiff of the
    recurrence, with g, segments and an initial state."""
    case = Case(90, 256, 128, 2, 64, dtype="bfloat16", batch=1)
    assert dispatch.chunk_o_implementation("mosaic_interpret", jnp.dtype("bfloat16"), 256, 128,
                                           64) == "mosaic_interpret"
    assert default_block_sizes(256, 128, 2).h_in_copy_slots
    assert mosaic_bwd.default_block_sizes(256, 128, 2).two_kernels
    p = build(case)
    op = functools.partial(gdp_jax.chunk_gated_delta_product, output_final_state=True,
                           segment_ids=p.segment_ids, chunk_size=64,
                           implementation="mosaic_interpret")
    check_gradients(p, op, qk_l2norm=False)


@needs_interpreter
def test_full_op_l2norm_gradients():
    """use_qk_l2norm's ungated gradient under "mosaic_interpret": q's normalisation VJP inside the
    Mosaic backward, k's inside the WY VJP kernel, no kernel of its own; every input's gradient
    against float64 autodiff of the recurrence."""
    case = Case(90, 64, 128, 2, 64, dtype="bfloat16", batch=1, gated=False)
    p = build(case, qk_l2norm=True)
    op = functools.partial(gdp_jax.chunk_gated_delta_product, output_final_state=True,
                           segment_ids=p.segment_ids, use_qk_l2norm=True, chunk_size=64,
                           implementation="mosaic_interpret")
    check_gradients(p, op, qk_l2norm=True)
    loss = lambda q, k: jnp.sum(op(q, k, *p.full_args()[2:])[0].astype(jnp.float32))
    names = kernel_names(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(p.q, p.k).jaxpr)
    assert "gdp_l2norm_bwd" not in names and names.count("gdp_wy_bwd") == 1, names


# Lowering for CUDA on this CPU host (jax.export) runs Mosaic GPU's own checks of the compiled
# form: register layout inference, SMEM transforms and wgmma operands, the SMEM budget of the
# H100/H200 (232448 bytes). What it does not check is the PTX and the run: the GPU tests do.
LOWERING_CASES = [  # (B, T, H, K, V, M, dtype, gated, segments, backward)
    (1, 128, 2, 64, 64, 1, "bfloat16", True, True, False),
    (2, 150, 2, 128, 128, 3, "bfloat16", True, True, False),
    (1, 100, 2, 256, 256, 2, "float16", False, True, False),
    (1, 100, 2, 256, 192, 3, "bfloat16", True, False, False),
    (1, 100, 2, 48, 100, 2, "bfloat16", True, False, False),
    (1, 100, 2, 128, 192, 2, "bfloat16", True, False, False),    # V = 192: 64-wide programs
    (1, 128, 2, 64, 64, 2, "bfloat16", True, True, True),
    (1, 150, 2, 128, 128, 3, "bfloat16", True, True, True),
    (1, 100, 2, 64, 128, 1, "float16", False, False, True),
    (1, 100, 2, 256, 256, 3, "bfloat16", True, True, True),      # the two-kernel backward
    (1, 100, 2, 192, 64, 2, "float16", False, False, True),
]


@pytest.mark.parametrize("case", LOWERING_CASES, ids=lambda c: "-".join(map(str, c)))
def test_compiled_form_lowers_for_cuda(case):
    batch, tokens, heads, key_dim, value_dim, m, dtype, gated, segments, backward = case
    spec = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
    num_chunks = -(-tokens // 64)
    args = [spec(batch, tokens, heads, key_dim), spec(batch, tokens * m, heads, key_dim),
            spec(batch, tokens * m, heads, value_dim),
            spec(batch, num_chunks, heads, key_dim, value_dim),
            spec(batch, tokens, heads, dt="float32") if gated else None,
            spec(batch, tokens, dt="int32") if segments else None]
    op = lambda q, k, v, h, g, ids: gdp_jax.chunk_gdp_fwd_o(q, k, v, h, g, segment_ids=ids,
                                                            implementation="mosaic")
    fn = op
    if backward:
        argnums = (0, 1, 2, 3, 4) if gated else (0, 1, 2, 3)
        fn = jax.grad(lambda *a: jnp.sum(op(*a).astype(jnp.float32)), argnums=argnums)
    assert dispatch.chunk_o_implementation("mosaic", jnp.dtype(dtype), key_dim, value_dim, 64,
                                           jnp.dtype(dtype)) == "mosaic"
    if backward:
        assert dispatch.chunk_o_backward_implementation("mosaic", jnp.dtype(dtype), key_dim,
                                                        value_dim, 64) == "mosaic"
    module = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    assert "mosaic_gpu" in module


def test_pallas_route_past_128_lowers_for_cuda(monkeypatch):
    """The full op under "pallas" at K = V = 256 where chunk_o's Mosaic kernels are the default
    (jax >= 0.11; forced here), lowered for CUDA with Mosaic GPU's checks: differentiated, the
    Mosaic forward (reading the walk's sub-chunk states in place) and the backward's two Mosaic
    kernels beside the other stages' Triton kernels; undifferentiated with use_qk_l2norm and
    2 * 16 * 4 walk programs, the fused forward's Triton chunk_o, which applies the factors."""
    monkeypatch.setattr(dispatch, "mosaic_by_default", lambda: True)
    spec = lambda *shape, dt="bfloat16": jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
    b, t, h, m, width = 2, 128, 16, 2, 256
    args = (spec(b, t, h, width), spec(b, t * m, h, width), spec(b, t * m, h, width),
            spec(b, t, h, dt="float32"), spec(b, t * m, h))
    op = functools.partial(gdp_jax.chunk_gated_delta_product, use_qk_l2norm=True,
                           implementation="pallas")
    triton = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]

    def lowered(fn):
        module = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                   disabled_checks=triton)(*args).mlir_module()
        return (len(re.findall(r"custom_call @mosaic_gpu\w*\(", module)),
                re.findall(r'name = "(gdp_\w+)"', module))

    loss = lambda *a: jnp.sum(op(*a)[0].astype(jnp.float32))
    mosaic_calls, triton_kernels = lowered(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    assert mosaic_calls == 3 and "gdp_chunk_o_fwd" not in triton_kernels, triton_kernels
    assert "gdp_chunk_h_fwd" in triton_kernels and "gdp_wy_bwd" in triton_kernels
    mosaic_calls, triton_kernels = lowered(lambda *a: op(*a)[0])
    assert mosaic_calls == 0 and "gdp_chunk_o_fwd" in triton_kernels, triton_kernels


# Two programs per SM of an H100 / H200: 228 KiB of SMEM, less 1 KiB reserved per block, halved.
TWO_PER_SM_BYTES = (228 * 1024 - 2 * 1024) // 2


@pytest.mark.parametrize("key_dim,value_dim,m,sizes,fits", [
    (256, 256, 3, BlockSizes(block_v=128, slots=1, h_in_copy_slots=True), True),
    (256, 256, 2, BlockSizes(block_v=128, slots=1), False),
    (256, 192, 2, BlockSizes(block_v=64, slots=1, h_in_copy_slots=True), True),
])
def test_h_in_copy_slots_fits_two_programs_per_sm(key_dim, value_dim, m, sizes, fits):
    """The compiled forward's SMEM request (Mosaic GPU's own check, under an artificial limit):
    with h aliased to the k and v slots, K = 256 fits two programs per SM; without, one."""
    mosaic_core = pytest.importorskip("jax.experimental.mosaic.gpu.core")
    limit = getattr(mosaic_core, "artificial_shared_memory_limit", None)
    if limit is None:
        pytest.skip("this jax's Mosaic GPU has no artificial_shared_memory_limit")
    spec = lambda *shape, dt="bfloat16": jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
    args = (spec(1, 128, 2, key_dim), spec(1, 128 * m, 2, key_dim), spec(1, 128 * m, 2, value_dim),
            spec(1, 2, 2, key_dim, value_dim), spec(1, 128, 2, dt="float32"),
            spec(1, 128, dt="int32"))
    fn = lambda *a: chunk_o_fwd_mosaic(*a, scale=0.1, chunk_size=64, num_householder=m,
                                       block_sizes=sizes)
    with limit(TWO_PER_SM_BYTES):
        if fits:
            jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
        else:
            with pytest.raises(ValueError, match="exceeds available shared memory"):
                jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)


@pytest.mark.parametrize("dtype,h_dtype,key_dim,value_dim,chunk_size,want", [
    ("bfloat16", "bfloat16", 128, 128, 64, "mosaic"),
    ("float16", "float16", 48, 256, 64, "mosaic"),          # 48 pads to 64
    ("bfloat16", "bfloat16", 256, 200, 64, "mosaic"),       # 200 pads to 256
    ("float32", "float32", 128, 128, 64, "pallas"),         # wgmma: 16-bit operands only here
    ("bfloat16", "float32", 128, 128, 64, "pallas"),        # h of another dtype
    ("bfloat16", "bfloat16", 128, 128, 32, "pallas"),       # wgmma's 64-row tile
    ("bfloat16", "bfloat16", 128, 128, 128, "pallas"),
    ("bfloat16", "bfloat16", 320, 128, 64, "xla"),          # past 256: the "pallas" rule's jnp path
    ("float64", "float64", 64, 64, 64, "xla"),
])
def test_routing_rule(dtype, h_dtype, key_dim, value_dim, chunk_size, want):
    got = dispatch.chunk_o_implementation("mosaic", jnp.dtype(dtype), key_dim, value_dim,
                                          chunk_size, jnp.dtype(h_dtype))
    assert got == want
    interpreted = dispatch.chunk_o_implementation("mosaic_interpret", jnp.dtype(dtype), key_dim,
                                                  value_dim, chunk_size, jnp.dtype(h_dtype))
    assert interpreted == {"mosaic": "mosaic_interpret", "pallas": "interpret",
                           "xla": "xla" if dtype == "float64" else "interpret"}[want]
    # The backward and the full op's other stages take the Triton counterpart.
    assert dispatch.triton_counterpart("mosaic") == "pallas"
    assert dispatch.states_implementation("mosaic", jnp.dtype(dtype), key_dim,
                                          value_dim) in ("pallas", "xla")


def test_default_block_sizes():
    assert default_block_sizes(128, 128, 2) == BlockSizes(block_v=128, slots=1)
    assert default_block_sizes(64, 256, 3) == BlockSizes(block_v=128, slots=1)
    assert default_block_sizes(128, 192, 2) == BlockSizes(block_v=64, slots=1)
    assert default_block_sizes(64, 64, 2) == BlockSizes(block_v=64, slots=1)
    assert default_block_sizes(256, 256, 1) == BlockSizes(block_v=128, slots=1,
                                                          h_in_copy_slots=True)
    assert default_block_sizes(256, 192, 3) == BlockSizes(block_v=64, slots=1,
                                                          h_in_copy_slots=True)
    assert default_block_sizes(192, 128, 2) == BlockSizes(block_v=128, slots=1,
                                                          h_in_copy_slots=True)
    with pytest.raises(ValueError, match="block_v"):
        BlockSizes(block_v=96).check(128, 128, 2)
    with pytest.raises(ValueError, match="slots"):
        BlockSizes(block_v=64, slots=3).check(128, 128, 2)


def test_without_triton_lowering(monkeypatch):
    """On a jax whose Pallas has no Triton lowering: None picks "mosaic" on a GPU, the stages
    without a Mosaic kernel run the jnp path, and asking for Triton is a clear error."""
    monkeypatch.setattr(dispatch, "has_triton_lowering", lambda: False)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert dispatch.resolve_implementation(None) == "mosaic"
    assert dispatch.triton_counterpart("mosaic") == "xla"
    assert dispatch.states_implementation("mosaic", jnp.dtype("bfloat16"), 64, 64) == "xla"
    assert dispatch.chunk_o_implementation("mosaic", jnp.dtype("float32"), 64, 64, 64) == "xla"
    for implementation in ("pallas", "interpret"):
        with pytest.raises(ValueError, match="Triton lowering"):
            dispatch.resolve_implementation(implementation)


def test_unknown_implementation_names_the_choices():
    case = Case(64, 64, 64, 1, 64, dtype="bfloat16", batch=1, heads=1)
    p = build(case)
    with pytest.raises(ValueError, match="mosaic_interpret"):
        gdp_jax.chunk_gdp_fwd_o(*p.chunk_o_args(), chunk_size=64, implementation="mosaic_gpu")
