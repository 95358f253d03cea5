"""The compiled kernels (implementation="pallas": Triton, or the kernel functions with
interpret=False; implementation="mosaic": chunk_o's Mosaic GPU forward) on an NVIDIA GPU, at
realistic shapes (T <= 4096), against float64 references at SPEC's GPU bounds
(tolerance(dtype, "gpu"): TF32 dots for float32 inputs, 2e-3; 16-bit inputs, 2e-2). Every test
is marked ``gpu`` (skipped without a GPU by conftest.py); run them with
``python -m pytest -q -m gpu``.

References: the float64 recurrence for forward outputs, h, v_new and final states, and float64
autodiff of the recurrence for the full op's gradients; float64 autodiff of the dense chunked
form (chunk_o's VJP), of the dense WY statement (the WY VJP) and of the float64 walk (the walk's
VJP) for the stage kernels, the same references as the CPU tests.
"""
import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax._src import dispatch
from gdp_jax._src.segments import segment_runs
from gdp_jax.ops.chunk_h import chunk_h_pallas
from gdp_jax.ops.chunk_o import pallas_bwd
from gdp_jax.ops.wy import wy_bwd_pallas, wy_pallas, wy_xla
from cases import (CHUNK_O_NAMES, GRAD_NAMES, Case, assert_all_close, assert_close, build, case_id,
                   cotangent, dense_chunked_grads, l2norm_op_of_qk, recurrence_grads, rel_err,
                   run_chunk_o, stress_problem, tolerance)
from test_chunk_h import kernel_vjp as walk_kernel_vjp, reference_vjp as walk_reference_vjp, walk_inputs
from test_chunk_o_bwd import kernel_inputs
from test_wy import NAMES as WY_NAMES, make_inputs as wy_inputs, reference_vjp as wy_reference_vjp
from test_wy import wy_numpy

pytestmark = pytest.mark.gpu


def gpu_tol(dtype):
    return tolerance(dtype, "gpu")


# ---------------------------------------------------------------------------------------------
# chunk_o forward

@pytest.mark.parametrize("case", [
    Case(2048, 128, 128, 1, 64, dtype="float32", heads=4),
    Case(2011, 128, 128, 3, 64, dtype="float32", heads=4),
    Case(2048, 128, 128, 2, 64, gated=False, segments=False, dtype="bfloat16", heads=4),
    Case(2011, 128, 128, 3, 64, dtype="bfloat16", heads=4),
    Case(2048, 128, 128, 2, 64, dtype="float16", heads=4),
], ids=case_id)
def test_chunk_o_forward(case):
    """The H200 launch table's main shapes (K = V = 128, chunk 64: the K loop for 16-bit inputs,
    M = 3 with its value-column loop), every dtype, with and without g and segments."""
    p = build(case)
    o = run_chunk_o(p, "pallas")
    chex.assert_type(o, case.jnp_dtype)
    assert_close(o, p.ref["o"], gpu_tol(case.dtype))


@pytest.mark.parametrize("case", [
    Case(333, 256, 256, 2, 64, dtype="bfloat16", heads=3),     # K = 256: v before the K loop
    Case(333, 256, 256, 2, 64, dtype="float32", heads=3),
    Case(333, 96, 48, 2, 16, dtype="bfloat16", heads=3),       # padded widths, 4 chunks a program
    Case(333, 128, 64, 2, 128, dtype="float32", heads=3),      # float32 at chunk 128, K = 128
    Case(333, 16, 256, 2, 64, dtype="bfloat16", heads=3),      # V = 256: two value programs
], ids=case_id)
def test_chunk_o_forward_widths_and_chunks(case, monkeypatch):
    """Under "pallas" as routed (past K, V = 128 at 16 bits and chunk 64, the Mosaic GPU forward
    on jax >= 0.11), then on the Triton kernel, which the full op's l2norm-fused forward and
    older jax still run there."""
    p = build(case)
    assert_close(run_chunk_o(p, "pallas"), p.ref["o"], gpu_tol(case.dtype))
    monkeypatch.setattr(dispatch, "mosaic_by_default", lambda: False)
    triton = jax.jit(functools.partial(gdp_jax.chunk_gdp_fwd_o, chunk_size=case.chunk_size,
                                       implementation="pallas"))        # a fresh trace
    assert_close(triton(*p.chunk_o_args(), segment_ids=p.segment_ids), p.ref["o"],
                 gpu_tol(case.dtype), "o (Triton)")


