"""Stage 2, the WY representation, on its sub-chunk grid: ``wy_pallas`` (forward kernel, 16-bit
and float32 branches, ``return_inverse``), ``wy_bwd_pallas`` (its VJP kernel: ``precision`` and
``operand_dtype`` paths, column blocks, ``dk_accumulate``) interpreted, and ``wy_bwd_xla`` (the
compiled float32 path's VJP, written out), against float64.

Reference: ``wy_dense``, one dense S x S system per sub-chunk evaluated in float64 (its inverse by
``unit_lower_inverse``, as LAPACK solves can deadlock jaxlib 0.10's CPU thread pool), and its
float64 autodiff. ``test_dense_reference_is_wy_xla`` checks that it is ``wy_xla(chunk_size=S,
num_householder=1)``, the stage as the jnp path states it. wy_xla itself is checked through the
full op's jnp path against the recurrence (test_full_op.py).
"""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax._src.layout import l2norm, l2norm_factor
from gdp_jax._src.segments import segment_runs
from gdp_jax.ops.cumsum import expanded_log2_decays
from gdp_jax.ops.wy import unit_lower_inverse, wy_bwd_pallas, wy_bwd_xla, wy_pallas, wy_xla
from gdp_jax.ops.wy.pallas_bwd import BlockSizes
from gdp_jax.ops.wy.pallas_fwd import (BlockSizes as WyBlockSizes, default_num_warps,
                                       default_sub_chunks_per_program, default_substituted_rows)
from cases import assert_all_close, assert_close, rel_err, seed_of, to64, tolerance

M = 2                        # Householder steps per token: gates sit at every M-th position
NAMES = ("dk", "dv", "dbeta", "dgamma")


