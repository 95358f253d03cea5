"""The fused backward kernel of chunk_o (chunk_o_bwd_pallas) against autodiff references.

CPU: the kernel in Pallas' interpreter on small shapes, against float64 autodiff of the independent
dense statement of SPEC's chunked form (helpers.dense_chunked_form); the jnp path's own VJP checked
against float64 finite differences. GPU (marked, skipped elsewhere): the compiled Triton kernel at
realistic shapes, against jax.vjp of the jnp path (itself checked here).

The other structures (BwdKernelConfig.variant, chunk_o_bwd_pallas_split) run the same checks on a
covering subset of shapes, each with several key and value blocks.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax import reference
from gdp_jax.chunk_o import chunk_o_xla
from gdp_jax.chunk_o_bwd_pallas import BwdKernelConfig, bwd_kernel_config, chunk_o_bwd_pallas
from gdp_jax.segments import segment_runs
from helpers import dense_chunked_form, make_problem, random_segment_ids, rel_err

NAMES = ("dq", "dk", "dv", "dh", "dg")


def _inputs(seed, *, tokens, m, chunk_size, key_dim, value_dim, gated, segments, dtype=np.float32,
            h_dtype=None, batch=2, heads=2):
    """Random primal inputs and cotangent. The VJP needs no consistent (h, v_new), so unlike
    ``make_problem`` this skips the recurrence (its compile per shape would dominate these tests)."""
    rng = np.random.default_rng(seed)
    num_chunks = -(-tokens // chunk_size)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
    k = normal(batch, tokens * m, heads, key_dim)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = None
    if gated:
        g_raw = -rng.uniform(0.0, 0.25, size=(batch, tokens, heads)).astype(np.float32)
        g = reference.chunk_local_log2_cumsum(jnp.asarray(g_raw), chunk_size).astype(jnp.float32)
    runs = (segment_runs(jnp.asarray(random_segment_ids(rng, batch, tokens, chunk_size)))
            if segments else None)
    cast = lambda x, dt=dtype: jnp.asarray(x, dt)
    args = (cast(normal(batch, tokens, heads, key_dim)), cast(k),
            cast(normal(batch, tokens * m, heads, value_dim)),
            cast(0.5 * normal(batch, num_chunks, heads, key_dim, value_dim), h_dtype or dtype),
            g, runs, cast(normal(batch, tokens, heads, value_dim)))
    return args, dict(scale=key_dim ** -0.5, chunk_size=chunk_size, num_householder=m)


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "num_householder"))
def _xla_vjp(q, k, v, h, g, runs, do, **kw):
    """jax.vjp of chunk_o_xla, evaluated in float32 (full-precision dots) on the given values."""
    f32 = lambda x: None if x is None else x.astype(jnp.float32)
    primals = [f32(x) for x in (q, k, v, h)] + ([] if g is None else [f32(g)])
    fn = lambda q, k, v, h, g=None: chunk_o_xla(q, k, v, h, g, runs, **kw)
    with jax.default_matmul_precision("highest"):
        _, vjp = jax.vjp(fn, *primals)
        grads = vjp(f32(do))
    return tuple(grads) + ((None,) if g is None else ())


def _dense_vjp(q, k, v, h, g, runs, do, *, scale, chunk_size, num_householder):
    """float64 autodiff of helpers.dense_chunked_form, an implementation independent of ours.

    Run numbers are themselves valid segment ids (a new segment wherever they change)."""
    del num_householder  # dense_chunked_form reads M from k
    ids = None if runs is None else np.asarray(runs)
    with jax.enable_x64(True):
        f64 = lambda x: None if x is None else jnp.asarray(np.asarray(jnp.asarray(x, jnp.float32), np.float64))
        primals = [f64(x) for x in (q, k, v, h)] + ([] if g is None else [f64(g)])
        fn = lambda q, k, v, h, g=None: dense_chunked_form(q, k, v, h, g, ids, scale=scale,
                                                           chunk_size=chunk_size)
        _, vjp = jax.vjp(fn, *primals)
        grads = [np.asarray(x) for x in vjp(f64(do))]
    return tuple(grads) + ((None,) if g is None else ())


# Variant name -> (variant, roles): every structure, and within "roles" and "split" the shapes of role
# sets the kernel supports (per-copy dkv programs or a copy loop; dg in one role or in slots; one role
# or several in a call).
VARIANTS = {
    "roles": ("roles", "dh|dq|dkv/m"),
    "roles_dh_dq": ("roles", "dkv/m|dh+dq"),
    "roles_loop": ("roles", "dkv|dq|dh"),
    "roles_one": ("roles", "dh+dq+dkv"),
    "split": ("split", "dq|dkv/m"),
    "split_one": ("split", "dq+dkv"),
    "split_state": ("split_state", "dq|dkv/m"),
}


def _variant_config(name, *, block_k=16, block_v=16, dh_block_k=0, dh_block_v=0, **launch):
    variant, roles = VARIANTS[name]
    launch = dict(dict(num_warps=4, num_stages=1), **launch)
    return BwdKernelConfig(block_k=block_k, block_v=block_v, variant=variant, roles=roles,
                           dh_block_k=dh_block_k, dh_block_v=dh_block_v, **launch)


def _gpu_variant_config(name, key_dim, value_dim, chunk_size, m, dtype):
    """The default blocks for the shape, with the variant's structure and 4 warps."""
    variant, roles = VARIANTS[name]
    base = bwd_kernel_config(key_dim, value_dim, chunk_size, m, jnp.dtype(dtype).itemsize)
    return dataclasses.replace(base, variant=variant, roles=roles, num_warps=4)