def test_chunk_o_jit_vmap_grad():
    """jit(vmap) over differently packed rows, and its gradients, against the references."""
    p = build(Case(200, 64, 64, 2, 64, batch=3))
    op = lambda q, k, v, h, g, seg: gdp_jax.chunk_gdp_fwd_o(
        q[None], k[None], v[None], h[None], g[None], segment_ids=seg[None], chunk_size=64,
        implementation="pallas")[0]
    args = (*p.chunk_o_args(), p.segment_ids)
    assert_close(jax.jit(jax.vmap(op))(*args), p.ref["o"], gpu_tol("float32"))
    do = cotangent(p.ref["o"].shape, 1)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(jax.vmap(op)(*a) * do), argnums=range(5)))(*args)
    _, want = dense_chunked_grads(*p.chunk_o_args(), p.segment_ids, do, scale=p.scale,
                                  chunk_size=64)
    assert_all_close(dict(zip(CHUNK_O_NAMES, grads)), want, gpu_tol("float32"))


# ---------------------------------------------------------------------------------------------
# chunk_o forward, Mosaic GPU (implementation="mosaic"): the Triton grid's 16-bit chunk-64 cases

MOSAIC_CASES = [
    Case(2048, 128, 128, 2, 64, gated=False, segments=False, dtype="bfloat16", heads=4),
    Case(2011, 128, 128, 3, 64, dtype="bfloat16", heads=4),
    Case(2048, 128, 128, 2, 64, dtype="float16", heads=4),
    Case(2011, 128, 128, 1, 64, dtype="bfloat16", heads=4),
    Case(333, 256, 256, 2, 64, dtype="bfloat16", heads=3),     # 64-wide value programs
    Case(333, 96, 48, 2, 64, dtype="bfloat16", heads=3),       # widths padded to 64
    Case(333, 16, 256, 3, 64, dtype="bfloat16", heads=3),
]


@pytest.mark.parametrize("case", MOSAIC_CASES, ids=case_id)
def test_chunk_o_forward_mosaic(case):
    assert dispatch.chunk_o_implementation("mosaic", case.jnp_dtype, case.key_dim, case.value_dim,
                                           case.chunk_size, case.jnp_dtype) == "mosaic"
    p = build(case)
    o = run_chunk_o(p, "mosaic")
    chex.assert_type(o, case.jnp_dtype)
    assert_close(o, p.ref["o"], gpu_tol(case.dtype))
    # Against the Triton kernel on the same inputs: both accumulate in float32.
    assert rel_err(o, run_chunk_o(p, "pallas")) < 1e-2


@pytest.mark.parametrize("case,sizes", [
    (Case(2011, 128, 128, 3, 64, dtype="bfloat16", heads=4), (128, 1)),
    (Case(333, 256, 256, 3, 64, dtype="bfloat16", heads=3), (128, 1)),
    (Case(333, 256, 192, 2, 64, gated=False, dtype="float16", heads=3), (64, 2)),
], ids=lambda x: case_id(x) if isinstance(x, Case) else "bv%d-slots%d" % x)
def test_chunk_o_forward_mosaic_h_in_copy_slots(case, sizes):
    """h's tile aliased with the k and v slots (plgpu.RefUnion, which the interpreter does not
    run): the same bits as the unaliased launch, and the float64 recurrence."""
    from gdp_jax.ops.chunk_o.mosaic_fwd import BlockSizes, chunk_o_fwd_mosaic
    p = build(case)
    q, k, v, h, g = p.chunk_o_args()
    runs = segment_runs(jnp.asarray(p.segment_ids))
    fn = lambda aliased: jax.jit(functools.partial(
        chunk_o_fwd_mosaic, scale=p.scale, chunk_size=64, num_householder=case.m,
        block_sizes=BlockSizes(*sizes, h_in_copy_slots=aliased)))(q, k, v, h, g, runs)
    got, want = fn(True), fn(False)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert_close(got, p.ref["o"], gpu_tol(case.dtype))