def _segment_ids(batch, positions, sub_chunk):
    """[B, P] ids: several segments inside sub-chunks, one starting exactly at a sub-chunk start
    (position S) and inside a 16-row block, one of length 1; row 1 is packed differently and
    repeats an id non-adjacently."""
    s = sub_chunk
    starts = [{0, 3, s // 2, s // 2 + 1, s, s + s // 4 + 1}, {0, s - 5, s + s // 2, 2 * s - 1}]
    rows = []
    for b in range(batch):
        boundaries = np.zeros(positions, np.int32)
        boundaries[sorted(x for x in starts[b % 2] if x < positions)] = 1
        ids = np.cumsum(boundaries) - 1
        rows.append(np.where(ids % 3 == 2, 0, ids) if b % 2 else ids)
    return np.stack(rows).astype(np.int32)


@functools.lru_cache(maxsize=None)
def make_inputs(*, sub_chunk, num_sub_chunks, key_dim, value_dim, gated, segments,
                dtype="float32", batch=2, heads=2, keys="random"):
    """Primals (k, v, beta, gamma, runs) and cotangents (dw, du), rounded to ``dtype`` (gamma
    float32, runs int32): what the kernels read is exactly what the reference sees.

    keys="repeated": one direction per head plus 1% noise, beta in [1.5, 2), log decays in
    (-0.02, 0]: the powers of each diagonal block of A grow like binomials (a run of repeated
    tokens under negative eigenvalues) while (I + A)^{-1} stays small.
    """
    rng = np.random.default_rng(seed_of("wy", sub_chunk, num_sub_chunks, key_dim, value_dim,
                                        gated, segments, dtype, keys))
    positions = sub_chunk * num_sub_chunks
    shape = (batch, positions, heads)
    if keys == "random":
        k = rng.normal(size=shape + (key_dim,))
        beta = rng.uniform(0.0, 2.0, size=shape)
    else:
        k = rng.normal(size=(1, 1, heads, key_dim)) + 0.01 * rng.normal(size=shape + (key_dim,))
        beta = rng.uniform(1.5, 2.0, size=shape)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    gamma = None
    if gated:   # natural-log gates per token -> sub-chunk-local cumulative log2 decays per position
        g_raw = -rng.uniform(0.01, 0.5 if keys == "random" else 0.02, size=(batch, positions // M, heads))
        gamma = expanded_log2_decays(jnp.asarray(g_raw, jnp.float32), M, positions, sub_chunk)
    runs = segment_runs(jnp.asarray(_segment_ids(batch, positions, sub_chunk))) if segments else None
    cast = lambda x: jnp.asarray(x, dtype)
    primals = (cast(k), cast(rng.normal(size=shape + (value_dim,))), cast(beta), gamma, runs)
    cotangents = (cast(rng.normal(size=shape + (key_dim,))),
                  cast(rng.normal(size=shape + (value_dim,))))
    return primals, cotangents


def wy_dense(k, v, beta, gamma, runs, *, sub_chunk):
    """(w, u) in the inputs' dtype: per sub-chunk, A[j, i] = beta_j 2^(gamma_j - gamma_i) k_j·k_i
    for i < j in one run, T = (I + A)^{-1}, w = T (beta live 2^gamma k), u = T (beta v)."""
    batch, positions, heads, _ = k.shape
    n, s = positions // sub_chunk, sub_chunk
    per_sub_chunk = lambda x: jnp.moveaxis(x.reshape((batch, n, s) + x.shape[2:]), 2, -1)
    kc = jnp.moveaxis(per_sub_chunk(k), -1, -2)                           # [B, n, H, S, K]
    vc = jnp.moveaxis(per_sub_chunk(v), -1, -2)                           # [B, n, H, S, V]
    bc = per_sub_chunk(beta)                                              # [B, n, H, S]
    gc = jnp.zeros_like(bc) if gamma is None else per_sub_chunk(gamma.astype(bc.dtype))
    rc = jnp.zeros((batch, n, 1, s), jnp.int32) if runs is None else runs.reshape(batch, n, 1, s)
    mask = (rc[..., :, None] == rc[..., None, :]) & jnp.tril(jnp.ones((s, s), bool), -1)
    decay = jnp.where(mask, jnp.exp2(jnp.where(mask, gc[..., :, None] - gc[..., None, :], 0.0)), 0.0)
    hi = jax.lax.Precision.HIGHEST
    a = bc[..., :, None] * decay * jnp.einsum("...jd,...id->...ji", kc, kc, precision=hi)
    t_inv = unit_lower_inverse(a)
    live = (rc == rc[..., :1]).astype(bc.dtype)
    rhs_w = (bc * live * jnp.exp2(gc))[..., None] * kc
    w = jnp.einsum("...ji,...id->...jd", t_inv, rhs_w, precision=hi)
    u = jnp.einsum("...ji,...id->...jd", t_inv, bc[..., None] * vc, precision=hi)
    unchunk = lambda x: jnp.moveaxis(x, 2, 3).reshape((batch, positions, heads, x.shape[-1]))
    return unchunk(w), unchunk(u), jnp.moveaxis(t_inv, 2, 3).reshape(batch, positions, heads, s)


def wy_numpy(primals, sub_chunk):
    """(w, u, T) of wy_dense's statement in float64 numpy, T = (I + A)^{-1} by LAPACK per
    sub-chunk, laid out as wy_pallas returns it ([B, P, H, S], row j: T[j, :])."""
    k, v, beta, gamma, runs = (to64(x) for x in primals)
    batch, positions, heads, _ = k.shape
    n, s = positions // sub_chunk, sub_chunk
    per = lambda x: x.reshape((batch, n, s, heads) + x.shape[3:]).swapaxes(2, 3)   # [B, n, H, S, ...]
    kc, vc, bc = per(k), per(v), per(beta)
    gc = np.zeros_like(bc) if gamma is None else per(gamma)
    rc = np.zeros((batch, n, 1, s)) if runs is None else runs.reshape(batch, n, 1, s)
    mask = (rc[..., :, None] == rc[..., None, :]) & np.tril(np.ones((s, s), bool), -1)
    decay = np.where(mask, np.exp2(np.where(mask, gc[..., :, None] - gc[..., None, :], 0.0)), 0.0)
    a = bc[..., :, None] * decay * np.einsum("...jd,...id->...ji", kc, kc)
    t_inv = np.linalg.inv(np.eye(s) + a)
    live = (rc == rc[..., :1]).astype(np.float64)
    w = t_inv @ ((bc * live * np.exp2(gc))[..., None] * kc)
    u = t_inv @ (bc[..., None] * vc)
    unchunk = lambda x: x.swapaxes(2, 3).reshape(batch, positions, heads, x.shape[-1])
    return unchunk(w), unchunk(u), unchunk(t_inv)


_VJP_CACHE = {}


def reference_vjp(primals, cotangents, sub_chunk):
    """(dk, dv, dbeta, dgamma or None): float64 autodiff of wy_dense at the (rounded) inputs;
    cached per input set (make_inputs caches those), as several tests share one."""
    key = (id(primals), id(cotangents), sub_chunk)
    if key not in _VJP_CACHE:
        _VJP_CACHE[key] = (primals, cotangents, _reference_vjp(primals, cotangents, sub_chunk))
    return _VJP_CACHE[key][2]


@functools.partial(jax.jit, static_argnames=("sub_chunk",))
def _dense_vjp(primals64, runs, dw, du, *, sub_chunk):
    """One compilation per shape (gamma present or not), runs an argument, not a constant."""
    fn = lambda k, v, beta, *g: wy_dense(k, v, beta, g[0] if g else None, runs,
                                         sub_chunk=sub_chunk)[:2]
    return jax.vjp(fn, *primals64)[1]((dw, du))


def _reference_vjp(primals, cotangents, sub_chunk):
    k, v, beta, gamma, runs = primals
    with jax.enable_x64(True):
        wide = lambda x: jnp.asarray(to64(x))
        primals64 = tuple(wide(x) for x in (k, v, beta)) + (() if gamma is None else (wide(gamma),))
        runs = jnp.zeros(k.shape[:2], jnp.int32) if runs is None else runs
        grads = _dense_vjp(primals64, runs, *[wide(x) for x in cotangents], sub_chunk=sub_chunk)
        grads = [np.asarray(x) for x in grads]
    return dict(zip(NAMES, grads + [None] * (4 - len(grads))))


_FORWARDS = {}


def _forward(primals, sub_chunk, out_dtype=jnp.float32, return_inverse=False):
    """wy_pallas interpreted (once per input set and options: make_inputs caches the inputs)."""
    key = (id(primals), sub_chunk, jnp.dtype(out_dtype), return_inverse)
    if key not in _FORWARDS:
        _FORWARDS[key] = (primals, jax.jit(functools.partial(
            wy_pallas, sub_chunk=sub_chunk, out_dtype=out_dtype, interpret=True,
            return_inverse=return_inverse))(*primals))
    return _FORWARDS[key][1]


# ---------------------------------------------------------------------------------------------
# Forward

@pytest.mark.parametrize("sub_chunk,gated,segments,dtype", [
    (16, False, False, "float32"), (16, True, True, "bfloat16"), (32, True, False, "float32"),
    (64, True, True, "float32"), (64, False, True, "float16")])
def test_wy_pallas_against_float64(sub_chunk, gated, segments, dtype):
    """Every sub-chunk size (1, 2 and 4 diagonal blocks), with and without decays and segments;
    float32 inputs (IEEE dots) and 16-bit ones (16-bit gram operands, T and the right-hand sides
    rounded to 16 bits when applied)."""
    primals, _ = make_inputs(sub_chunk=sub_chunk, num_sub_chunks=2, key_dim=32, value_dim=16,
                             gated=gated, segments=segments, dtype=dtype)
    w_ref, u_ref, _ = wy_numpy(primals, sub_chunk)
    w, u = _forward(primals, sub_chunk)
    assert_close(w, w_ref, tolerance(dtype), "w")
    assert_close(u, u_ref, tolerance(dtype), "u")


@pytest.mark.parametrize("sub_chunk", [16, 64])
def test_wy_pallas_repeated_keys(sub_chunk):
    """Repeated keys and beta near 2 (float32): the diagonal blocks are inverted by forward
    substitution, which only ever holds rows of the inverse. A Neumann-product inverse sums powers
    of A up to 10^5 larger than T here and lost up to 7e-2 of w (benchmarks/RESULTS.md)."""
    primals, _ = make_inputs(sub_chunk=sub_chunk, num_sub_chunks=2, key_dim=32, value_dim=16,
                             gated=True, segments=False, keys="repeated")
    w_ref, u_ref, t_ref = wy_numpy(primals, sub_chunk)
    blocks = t_ref.reshape(2, 2, sub_chunk, 2, sub_chunk).transpose(0, 1, 3, 2, 4)
    kappa = np.linalg.cond(blocks).max()              # of T, = that of I + A
    assert kappa > 100, kappa                         # the case is hard (random keys: ~3)
    w, u = _forward(primals, sub_chunk)
    assert_close(w, w_ref, tolerance("float32", "cpu, ill-conditioned"), "w")
    assert_close(u, u_ref, tolerance("float32", "cpu, ill-conditioned"), "u")


@pytest.mark.parametrize("rows,dtype", [(16, "bfloat16"), (8, "bfloat16"), (2, "bfloat16"),
                                        (4, "float32")])
def test_wy_pallas_substituted_rows(rows, dtype):
    """Each width of the diagonal sub-blocks inverted by substitution (the rest of each diagonal
    block by dots): T against (I + A)^{-1} and w, u against float64, with decays and segments;
    the default (4 rows for 16-bit inputs here) is covered by the tests above."""
    primals, _ = make_inputs(sub_chunk=64, num_sub_chunks=2, key_dim=32, value_dim=16,
                             gated=True, segments=True, dtype=dtype)
    w_ref, u_ref, t_ref = wy_numpy(primals, 64)
    w, u, t_inv = jax.jit(functools.partial(
        wy_pallas, sub_chunk=64, out_dtype=jnp.float32, interpret=True, return_inverse=True,
        block_sizes=WyBlockSizes(substituted_rows=rows)))(*primals)
    assert_close(t_inv, t_ref, tolerance("float32"), "inverse")
    assert_close(w, w_ref, tolerance(dtype), "w")
    assert_close(u, u_ref, tolerance(dtype), "u")


def test_wy_default_substituted_rows_table():
    """RESULTS.md, "WY kernel": 4 rows for 16-bit inputs up to K, V = 128, else 16; any other
    width is refused."""
    assert default_substituted_rows(jnp.bfloat16, 128, 128) == 4
    assert default_substituted_rows(jnp.float16, 64, 32) == 4
    assert default_substituted_rows(jnp.bfloat16, 256, 128) == 16   # the kernel spills: 1.19x with 4
    assert default_substituted_rows(jnp.bfloat16, 128, 256) == 16
    assert default_substituted_rows(jnp.float32, 128, 128) == 16    # IEEE float32 dots
    primals, _ = make_inputs(sub_chunk=16, num_sub_chunks=2, key_dim=32, value_dim=16,
                             gated=False, segments=False)
    with pytest.raises(ValueError, match="substituted_rows must be 2, 4, 8 or 16; got 3"):
        wy_pallas(*primals, sub_chunk=16, out_dtype=jnp.float32, interpret=True,
                  block_sizes=WyBlockSizes(substituted_rows=3))


def test_wy_default_num_warps_table():
    """RESULTS.md, "WY kernel": 2 warps where the kernel writes w and u, 1 where it writes T alone
    (BlockSizes leaves it to this rule unless set)."""
    assert default_num_warps(True) == 2 and default_num_warps(False) == 1
    assert WyBlockSizes().num_warps is None


@pytest.mark.parametrize("sub_chunk,gated,segments", [(16, False, True), (64, True, True)])
def test_wy_pallas_return_inverse(sub_chunk, gated, segments):
    """return_inverse's T is (I + A)^{-1} per sub-chunk (row j: T[j, :]), float32; w and u are
    those of the call without it."""
    primals, _ = make_inputs(sub_chunk=sub_chunk, num_sub_chunks=2, key_dim=32, value_dim=64,
                             gated=gated, segments=segments)
    _, _, t_ref = wy_numpy(primals, sub_chunk)
    w, u, t_inv = _forward(primals, sub_chunk, return_inverse=True)
    chex.assert_type(t_inv, jnp.float32)
    eye = np.eye(sub_chunk)[np.arange(t_ref.shape[1]) % sub_chunk][None, :, None]
    assert np.abs(t_ref - eye).max() > 0.1           # A is far from 0: the test can fail
    assert_close(t_inv, t_ref, tolerance("float32"), "inverse")
    chex.assert_trees_all_equal((w, u), _forward(primals, sub_chunk))


def test_references_agree():
    """wy_dense (what the VJP references differentiate, in float64) and wy_xla (the stage as the
    jnp path states it, M = 1 and chunk = S: the sub-chunk grid) both equal the LAPACK statement."""
    sub_chunk = 32
    primals, _ = make_inputs(sub_chunk=sub_chunk, num_sub_chunks=3, key_dim=32, value_dim=64,
                             gated=True, segments=True)
    k, v, beta, gamma, runs = primals
    w_ref, u_ref, t_ref = wy_numpy(primals, sub_chunk)
    w, u = jax.jit(functools.partial(wy_xla, chunk_size=sub_chunk, num_householder=1))(
        k, v, beta, gamma, runs)
    assert_close(w, w_ref, tolerance("float32"), "wy_xla w")
    assert_close(u, u_ref, tolerance("float32"), "wy_xla u")
    with jax.enable_x64(True):
        dense = jax.jit(functools.partial(wy_dense, runs=runs, sub_chunk=sub_chunk))(
            *[jnp.asarray(to64(x)) for x in (k, v, beta, gamma)])
        for name, x, ref in zip(("w", "u", "T"), dense, (w_ref, u_ref, t_ref)):
            np.testing.assert_allclose(np.asarray(x), ref, rtol=1e-9, atol=1e-12, err_msg=name)


# ---------------------------------------------------------------------------------------------
# Backward

def _bwd_pallas(primals, cotangents, sub_chunk, **kw):
    inverse = _forward(primals, sub_chunk, out_dtype=primals[0].dtype, return_inverse=True)[2]
    return jax.jit(functools.partial(wy_bwd_pallas, sub_chunk=sub_chunk, interpret=True, **kw))(
        *primals, inverse, *cotangents)


def _bwd_xla(primals, cotangents, sub_chunk):
    k, v, beta, gamma, runs = primals
    return jax.jit(functools.partial(wy_bwd_xla, chunk_size=sub_chunk))(
        k, v, beta, gamma, runs, *cotangents)


# (implementation, sub_chunk, g, segments, dtype, kernel options): every sub-chunk size and
# (g, segments) combination; the kernel's dot paths: IEEE float32 (precision HIGHEST, the
# default: float32 inputs), TF32 (precision None: float16 inputs; float32 in the interpreter),
# bfloat16 operands (operand_dtype: bfloat16 inputs), and column blocks narrower than K and V.
BWD_CASES = {
    "pallas-S16-g-seg": ("pallas", 16, True, True, "float32", {}),
    "pallas-S32-precision-None": ("pallas", 32, False, False, "float32", dict(precision=None)),
    "pallas-S64-g-block-cols-16": ("pallas", 64, True, False, "float32",
                                   dict(block_sizes=BlockSizes(block_cols=16))),
    "pallas-S64-seg": ("pallas", 64, False, True, "float32", {}),
    "pallas-S64-bf16-inputs": ("pallas", 64, True, True, "bfloat16", {}),
    "pallas-S64-bf16-operands": ("pallas", 64, True, True, "bfloat16",
                                 dict(operand_dtype=jnp.bfloat16)),
    "xla-S16-g-seg": ("xla", 16, True, True, "float32", {}),
}


@pytest.mark.parametrize("name", list(BWD_CASES))
def test_wy_bwd_against_float64_autodiff(name):
    implementation, sub_chunk, gated, segments, dtype, kw = BWD_CASES[name]
    primals, cotangents = make_inputs(sub_chunk=sub_chunk, num_sub_chunks=3 if sub_chunk < 64 else 2,
                                      key_dim=32, value_dim=64, gated=gated, segments=segments,
                                      dtype=dtype)
    if implementation == "pallas":
        got = _bwd_pallas(primals, cotangents, sub_chunk, **kw)
    else:
        got = _bwd_xla(primals, cotangents, sub_chunk)
    want = reference_vjp(primals, cotangents, sub_chunk)
    for name_, x, primal in zip(NAMES, got, primals):
        if x is not None:
            chex.assert_equal_shape([x, primal])
            chex.assert_type(x, jnp.float32)
    # 16-bit inputs with float32 dots are float32 arithmetic on what the reference sees; 16-bit
    # operands round every dot's operands once more, so they take the half-input bound.
    rounded_operands = "operand_dtype" in kw
    assert_all_close(dict(zip(NAMES, got)), want,
                     tolerance("bfloat16" if rounded_operands else "float32"))


def test_wy_bwd_dk_accumulate_and_out_dtype():
    """dk_accumulate (the op passes the state walk's and the output stage's shares of dk) is added
    to dk in float32, and dk, dv come rounded to out_dtype; dbeta, dgamma stay float32."""
    sub_chunk = 64
    primals, cotangents = make_inputs(sub_chunk=sub_chunk, num_sub_chunks=2, key_dim=32,
                                      value_dim=64, gated=True, segments=True, dtype="bfloat16")
    extra = jax.random.normal(jax.random.PRNGKey(3), primals[0].shape, jnp.float32)
    halves = (0.5 * extra, (0.5 * extra).astype(jnp.bfloat16))            # any dtypes
    got = _bwd_pallas(primals, cotangents, sub_chunk, dk_accumulate=halves,
                      out_dtype=jnp.bfloat16)
    want = reference_vjp(primals, cotangents, sub_chunk)
    chex.assert_type(got, [jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32])
    assert rel_err(got[0], want["dk"]) > 0.1                # the extra term is really there
    # dk and dv are rounded to bfloat16 once; dbeta and dgamma are float32 arithmetic on the
    # rounded inputs the reference sees.
    assert_close(got[0], want["dk"] + np.asarray(extra), tolerance("bfloat16"), "dk")
    assert_close(got[1], want["dv"], tolerance("bfloat16"), "dv")
    assert_close(got[2], want["dbeta"], tolerance("float32"), "dbeta")
    assert_close(got[3], want["dgamma"], tolerance("float32"), "dgamma")


def test_wy_bwd_walk_share_gates():
    """walk_share_gates: the first dk_accumulate share's gate terms, ln2 (-k_j·dk_j at j, their
    sum over the sub-chunk at its last position), are added to dgamma and nothing else changes;
    without gates there are none."""
    sub_chunk = 32
    primals, cotangents = make_inputs(sub_chunk=sub_chunk, num_sub_chunks=3, key_dim=32,
                                      value_dim=64, gated=True, segments=True, dtype="float32")
    share = jax.random.normal(jax.random.PRNGKey(5), primals[0].shape, jnp.float32)
    other = jax.random.normal(jax.random.PRNGKey(6), primals[0].shape, jnp.float32)
    call = lambda primals, **kw: _bwd_pallas(primals, cotangents, sub_chunk,
                                             dk_accumulate=(share, other), **kw)
    base, got = call(primals), call(primals, walk_share_gates=True)
    k = np.asarray(primals[0], np.float64)
    z = np.log(2.0) * np.sum(k * np.asarray(share, np.float64), axis=-1)     # [B, P, H]
    batch, positions, heads = z.shape
    z = z.reshape(batch, positions // sub_chunk, sub_chunk, heads)
    terms = -z
    terms[:, :, -1] += z.sum(axis=2)
    assert_close(got[3], np.asarray(base[3]) + terms.reshape(batch, positions, heads),
                 tolerance("float32"), "dgamma")
    chex.assert_trees_all_equal(got[:3], base[:3])
    ungated = primals[:3] + (None,) + primals[4:]
    chex.assert_trees_all_equal(call(ungated, walk_share_gates=True), call(ungated))


def _pull_back(t, x, sub_chunk):
    """T^T x per sub-chunk in float64 (T the forward's inverse [B, P, H, S]), as float32."""
    batch, positions, heads, _ = t.shape
    blocks = np.asarray(t, np.float64).reshape(batch, positions // sub_chunk, sub_chunk, heads,
                                               sub_chunk)
    x = np.asarray(x, np.float64).reshape(batch, positions // sub_chunk, sub_chunk, heads, -1)
    y = np.einsum("bsjhi,bsjhd->bsihd", blocks, x)
    return jnp.asarray(y.reshape(batch, positions, heads, -1), jnp.float32)


# (sub_chunk, g, segments, dtype, rhs_cotangents, kernel options): key_factor on both routes to
# k·dRw (directly from dRw, and as colsum(T ∘ dW K^T)), with and without the walk's share gates,
# the 16-bit operands of bfloat16 inputs, and column blocks narrower than K.
NORMALIZED_CASES = {
    "S32-g-seg-f32-cols16": (32, True, True, "float32", False,
                             dict(walk_share_gates=True, block_sizes=BlockSizes(block_cols=16))),
    "S16-f32-tf32-rhs": (16, False, False, "float32", True, dict(precision=None)),
    "S64-g-seg-bf16-rhs": (64, True, True, "bfloat16", True,
                           dict(operand_dtype=jnp.bfloat16, walk_share_gates=True,
                                out_dtype=jnp.bfloat16)),
    "S64-g-bf16-rhs-cols16": (64, True, False, "bfloat16", True,
                              dict(operand_dtype=jnp.bfloat16, walk_share_gates=True,
                                   out_dtype=jnp.bfloat16, block_sizes=BlockSizes(block_cols=16))),
}


@pytest.mark.parametrize("name", list(NORMALIZED_CASES))
def test_wy_bwd_key_factor(name):
    """key_factor: given l2norm's rows k = r x of raw keys x and their factors r, dk is the
    cotangent of x, every dk share included: float64 autodiff of x -> (wy_dense(l2norm(x)),
    l2norm(x)) with cotangents (dw, du, the shares' sum). dv, dbeta and dgamma are the plain
    call's (the same k), up to the order of the row sums. K = 32: the cases at 16 columns take
    the row sums from the gram (several key blocks), the others off the one dk tile."""
    sub_chunk, gated, segments, dtype, rhs, kw = NORMALIZED_CASES[name]
    primals, (dw, du) = make_inputs(sub_chunk=sub_chunk, num_sub_chunks=3 if sub_chunk < 64 else 2,
                                    key_dim=32, value_dim=64, gated=gated, segments=segments,
                                    dtype=dtype)
    _, v, beta, gamma, runs = primals
    rng = np.random.default_rng(seed_of("wy_key_factor", name))
    x = rng.normal(size=primals[0].shape) * rng.uniform(0.3, 3.0, size=primals[0].shape[:3] + (1,))
    x = jnp.asarray(x, dtype)
    r = l2norm_factor(x)
    k = l2norm(x)
    normalized = (k,) + primals[1:]
    shares = tuple(jnp.asarray(rng.normal(size=k.shape), t) for t in (jnp.float32, dtype))
    t = _forward(normalized, sub_chunk, out_dtype=k.dtype, return_inverse=True)[2]
    cot = (_pull_back(t, dw, sub_chunk), _pull_back(t, du, sub_chunk)) if rhs else (dw, du)
    call = lambda **extra: jax.jit(functools.partial(
        wy_bwd_pallas, sub_chunk=sub_chunk, interpret=True, rhs_cotangents=rhs,
        dk_accumulate=shares, **kw, **extra))(*normalized, t, *cot)
    got, plain = call(key_factor=r), call()
    with jax.enable_x64(True):
        wide = lambda a: jnp.asarray(to64(a))
        norm64 = lambda a: a / jnp.sqrt(jnp.sum(a * a, axis=-1, keepdims=True) + 1e-6)
        runs64 = jnp.zeros(x.shape[:2], jnp.int32) if runs is None else runs

        def fn(x):
            y = norm64(x)
            w, u, _ = wy_dense(y, wide(v), wide(beta), None if gamma is None else wide(gamma),
                               runs64, sub_chunk=sub_chunk)
            return w, u, y
        share_sum = wide(shares[0]) + wide(shares[1])
        want = np.asarray(jax.vjp(fn, wide(x))[1]((wide(dw), wide(du), share_sum))[0])
    assert rel_err(got[0], plain[0]) > 0.1                  # the projection is really applied
    # 16-bit inputs: the kernel's k is l2norm(x) rounded once, the reference's exact.
    assert_close(got[0], want, tolerance(dtype), "dk (raw keys)")
    close = 1e-5 if dtype == "float32" else 1e-2
    for i, name_ in enumerate(NAMES[1:], 1):
        if plain[i] is not None:
            assert_close(got[i], plain[i], close, name_)
    chex.assert_type(got, [x.dtype if "out_dtype" in kw else jnp.float32] * 2
                     + [jnp.float32] * (2 if gated else 1) + ([] if gated else [None]))


def test_wy_bwd_key_factor_shape():
    primals, cotangents = make_inputs(sub_chunk=16, num_sub_chunks=2, key_dim=32, value_dim=64,
                                      gated=False, segments=False)
    with pytest.raises(ValueError, match=r"key_factor must be \[B, P, H\] = \(2, 32, 2\); got \(2, 32\)"):
        _bwd_pallas(primals, cotangents, 16, key_factor=jnp.ones((2, 32)))


@pytest.mark.parametrize("per_program,dtype", [(2, "bfloat16"), (3, "float32")])
def test_wy_pallas_sub_chunks_per_program(per_program, dtype):
    """A loop over several sub-chunks per program computes exactly what one program per sub-chunk
    does (w, u, T and the l2norm factors), and must divide the sub-chunks."""
    primals, _ = make_inputs(sub_chunk=16, num_sub_chunks=6, key_dim=32, value_dim=64, gated=True,
                             segments=True, dtype=dtype)
    call = lambda **kw: jax.jit(functools.partial(
        wy_pallas, sub_chunk=16, out_dtype=jnp.float32, interpret=True, return_inverse=True,
        normalize_keys=True, **kw))(*primals)
    want = call(block_sizes=WyBlockSizes(sub_chunks_per_program=1))
    got = call(block_sizes=WyBlockSizes(sub_chunks_per_program=per_program))
    for x, y in zip(got, want):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="sub_chunks_per_program must divide the 6"):
        call(block_sizes=WyBlockSizes(sub_chunks_per_program=4))


def test_wy_default_sub_chunks_per_program():
    """The launch rule: writing w and u, up to K, V = 128 a program loops over 4 sub-chunks, else
    2, where they divide the row's sub-chunks, and K or V = 256 keeps one program per sub-chunk;
    writing T alone, the other way round: one up to K = 128, 2 at K = 256 where they divide."""
    rule = default_sub_chunks_per_program
    assert [rule(jnp.bfloat16, 128, 128, n) for n in (8, 6, 3)] == [4, 2, 1]
    assert rule(jnp.float16, 64, 32, 12) == 4
    assert rule(jnp.float32, 128, 128, 8) == 4
    assert rule(jnp.bfloat16, 256, 128, 8) == 1
    assert [rule(jnp.bfloat16, 128, 128, n, w_and_u=False) for n in (8, 6, 3)] == [1, 1, 1]
    assert [rule(jnp.bfloat16, 256, 256, n, w_and_u=False) for n in (8, 6, 3)] == [2, 2, 1]


def test_wy_bwd_16_bit_inverse():
    """The forward can keep T in bfloat16 (``inverse_dtype``): with bfloat16 operands the VJP
    rounds T to that before every dot anyway, so its results are the same bits as from the
    float32 T; and T itself is the float32 one rounded once."""
    sub_chunk = 32
    primals, cotangents = make_inputs(sub_chunk=sub_chunk, num_sub_chunks=3, key_dim=32,
                                      value_dim=64, gated=True, segments=True, dtype="bfloat16")
    forward = lambda dtype: jax.jit(functools.partial(
        wy_pallas, sub_chunk=sub_chunk, out_dtype=jnp.bfloat16, interpret=True, return_inverse=True,
        inverse_dtype=dtype))(*primals)[2]
    t32, t16 = forward(jnp.float32), forward(jnp.bfloat16)
    chex.assert_type([t32, t16], [jnp.float32, jnp.bfloat16])
    np.testing.assert_array_equal(np.asarray(t16), np.asarray(t32.astype(jnp.bfloat16)))
    vjp = lambda t: jax.jit(functools.partial(wy_bwd_pallas, sub_chunk=sub_chunk, interpret=True,
                                              operand_dtype=jnp.bfloat16))(*primals, t, *cotangents)
    chex.assert_trees_all_equal(vjp(t16), vjp(t32))


@pytest.mark.parametrize("dtype,normalize_keys", [("bfloat16", False), ("float16", True),
                                                  ("float32", False)])
def test_wy_pallas_inverse_alone(dtype, normalize_keys):
    """``w_and_u=False``: the kernel reads no v and returns T (and the keys' factors where asked)
    equal to what it returns beside w and u; without return_inverse it has nothing to return."""
    primals, _ = make_inputs(sub_chunk=32, num_sub_chunks=4, key_dim=64, value_dim=32, gated=True,
                             segments=True, dtype=dtype)
    k, v, beta, gamma, runs = primals
    call = lambda v, **kw: jax.jit(functools.partial(
        wy_pallas, sub_chunk=32, out_dtype=jnp.float32, interpret=True, return_inverse=True,
        inverse_dtype=jnp.float32, normalize_keys=normalize_keys, **kw))(k, v, beta, gamma, runs)
    full = call(v)
    alone = call(None, w_and_u=False)
    assert len(alone) == 1 + normalize_keys and len(full) == 3 + normalize_keys
    for x, y in zip(alone, full[2:]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="w_and_u=False needs return_inverse=True"):
        wy_pallas(k, None, beta, gamma, runs, sub_chunk=32, out_dtype=jnp.float32, interpret=True,
                  w_and_u=False)


@pytest.mark.parametrize("sub_chunk,gated,segments", [(16, True, True), (64, False, True),
                                                      (32, True, False)])
def test_wy_bwd_rhs_cotangents(sub_chunk, gated, segments):
    """``rhs_cotangents``: given dRw = T^T dw and dRu = T^T du (per sub-chunk, T the forward's
    inverse) in place of dw and du, the VJP is the float64 reference's at dw, du."""
    primals, (dw, du) = make_inputs(sub_chunk=sub_chunk, num_sub_chunks=3 if sub_chunk < 64 else 2,
                                    key_dim=32, value_dim=64, gated=gated, segments=segments)
    t = _forward(primals, sub_chunk, out_dtype=jnp.float32, return_inverse=True)[2]
    batch, positions, heads, _ = t.shape
    blocks = t.reshape(batch, positions // sub_chunk, sub_chunk, heads, sub_chunk)

    def pull_back(x):        # T^T x per sub-chunk, in float64
        x = np.asarray(x, np.float64).reshape(batch, positions // sub_chunk, sub_chunk, heads, -1)
        y = np.einsum("bsjhi,bsjhd->bsihd", np.asarray(blocks, np.float64), x)
        return jnp.asarray(y.reshape(batch, positions, heads, -1), jnp.float32)

    got = jax.jit(functools.partial(wy_bwd_pallas, sub_chunk=sub_chunk, interpret=True,
                                    rhs_cotangents=True))(*primals, t, pull_back(dw), pull_back(du))
    want = reference_vjp(primals, (dw, du), sub_chunk)
    assert_all_close(dict(zip(NAMES, got)), want, tolerance("float32"))
    plain = _bwd_pallas(primals, (dw, du), sub_chunk)
    assert rel_err(got[0], plain[0]) < 1e-4          # the same VJP by the other route