def _check(args, kw, tol, interpret=True, config=None):
    q, k, v, h, g, runs, do = args
    got = chunk_o_bwd_pallas(*args, interpret=interpret, config=config, **kw)
    want = (_dense_vjp if interpret else _xla_vjp)(*args, **kw)
    primals = (q, k, v, h, g)
    for name, x, ref, primal in zip(NAMES, got, want, primals):
        if primal is None:
            assert x is None, name
            continue
        assert x.shape == primal.shape, (name, x.shape, primal.shape)
        want_dtype = jnp.float32 if name == "dg" else primal.dtype
        assert x.dtype == want_dtype, (name, x.dtype)
        err = rel_err(x, ref)
        assert err < tol, f"{name}: relative error {err:.3g} >= {tol}"


# A covering grid rather than the full product (interpret mode is slow): every (T, M) pair meets every
# (g, segments) combination; chunk size and the K/V shape alternate across it so each meets both values.
_GRID = [(tokens, m, gated, segments)
         for tokens in (64, 77) for m in (1, 2, 3)
         for gated, segments in ((True, True), (False, False), (True, False), (False, True))]


@pytest.mark.parametrize("tokens,m,gated,segments", _GRID)
def test_float32_against_dense_autodiff(tokens, m, gated, segments):
    i = _GRID.index((tokens, m, gated, segments))
    chunk_size = (16, 32)[(i + i // 4) % 2]
    key_dim, value_dim = ((32, 16), (16, 32))[(i // 2) % 2]
    args, kw = _inputs(i, tokens=tokens, m=m, chunk_size=chunk_size, key_dim=key_dim,
                       value_dim=value_dim, gated=gated, segments=segments)
    _check(args, kw, 1e-5)


@pytest.mark.parametrize("m,h_dtype", [(1, None), (2, None), (3, None), (2, jnp.float32)])
def test_bfloat16_against_dense_autodiff(m, h_dtype):
    args, kw = _inputs(100 + m, tokens=77, m=m, chunk_size=16, key_dim=32, value_dim=16, gated=True,
                       segments=True, dtype=jnp.bfloat16, h_dtype=h_dtype)
    _check(args, kw, 2e-2)


@pytest.mark.parametrize("key_dim,value_dim,gated", [(256, 128, True), (16, 256, False)])
def test_default_blocks_of_wide_heads(key_dim, value_dim, gated):
    """K or V wider than the default blocks: 2 key x 2 value blocks, then 1 x 2."""
    args, kw = _inputs(7, tokens=40, m=2, chunk_size=16, key_dim=key_dim, value_dim=value_dim,
                       gated=gated, segments=True, batch=1, heads=1)
    _check(args, kw, 1e-5)


# The three structures meet every (g, segments) combination, M = 1..3, whole and partial last chunks;
# the other role sets two of those cases (M = 3 with g and segments, a partial chunk without g).
_VARIANT_GRID = [(77, 3, True, True), (45, 2, False, True), (64, 2, False, False), (77, 1, True, False)]
_MAIN_VARIANTS = ("roles", "split", "split_state")
_VARIANT_CASES = [(name, case) for name in VARIANTS
                  for case in (_VARIANT_GRID if name in _MAIN_VARIANTS else _VARIANT_GRID[:2])]


@pytest.mark.parametrize("name,case", _VARIANT_CASES)
def test_variants_float32_against_dense_autodiff(name, case):
    """K = 32, V = 64 in 16-wide blocks (2 x 4); dh in its own blocks (32 x 16) for half the cases."""
    tokens, m, gated, segments = case
    i = _VARIANT_GRID.index(case)
    args, kw = _inputs(200 + i, tokens=tokens, m=m, chunk_size=16, key_dim=32, value_dim=64,
                       gated=gated, segments=segments, batch=1, heads=2)
    config = _variant_config(name, dh_block_k=32 if i % 2 else 0, dh_block_v=16 if i % 2 else 0)
    _check(args, kw, 1e-5, config=config)


@pytest.mark.parametrize("name", _MAIN_VARIANTS)
def test_variants_bfloat16_against_dense_autodiff(name):
    args, kw = _inputs(300, tokens=77, m=2, chunk_size=16, key_dim=32, value_dim=16, gated=True,
                       segments=True, dtype=jnp.bfloat16, h_dtype=jnp.float32, batch=1, heads=2)
    _check(args, kw, 2e-2, config=_variant_config(name))


def test_variant_and_roles_are_checked():
    args, kw = _inputs(9, tokens=20, m=2, chunk_size=16, key_dim=16, value_dim=16, gated=True,
                       segments=False, batch=1, heads=1)
    for bad, match in [(dict(variant="nope"), "variant"),
                       (dict(variant="roles", roles="dh|dq"), "all of"),
                       (dict(variant="roles", roles="dh|dq|dq+dkv"), "at most once"),
                       (dict(variant="roles", roles="dh|dq|dkv|dx"), "at most once"),
                       (dict(variant="roles", roles="dh|dq+dkv/m"), "per copy"),
                       (dict(variant="split", roles="dh|dq|dkv"), "runs dh apart"),
                       (dict(variant="split", dh_block_v=48), "dh_block_v")]:
        config = BwdKernelConfig(block_k=16, block_v=16, num_warps=4, num_stages=1, **bad)
        with pytest.raises(ValueError, match=match):
            chunk_o_bwd_pallas(*args, interpret=True, config=config, **kw)


def test_config_override_splits_key_and_value_blocks():
    """block_k = 16 < K = 32 and block_v = 16 < V = 64: 2 x 4 blocks, with M = 3, g and segments."""
    args, kw = _inputs(9, tokens=45, m=3, chunk_size=16, key_dim=32, value_dim=64, gated=True,
                       segments=True, batch=1, heads=2)
    config = BwdKernelConfig(block_k=16, block_v=16, num_warps=4, num_stages=1)
    got = chunk_o_bwd_pallas(*args, interpret=True, config=config, **kw)
    for name, x, ref in zip(NAMES, got, _dense_vjp(*args, **kw)):
        assert rel_err(x, ref) < 1e-5, name
    bad = BwdKernelConfig(block_k=32, block_v=48, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="block_v"):
        chunk_o_bwd_pallas(*args, interpret=True, config=bad, **kw)


@pytest.mark.parametrize("name", [None] + list(VARIANTS))
@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
def test_strong_decay_in_partial_chunk_stays_finite(interpret, name):
    """Padding rows of the last chunk must not form 2^(0 - g[s]) = inf (inf * 0 = NaN in dk, dv, dg).

    Two steps of -100 (log2) near the end of the partial last chunk put g below -128 there. Reference:
    the jnp path on the problem padded to whole chunks by hand (padding rows repeat the last real g, so
    nothing overflows), cut back to T.
    """
    tokens, chunk_size, m, dim = 40, 16, 2, 16
    args, kw = _inputs(3, tokens=tokens, m=m, chunk_size=chunk_size, key_dim=dim, value_dim=dim,
                       gated=False, segments=False, batch=1, heads=2)
    q, k, v, h, _, _, do = args
    steps = np.full((1, tokens, 2), -0.5, np.float32)
    steps[:, tokens - 2:] = -100.0
    g = jnp.asarray(np.concatenate([np.cumsum(steps[:, i:i + chunk_size], axis=1)
                                    for i in range(0, tokens, chunk_size)], axis=1))
    assert float(g.min()) < -128
    config = None if name is None else _variant_config(name)
    got = chunk_o_bwd_pallas(q, k, v, h, g, None, do, interpret=interpret, config=config, **kw)
    for out_name, x in zip(NAMES, got):
        assert bool(jnp.all(jnp.isfinite(x))), out_name

    extra = -(-tokens // chunk_size) * chunk_size - tokens
    pad = lambda x, n, mode="constant": jnp.pad(x, [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2), mode=mode)
    want = _xla_vjp(pad(q, extra), pad(k, extra * m), pad(v, extra * m), h, pad(g, extra, "edge"), None,
                    pad(do, extra), **kw)
    want = [want[0][:, :tokens], want[1][:, :tokens * m], want[2][:, :tokens * m], want[3],
            want[4][:, :tokens]]
    for out_name, x, ref in zip(NAMES, got, want):
        assert rel_err(x, ref) < (1e-5 if interpret else 2e-3), out_name


@pytest.mark.parametrize("name", [None, "roles", "split_state"])
def test_under_jit(name):
    args, kw = _inputs(11, tokens=50, m=2, chunk_size=16, key_dim=16, value_dim=16, gated=True,
                       segments=True, batch=1, heads=2)
    config = None if name is None else _variant_config(name)
    got = jax.jit(functools.partial(chunk_o_bwd_pallas, interpret=True, config=config, **kw))(*args)
    want = chunk_o_bwd_pallas(*args, interpret=True, config=config, **kw)
    for out_name, x, ref in zip(NAMES, got, want):
        assert rel_err(x, ref) < 1e-6, out_name


def test_xla_vjp_against_finite_differences():
    """The reference above is itself right: central differences of chunk_o_xla at float64 inputs.

    chunk_o_xla accumulates in float32 even for float64 inputs, so the loss carries float32 rounding;
    eps = 1e-2 keeps that below ~1e-5 relative (q, k, v, h enter linearly, so the central difference is
    exact for them; for g its O(eps^2) error is ~1e-6). A wrong gradient is off by O(1).
    """
    with jax.enable_x64(True):
        tokens, m, chunk_size, dim = 21, 2, 16, 16
        p = make_problem(5, batch=1, tokens=tokens, heads=2, key_dim=dim, value_dim=dim, m=m,
                         chunk_size=chunk_size, dtype=np.float64)
        runs = segment_runs(p["segment_ids"])
        kw = dict(scale=dim ** -0.5, chunk_size=chunk_size, num_householder=m)
        primals = [jnp.asarray(p[n], jnp.float64) for n in ("q", "k", "v", "h", "g")]
        rng = np.random.default_rng(6)
        weights = jnp.asarray(rng.normal(size=p["o_ref"].shape))
        loss = jax.jit(lambda *a: jnp.sum(weights * chunk_o_xla(*a, runs, **kw)))
        grads = jax.grad(loss, argnums=tuple(range(5)))(*primals)
        eps = 1e-2
        for i, name in enumerate(NAMES):
            direction = jnp.asarray(rng.normal(size=primals[i].shape))
            plus = [x + eps * direction if j == i else x for j, x in enumerate(primals)]
            minus = [x - eps * direction if j == i else x for j, x in enumerate(primals)]
            numeric = float(loss(*plus) - loss(*minus)) / (2 * eps)
            analytic = float(jnp.sum(grads[i] * direction))
            assert abs(numeric - analytic) <= 1e-4 * abs(analytic), (name, numeric, analytic)


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("dim", [128, 256])
@pytest.mark.parametrize("gated,segments", [(True, True), (False, False)])
def test_gpu_against_xla_vjp(dtype, dim, gated, segments):
    """The compiled Triton kernel; tf32 dots for float32 inputs (SPEC: 2e-3), bf16 2e-2."""
    args, kw = _inputs(dim + gated, tokens=1000, m=2, chunk_size=64, key_dim=dim, value_dim=dim,
                       gated=gated, segments=segments, dtype=dtype, batch=2, heads=4)
    _check(args, kw, 2e-3 if dtype == np.float32 else 2e-2, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("m,chunk_size,key_dim,value_dim", [(1, 64, 64, 64), (3, 64, 128, 128),
                                                            (2, 32, 128, 256), (2, 128, 64, 128),
                                                            (3, 16, 16, 32)])
def test_gpu_shapes(m, chunk_size, key_dim, value_dim):
    args, kw = _inputs(m + key_dim, tokens=333, m=m, chunk_size=chunk_size, key_dim=key_dim,
                       value_dim=value_dim, gated=True, segments=True, dtype=jnp.bfloat16, batch=2,
                       heads=3)
    _check(args, kw, 2e-2, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("m,dim,dtype,gated,segments", [(2, 128, jnp.bfloat16, True, True),
                                                        (3, 128, np.float32, False, False),
                                                        (1, 64, jnp.bfloat16, True, False),
                                                        (2, 64, np.float32, True, True)])
def test_gpu_variants_against_xla_vjp(name, m, dim, dtype, gated, segments):
    """Each variant compiled (default blocks, 4 warps) at a realistic shape with a partial last chunk;
    tf32 dots for float32 (SPEC: 2e-3), bf16 2e-2."""
    args, kw = _inputs(dim + m, tokens=1000, m=m, chunk_size=64, key_dim=dim, value_dim=dim,
                       gated=gated, segments=segments, dtype=dtype, batch=2, heads=4)
    config = _gpu_variant_config(name, dim, dim, 64, m, dtype)
    _check(args, kw, 2e-3 if dtype == np.float32 else 2e-2, interpret=False, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["roles", "split", "split_state"])
@pytest.mark.parametrize("num_warps,num_stages", [(8, 1), (4, 2), (4, 3)])
def test_gpu_variant_launches(name, num_warps, num_stages):
    """The launch settings the sweep tries, on one shape: results do not depend on them."""
    args, kw = _inputs(17, tokens=700, m=2, chunk_size=64, key_dim=128, value_dim=128, gated=True,
                       segments=True, dtype=jnp.bfloat16, batch=2, heads=3)
    config = dataclasses.replace(_gpu_variant_config(name, 128, 128, 64, 2, jnp.bfloat16),
                                 num_warps=num_warps, num_stages=num_stages)
    _check(args, kw, 2e-2, interpret=False, config=config)