def test_chunk_o_mosaic_jit_vmap_grad():
    """jit(vmap) over differently packed rows and gradients of every input (the Mosaic backward)
    against the float64 references."""
    p = build(Case(200, 64, 128, 2, 64, batch=3, dtype="bfloat16"))
    op = lambda q, k, v, h, g, seg: gdp_jax.chunk_gdp_fwd_o(
        q[None], k[None], v[None], h[None], g[None], segment_ids=seg[None], chunk_size=64,
        implementation="mosaic")[0]
    args = (*p.chunk_o_args(), p.segment_ids)
    assert_close(jax.jit(jax.vmap(op))(*args), p.ref["o"], gpu_tol("bfloat16"))
    do = cotangent(p.ref["o"].shape, 1)
    loss = lambda *a: jnp.sum(jax.vmap(op)(*a).astype(jnp.float32) * do)
    grads = jax.jit(jax.grad(loss, argnums=range(5)))(*args)
    _, want = dense_chunked_grads(*p.chunk_o_args(), p.segment_ids, do, scale=p.scale,
                                  chunk_size=64)
    assert_all_close(dict(zip(CHUNK_O_NAMES, grads)), want, gpu_tol("bfloat16"))


def test_chunk_o_x64_mode_compiled():
    """Under jax_enable_x64 the kernels' loop counters and literal offsets are int64 while program
    ids stay int32: the compiled kernels give the same bits as without it, forward and backward
    (K = 128, M = 3: the K loop and the value-column loop; the interpreter checks the rest)."""
    p = build(Case(200, 128, 128, 3, 64, dtype="bfloat16"))

    def value_and_grads(*args):
        def loss(*args):
            o = gdp_jax.chunk_gdp_fwd_o(*args, segment_ids=p.segment_ids, chunk_size=64,
                                        implementation="pallas")
            return jnp.sum(o.astype(jnp.float32) ** 2), o
        (_, o), grads = jax.value_and_grad(loss, argnums=range(5), has_aux=True)(*args)
        return (o,) + grads

    off = jax.jit(value_and_grads)(*p.chunk_o_args())
    with jax.enable_x64(True):
        on = jax.jit(value_and_grads)(*p.chunk_o_args())
    assert_close(on[0], p.ref["o"], gpu_tol("bfloat16"))
    chex.assert_trees_all_equal(on, off)


def test_chunk_o_long_row_past_32_bit_indexing():
    """One row of 2^20 tokens: k, v and h each hold 2^32 elements (8.6 GB in bf16), so element
    offsets pass 2^31. Checked against the jnp path on two-chunk slices at the start, middle and
    end (a float64 reference of the whole row would not fit the test's time)."""
    b, t, hd, kd, vd, m, bt = 1, 1 << 20, 16, 128, 128, 2, 64
    nt = t // bt
    keys = jax.random.split(jax.random.PRNGKey(3), 5)
    dt = jnp.bfloat16
    q = jax.random.normal(keys[0], (b, t, hd, kd), dt)
    k = (jax.random.normal(keys[1], (b, t * m, hd, kd), dt) * kd ** -0.5).astype(dt)
    v = (0.1 * jax.random.normal(keys[2], (b, t * m, hd, vd), dt)).astype(dt)
    h = (0.1 * jax.random.normal(keys[3], (b, nt, hd, kd, vd), dt)).astype(dt)
    g = jnp.cumsum(-0.05 * jax.random.uniform(keys[4], (b, nt, bt, hd)), axis=2).reshape(b, t, hd)
    assert k.size > 2 ** 32 - 1 and h.size > 2 ** 31
    o = gdp_jax.chunk_gdp_fwd_o(q, k, v, h, g, implementation="pallas")
    for first_chunk in (0, nt // 2 + 3, nt - 2):
        tok = slice(first_chunk * bt, (first_chunk + 2) * bt)
        pos = slice(tok.start * m, tok.stop * m)
        expected = gdp_jax.chunk_gdp_fwd_o(q[:, tok], k[:, pos], v[:, pos],
                                           h[:, first_chunk:first_chunk + 2], g[:, tok],
                                           implementation="xla")
        assert_close(o[:, tok], np.asarray(expected.astype(jnp.float32)), gpu_tol("bfloat16"))


# ---------------------------------------------------------------------------------------------
# chunk_o backward: the fused and the split kernel, against float64 autodiff of the dense form

def _bwd_sizes(case, split):
    base = pallas_bwd.default_block_sizes(case.key_dim, case.value_dim, case.chunk_size,
                                          case.jnp_dtype.itemsize, gated=case.gated)
    return base if split is None else dataclasses.replace(base, split=split)


_DENSE = {}


def check_chunk_o_bwd(case, split=None, g=None):
    """The compiled backward (default blocks; ``split`` forces the structure) on kernel_inputs,
    against float64 autodiff of the dense form (one per case: fused and split share it)."""
    q, k, v, h, g, runs, do = args = kernel_inputs(case, g=g)
    got = jax.jit(functools.partial(
        pallas_bwd.chunk_o_bwd_pallas, scale=case.key_dim ** -0.5, chunk_size=case.chunk_size,
        num_householder=case.m, block_sizes=_bwd_sizes(case, split)))(*args)
    if case not in _DENSE or g is not None:
        _DENSE[case] = dense_chunked_grads(q, k, v, h, g, runs, do, scale=case.key_dim ** -0.5,
                                           chunk_size=case.chunk_size)[1]
    assert_all_close(dict(zip(CHUNK_O_NAMES, got)), _DENSE[case], gpu_tol(case.dtype))


@pytest.mark.parametrize("case,split", [
    (Case(1000, 128, 128, 2, 64, dtype="bfloat16", heads=4), True),       # the default there
    (Case(1000, 128, 128, 2, 64, dtype="bfloat16", heads=4), False),
    (Case(1000, 256, 256, 2, 64, gated=False, segments=False, dtype="bfloat16", heads=4), None),
    (Case(1000, 256, 256, 3, 64, dtype="bfloat16", heads=2), None),     # 64-wide key blocks
    (Case(1000, 64, 64, 1, 64, segments=False, dtype="bfloat16", heads=4), None),   # fused
    (Case(1000, 128, 128, 2, 64, dtype="float32", heads=4), None),        # fused, 8 warps
    (Case(1000, 128, 128, 3, 64, gated=False, segments=False, dtype="float32", heads=4), True),
], ids=lambda x: case_id(x) if isinstance(x, Case) else {None: "default", True: "split",
                                                          False: "fused"}[x])
def test_chunk_o_bwd(case, split):
    check_chunk_o_bwd(case, split)


@pytest.mark.parametrize("case", [
    Case(333, 128, 256, 2, 32, dtype="bfloat16", heads=3),     # split at chunk 32, V = 256
    Case(333, 64, 128, 2, 128, dtype="bfloat16", heads=3),     # chunk 128: fused, 8 warps
], ids=case_id)
def test_chunk_o_bwd_shapes(case):
    check_chunk_o_bwd(case)


@pytest.mark.parametrize("case", [
    Case(1000, 128, 128, 2, 64, dtype="bfloat16", heads=4),
    Case(1000, 128, 128, 3, 64, gated=False, segments=False, dtype="bfloat16", heads=4),
    Case(1000, 64, 64, 1, 64, segments=False, dtype="float16", heads=4),
    Case(333, 96, 48, 2, 64, dtype="bfloat16", heads=3),       # widths padded to 64
    # K, V <= 64 and M >= 2: two k / v slots, copy 2 back in the first.
    Case(700, 48, 64, 3, 64, dtype="bfloat16", heads=3),
    # Past 128: the two-kernel form.
    Case(1000, 256, 256, 2, 64, dtype="bfloat16", heads=2),
    Case(1000, 256, 256, 3, 64, gated=False, segments=False, dtype="bfloat16", heads=2),
    Case(517, 200, 96, 1, 64, dtype="float16", heads=3),       # K padded to 256, V to 128
    Case(333, 64, 192, 2, 64, segments=False, dtype="bfloat16", heads=2),
], ids=case_id)
def test_chunk_o_bwd_mosaic(case):
    """The compiled Mosaic GPU backward on kernel_inputs against float64 autodiff of the dense
    form: one kernel up to K, V = 128 (two k / v slots up to 64), two past it."""
    check_chunk_o_bwd_mosaic(case)


def check_chunk_o_bwd_mosaic(case, interpret=False):
    from gdp_jax.ops.chunk_o.mosaic_bwd import chunk_o_bwd_mosaic
    q, k, v, h, g, runs, do = args = kernel_inputs(case)
    kd, vd = case.key_dim, case.value_dim
    kp, vp = dispatch.mosaic_padded_width(kd), dispatch.mosaic_padded_width(vd)
    def pad(x, *widths):            # zeros after the trailing axes' values
        return jnp.pad(x, [(0, 0)] * (x.ndim - len(widths)) + [(0, w) for w in widths])
    kernel = functools.partial(chunk_o_bwd_mosaic, scale=kd ** -0.5, chunk_size=64,
                               num_householder=case.m, interpret=interpret)
    dq, dk, dv, dh, dg = jax.jit(kernel)(pad(q, kp - kd), pad(k, kp - kd), pad(v, vp - vd),
                                         pad(h, kp - kd, vp - vd), g, runs, pad(do, vp - vd))
    got = dict(q=dq[..., :kd], k=dk[..., :kd], v=dv[..., :vd], h=dh[..., :kd, :vd], g=dg)
    want = dense_chunked_grads(*args, scale=kd ** -0.5, chunk_size=64)[1]
    assert_all_close(got, want, tolerance(case.dtype, "cpu" if interpret else "gpu"))


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_chunk_o_bwd_strong_decay_in_partial_chunk_stays_finite(split):
    """Padding rows of the last chunk must not form 2^(0 - g[s]) = inf (NaN in dk, dv, dg)."""
    case = Case(40, 16, 16, 2, 16, gated=False, segments=False, dtype="bfloat16", batch=1)
    steps = np.full((1, 40, 2), -0.5, np.float32)
    steps[:, 38:] = -100.0
    g = jnp.asarray(np.concatenate([np.cumsum(steps[:, i:i + 16], axis=1)
                                    for i in range(0, 40, 16)], axis=1))
    check_chunk_o_bwd(case, split, g=g)


# ---------------------------------------------------------------------------------------------
# WY stage

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_wy_forward(dtype):
    """B=2 P=4096 H=4 K=V=128 S=64 with decays and segments (16-bit: T applied in 16 bits)."""
    primals, _ = wy_inputs(sub_chunk=64, num_sub_chunks=64, key_dim=128, value_dim=128,
                           gated=True, segments=True, dtype=dtype, heads=4)
    w, u = jax.jit(functools.partial(wy_pallas, sub_chunk=64, out_dtype=jnp.float32))(*primals)
    w_ref, u_ref, _ = wy_numpy(primals, 64)
    assert_close(w, w_ref, gpu_tol(dtype), "w")
    assert_close(u, u_ref, gpu_tol(dtype), "u")


@pytest.mark.parametrize("dtype,gated,segments,dots", [
    ("float32", True, True, "tf32x3"),         # float32: the kernel's TF32x3 option (the op takes wy_bwd_xla)
    ("float16", True, True, "tf32"),           # float16: TF32 dots
    ("bfloat16", True, True, "bf16"),          # bfloat16: bf16 operands
])
def test_wy_bwd(dtype, gated, segments, dots):
    """The compiled VJP kernel from the compiled forward's inverse, at B=2 P=4096 H=4 K=V=128
    S=64, each dot path the op uses (dispatch.wy_bwd_dots) and the float32 TF32x3 option."""
    primals, cotangents = wy_inputs(sub_chunk=64, num_sub_chunks=64, key_dim=128, value_dim=128,
                                    gated=gated, segments=segments, dtype=dtype, heads=4)
    kw = dict(tf32x3=dict(precision=jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3),
              tf32=dict(precision=None),
              bf16=dict(precision=None, operand_dtype=jnp.bfloat16))[dots]

    @jax.jit
    def kernel(primals, cotangents):
        inverse = wy_pallas(*primals, sub_chunk=64, out_dtype=primals[0].dtype,
                            return_inverse=True)[2]
        return wy_bwd_pallas(*primals, inverse, *cotangents, sub_chunk=64, **kw)

    got = dict(zip(WY_NAMES, kernel(primals, cotangents)))
    assert_all_close(got, wy_reference_vjp(primals, cotangents, 64), gpu_tol(dtype))


# ---------------------------------------------------------------------------------------------
# State walk

@pytest.mark.parametrize("case", [Case(333, 64, 256, 3, 64, heads=3)], ids=case_id)
def test_walk_forward(case):
    p = build(case)
    kw = dict(chunk_size=case.chunk_size, num_householder=case.m)
    w, u = jax.jit(functools.partial(wy_xla, **kw))(p.k, p.v, p.beta, p.g, p.runs)
    out = jax.jit(functools.partial(chunk_h_pallas, **kw))(p.k, w, u, p.g, p.runs, p.initial_state)
    for name, x in zip(("h", "v_new", "final_state"), out):
        assert_close(x, p.ref[name], gpu_tol("float32"), name)


@pytest.mark.parametrize("case,dot_dtype", [
    (Case(1000, 128, 128, 2, 64, heads=4), "float32"),
    (Case(1000, 128, 128, 2, 64, dtype="bfloat16", heads=4), "bfloat16"),    # the op's bf16 choice
    (Case(1000, 64, 64, 2, 64, dtype="bfloat16", heads=4), "bfloat16"),      # two stages
    (Case(333, 256, 128, 2, 64, heads=3), "float32"),        # K = 256: value blocks of 16
    (Case(333, 256, 128, 2, 64, dtype="bfloat16", heads=3), "bfloat16"),    # K = 256: 128-key, 32-column blocks
    (Case(333, 128, 128, 2, 128, heads=3), "float32"),       # chunk 128: 8 warps
], ids=lambda x: case_id(x) if isinstance(x, Case) else x)
def test_walk_bwd(case, dot_dtype):
    """The compiled reverse walk and epilogue from the compiled forward's residuals."""
    primals, cotangents = walk_inputs(case)
    if dot_dtype == "bfloat16":
        k, w, u, g, runs, state0 = primals
        primals = (k, w.astype(jnp.bfloat16), u, g, runs, state0)
    got = walk_kernel_vjp(case, primals, cotangents, dot_dtype=dot_dtype, residual_dtype=dot_dtype,
                          interpret=False)
    assert_all_close(got, walk_reference_vjp(case, primals, cotangents), gpu_tol(dot_dtype))


# ---------------------------------------------------------------------------------------------
# The full op

FULL_OP_CASES = [
    (Case(1000, 128, 128, 2, 64, heads=4), False),
    (Case(963, 128, 64, 3, 64, gated=False, segments=False, initial_state=False, heads=4), False),
    (Case(1000, 128, 128, 1, 64, segments=False, dtype="bfloat16", heads=4), False),
    (Case(963, 128, 128, 3, 64, dtype="bfloat16", heads=4), False),
    (Case(1000, 128, 128, 2, 64, dtype="float16", heads=4), False),
    (Case(517, 256, 256, 2, 64), False),   # float32 at the widest K, V: the WY forward's IEEE dots spill most there
    (Case(1000, 64, 64, 2, 64, dtype="bfloat16", heads=4), False),     # K = 64: the backward from T
    (Case(333, 32, 48, 3, 64, dtype="bfloat16", heads=2), False),      # ... and at a small K
    (Case(517, 200, 256, 2, 64, dtype="bfloat16", heads=2), False),    # K = 256 (padded): its walks' 8 warps
    (Case(517, 256, 192, 2, 128, dtype="bfloat16", heads=2), False),   # K = 256 at chunks 128 and 32: the
    (Case(333, 200, 256, 3, 32, dtype="bfloat16", heads=2), False),    # walks' rows for chunks other than 64
    (Case(700, 256, 256, 3, 64, gated=False, dtype="float16", heads=2), False),  # chunk_o's two-kernel
                                                                       # Mosaic backward under "pallas"
    # use_qk_l2norm (raw q, k of varied norms): 16-bit inputs up to K = 128 take the keys'
    # normalisation VJP inside the WY VJP kernel (bfloat16 on its T^T dw route, float16 on its
    # TF32 route), ungated ones the queries' inside the one-kernel Mosaic backward; K = 256 and
    # float32 take the normalisation's own backward kernel for both.
    (Case(1000, 128, 128, 2, 64, dtype="bfloat16", heads=4), True),
    (Case(1000, 64, 64, 2, 64, dtype="bfloat16", heads=4), True),   # K = 64: k·dk off one dk tile
    (Case(700, 64, 64, 2, 64, dtype="float16", gated=False, heads=3), True),
    (Case(517, 256, 256, 2, 64, dtype="bfloat16", heads=2), True),
    (Case(333, 64, 32, 3, 64, heads=3), True),
]


@pytest.mark.parametrize("case,l2norm", FULL_OP_CASES,
                         ids=[case_id(c) + ("-l2norm" if n else "") for c, n in FULL_OP_CASES])
def test_full_op(case, l2norm):
    """o and the final state against the recurrence, and the gradients in every input against
    float64 autodiff of it: the Pallas path's custom_vjps compiled (walk VJP kernels; the WY VJP
    kernel for 16-bit inputs, wy_bwd_xla for float32; chunk_o's backward kernel, on Mosaic GPU
    for the 16-bit cases on jax >= 0.11); then the undifferentiated forward's o and final state."""
    p = build(case, qk_l2norm=l2norm)
    do, dfinal, expected = recurrence_grads(p, qk_l2norm=l2norm)
    names = [n for n in GRAD_NAMES if expected[n] is not None]
    primals = dict(q=p.q, k=p.k, v=p.v, g_raw=p.g_raw, beta=p.beta, initial_state=p.initial_state)

    def loss(*args):
        a = dict(primals, **dict(zip(names, args)))
        o, final_state = gdp_jax.chunk_gated_delta_product(
            a["q"], a["k"], a["v"], a["g_raw"], a["beta"], initial_state=a["initial_state"],
            segment_ids=p.segment_ids, output_final_state=True, chunk_size=case.chunk_size,
            use_qk_l2norm=l2norm, implementation="pallas")
        return (jnp.sum(o.astype(jnp.float32) * do.astype(np.float32))
                + jnp.sum(final_state * dfinal.astype(np.float32))), (o, final_state)

    (_, (o, final_state)), grads = jax.jit(jax.value_and_grad(
        loss, argnums=tuple(range(len(names))), has_aux=True))(*[primals[n] for n in names])
    chex.assert_type([o, final_state], [case.jnp_dtype, jnp.float32])
    assert_close(o, p.ref["o"], gpu_tol(case.dtype), "o")
    assert_close(final_state, p.ref["final_state"], gpu_tol(case.dtype), "final_state")
    grads = dict(zip(names, grads))
    for n in names:
        chex.assert_type(grads[n], primals[n].dtype)
    assert_all_close(grads, {n: expected[n] for n in names}, gpu_tol(case.dtype))
    # The undifferentiated forward has launch rules of its own (the walk's step, for one).
    o, final_state = jax.jit(lambda *a: loss(*a)[1])(*[primals[n] for n in names])
    assert_close(o, p.ref["o"], gpu_tol(case.dtype), "o (undifferentiated)")
    assert_close(final_state, p.ref["final_state"], gpu_tol(case.dtype), "final_state (undifferentiated)")


@pytest.mark.parametrize("m", [2, 3])
def test_full_op_transposed_walks(m, monkeypatch):
    """test_full_op's checks (o, final state, every input's gradient; then the undifferentiated
    forward) where few walk programs narrow the value blocks and the compiled forward walks carry
    the state transposed, the one storing h at every sub-chunk for the backward included: the
    walk-length threshold lowered so that a row of 1000 tokens narrows (B1 H2: 16 columns)."""
    from gdp_jax.ops.chunk_h import pallas_fwd
    monkeypatch.setattr(pallas_fwd, "LONG_WALK_STEPS", 1)
    case = Case(1000, 128, 128, m, 64, dtype="bfloat16", batch=1)
    walks = case.batch * case.heads
    sizes = pallas_fwd.default_block_sizes(case.key_dim, case.value_dim, 64, m, 1, jnp.bfloat16,
                                           True, walks=walks, steps=2, applies_inverse=True)
    assert sizes.transposed and sizes.block_v == 16
    test_full_op(case, True)


# use_qk_l2norm's undifferentiated forward (dispatch.l2norm_fused), the keys' factors made in the
# compiled WY kernel and applied there, by the walk and by chunk_o, for each chunk_o variant: its
# K loop at K = 128 (M = 1: 64-key steps; M = 2: 32-key steps; M = 3: with the value-column loop;
# K = 100 padded), whole rows (K = 64, four chunks a program; float32); with segment ids, and at
# K = 256 (K = 200 padded).
L2NORM_FORWARD_CASES = [
    Case(1000, 128, 128, 1, 64, dtype="float16", heads=4, segments=False),
    Case(1000, 128, 128, 2, 64, dtype="bfloat16", heads=4, segments=False),
    Case(963, 100, 200, 3, 64, dtype="bfloat16", heads=4, segments=False),
    Case(1000, 64, 64, 2, 64, dtype="bfloat16", heads=4, segments=False),
    Case(333, 128, 64, 2, 64, heads=3, segments=False),
    Case(1000, 128, 128, 2, 64, dtype="bfloat16", heads=4),
    Case(1000, 256, 256, 2, 64, dtype="bfloat16", heads=2),
    Case(700, 200, 96, 3, 64, dtype="bfloat16", heads=2),
]


@pytest.mark.parametrize("case", L2NORM_FORWARD_CASES, ids=case_id)
def test_full_op_l2norm_forward(case, monkeypatch):
    """o and the final state of the undifferentiated op with use_qk_l2norm (raw q, k of varied
    norms) against the recurrence on the normalised q, k, and against the differentiated
    path's o, where the normalisation is its own step. The rule's program-count threshold (a
    speed row) is lowered so that these problems take the fused path."""
    monkeypatch.setattr(dispatch, "L2NORM_FUSED_MIN_WALK_PROGRAMS", 1)
    p = build(case, qk_l2norm=True)
    op = l2norm_op_of_qk(p, "pallas")

    o, final_state = jax.jit(op)(p.q, p.k)
    composed = jax.jit(lambda q, k: jax.vjp(op, q, k)[0])(p.q, p.k)
    assert_close(o, p.ref["o"], gpu_tol(case.dtype), "o")
    assert_close(final_state, p.ref["final_state"], gpu_tol(case.dtype), "final_state")
    assert_all_close(dict(o=o, final_state=final_state),
                     dict(o=composed[0], final_state=composed[1]), gpu_tol(case.dtype))


def test_full_op_l2norm_gradients_where_the_forward_is_fused(monkeypatch):
    """test_full_op's checks (o, final state, every input's gradient) with use_qk_l2norm, the
    threshold lowered, so the gradient goes through the fused forward's custom_vjp."""
    monkeypatch.setattr(dispatch, "L2NORM_FUSED_MIN_WALK_PROGRAMS", 1)
    test_full_op(Case(1000, 128, 128, 2, 64, dtype="bfloat16", heads=4, segments=False), True)


def test_long_row_stress():
    """One row of T = 65536 bf16 tokens (B = 1, H = 2, K = V = 128, M = 2) from
    cases.stress_problem: beta in (1.9, 2), gates in runs near 0 and down to -8. o on three
    windows of 4096 tokens (start, middle, end) and the final state against the float64
    recurrence (numpy, the whole row), at SPEC's bf16 GPU bound; o finite everywhere."""
    inputs, ref = stress_problem(65536, 2, 128, 128, 2)
    o, final_state = jax.jit(functools.partial(
        gdp_jax.chunk_gated_delta_product, output_final_state=True, chunk_size=64,
        implementation="pallas"))(*inputs)
    o = np.asarray(o, np.float32)
    assert np.isfinite(o).all()
    for start in (0, 30720, 61440):
        window = slice(start, start + 4096)
        assert_close(o[:, window], ref["o"][:, window], gpu_tol("bfloat16"), f"o[{start}:]")
    assert_close(final_state, ref["final_state"], gpu_tol("bfloat16"), "final_state")


def test_full_op_matches_fla_packed():
    """The forward against fla's chunk_gated_delta_product on the same bf16 inputs: packed rows
    (segment ids) go to fla as one flattened row with cu_seqlens from the same packing. Both are
    checked against the float64 recurrence, so a wrong conversion cannot pass as agreement.
    Skipped where torch or fla is not importable."""
    torch = pytest.importorskip("torch")
    fla_gdp = pytest.importorskip("fla.ops.gated_delta_product")
    case = Case(777, 128, 64, 2, 64, initial_state=False, dtype="bfloat16", heads=4)
    p = build(case)
    beta = p.beta.astype(jnp.bfloat16)        # as fla takes it; the recurrence keeps float32
    o, final_state = gdp_jax.chunk_gated_delta_product(
        p.q, p.k, p.v, p.g_raw, beta, segment_ids=p.segment_ids, output_final_state=True,
        chunk_size=64, implementation="pallas")
    ids = np.asarray(p.segment_ids)
    batch, tokens = ids.shape
    starts = {0}
    for b in range(batch):
        cuts = np.flatnonzero(ids[b, 1:] != ids[b, :-1]) + 1
        starts.update((b * tokens + cuts).tolist())
        starts.add((b + 1) * tokens)
    cu_seqlens = sorted(starts)
    last_segment_of_row = [cu_seqlens.index((b + 1) * tokens) - 1 for b in range(batch)]
    assert len(cu_seqlens) - 1 > 2 * batch                  # several segments per row

    def to_torch(x, dtype):
        x = np.asarray(jnp.asarray(x, jnp.float32))
        return torch.from_numpy(x.reshape(1, -1, *x.shape[2:])).to("cuda", dtype)

    o_fla, state_fla = fla_gdp.chunk_gated_delta_product(
        to_torch(p.q, torch.bfloat16), to_torch(p.k, torch.bfloat16),
        to_torch(p.v, torch.bfloat16), to_torch(p.g_raw, torch.float32),
        to_torch(beta, torch.bfloat16), num_householder=case.m, output_final_state=True,
        cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.long, device="cuda"))
    o_fla = o_fla.float().cpu().numpy().reshape(o.shape)
    state_fla = state_fla.float().cpu().numpy()[last_segment_of_row]
    errors = dict(o_vs_fla=rel_err(o, o_fla), state_vs_fla=rel_err(final_state, state_fla),
                  fla_o_vs_recurrence=rel_err(o_fla, p.ref["o"]),
                  o_vs_recurrence=rel_err(o, p.ref["o"]),
                  fla_state_vs_recurrence=rel_err(state_fla, p.ref["final_state"]))
    assert max(errors.values()) < gpu_tol("bfloat16"), errors
