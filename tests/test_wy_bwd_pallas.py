"""The WY stage's VJP kernel (wy_bwd_pallas) against float64 autodiff of the WY forward.

CPU: the kernel in Pallas' interpreter on small shapes (B = 2, H = 2, 2-3 sub-chunks), against
jax.vjp of ``_wy_dense`` evaluated in float64. ``_wy_dense`` states the forward the kernel
differentiates (one dense S x S system per sub-chunk; its inverse is wy.unit_lower_inverse, as
LAPACK solves can deadlock jaxlib 0.10's CPU thread pool). wy.wy_xla computes in float32 only (it
casts its inputs), so ``test_reference_is_wy_xla`` checks that ``_wy_dense`` is
wy_xla(chunk_size=S, num_householder=1), values and VJP. GPU (marked, skipped elsewhere): the
compiled kernel at a realistic shape against jax.vjp of wy_xla in float32.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax.segments import segment_runs
from gdp_jax.wy import unit_lower_inverse, wy_xla
from gdp_jax.wy_bwd_pallas import wy_bwd_pallas
from gdp_jax.wy_pallas import expanded_log2_decays, wy_pallas
from helpers import rel_err

M = 2                                          # Householder steps per token (positions = tokens * M)
# Relative Frobenius error against float64. 16-bit inputs are held to the float32 bound too: the
# reference sees the rounded inputs, the forward's inverse is built from exact 16-bit gram
# products, and the backward kernel casts every operand to float32 (IEEE dots by default).
TOL = {np.float32: 1e-5, jnp.bfloat16: 1e-5}
NAMES = ("dk", "dv", "dbeta", "dgamma")


def _segment_ids(batch, positions, sub_chunk):
    """[B, P] ids: several segments inside sub-chunks, one starting exactly at a sub-chunk start
    (position S), one of length 1; row 1 is packed differently and repeats an id non-adjacently."""
    s = sub_chunk
    starts = [{0, 3, s // 2, s // 2 + 1, s, s + s // 4 + 1}, {0, s - 5, s + s // 2, 2 * s - 1}]
    rows = []
    for b in range(batch):
        boundaries = np.zeros(positions, np.int32)
        boundaries[sorted(x for x in starts[b % 2] if x < positions)] = 1
        ids = np.cumsum(boundaries) - 1
        rows.append(np.where(ids % 3 == 2, 0, ids) if b % 2 else ids)
    return np.stack(rows).astype(np.int32)


def _inputs(seed, *, sub_chunk, num_sub_chunks, key_dim, value_dim, gated, segments,
            dtype=np.float32, batch=2, heads=2):
    """Primals (k, v, beta, gamma, runs) and cotangents (dw, du), all rounded to ``dtype`` (gamma
    and runs excepted): what the kernel reads is exactly what the reference sees."""
    rng = np.random.default_rng(seed)
    positions = sub_chunk * num_sub_chunks
    k = rng.normal(size=(batch, positions, heads, key_dim))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(batch, positions, heads, value_dim))
    beta = rng.uniform(0.0, 2.0, size=(batch, positions, heads))
    gamma = None
    if gated:   # natural-log gates per token -> sub-chunk-local cumulative log2 decays per position
        g_raw = -rng.uniform(0.01, 0.5, size=(batch, positions // M, heads))
        gamma = expanded_log2_decays(jnp.asarray(g_raw, jnp.float32), M, positions, sub_chunk)
    runs = segment_runs(jnp.asarray(_segment_ids(batch, positions, sub_chunk))) if segments else None
    dw = rng.normal(size=(batch, positions, heads, key_dim))
    du = rng.normal(size=(batch, positions, heads, value_dim))
    cast = lambda x: jnp.asarray(x, dtype)
    return (cast(k), cast(v), cast(beta), gamma, runs), (cast(dw), cast(du))


def _wy_dense(k, v, beta, gamma, runs, *, sub_chunk):
    """(w, u) in the inputs' dtype: per sub-chunk, A[j, i] = beta_j 2^(gamma_j - gamma_i) k_j·k_i
    for i < j in one run, T = (I + A)^{-1}, w = T (beta live 2^gamma k), u = T (beta v)."""
    batch, positions, heads, _ = k.shape
    n, s = positions // sub_chunk, sub_chunk
    per_sub_chunk = lambda x: jnp.moveaxis(x.reshape((batch, n, s) + x.shape[2:]), 2, -1)
    kc = jnp.moveaxis(per_sub_chunk(k), -1, -2)                           # [B, n, H, S, K]
    vc = jnp.moveaxis(per_sub_chunk(v), -1, -2)                           # [B, n, H, S, V]
    bc = per_sub_chunk(beta)                                              # [B, n, H, S]
    gc = jnp.zeros_like(bc) if gamma is None else per_sub_chunk(gamma.astype(bc.dtype))
    rc = (jnp.zeros((batch, n, 1, s), jnp.int32) if runs is None
          else runs.reshape(batch, n, 1, s))
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
    return unchunk(w), unchunk(u)


def _vjp(fn, primals, cotangents):
    """jax.vjp of fn(k, v, beta, gamma) -> (w, u), runs fixed; (dk, dv, dbeta, dgamma or None)."""
    k, v, beta, gamma = primals
    call = lambda k, v, beta, *gamma_: fn(k, v, beta, gamma_[0] if gamma_ else None)
    _, vjp = jax.vjp(call, k, v, beta, *(() if gamma is None else (gamma,)))
    grads = vjp(cotangents)
    return tuple(grads) + ((None,) if gamma is None else ())


def _reference_f64(primals, cotangents, sub_chunk):
    """Float64 autodiff of _wy_dense on the (already rounded) inputs, as numpy arrays."""
    k, v, beta, gamma, runs = primals

    @jax.jit
    def grads(k, v, beta, gamma, runs, cotangents):
        return _vjp(functools.partial(_wy_dense, runs=runs, sub_chunk=sub_chunk), (k, v, beta, gamma),
                    cotangents)

    with jax.enable_x64(True):
        wide = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float64))
        out = grads(*[wide(x) for x in (k, v, beta, gamma)], runs, tuple(wide(x) for x in cotangents))
        return [None if x is None else np.asarray(x) for x in out]


def _forward_inverse(primals, sub_chunk, interpret=True):
    """T = (I + A)^{-1} [B, P, H, S] as the op's forward keeps it (wy_pallas, return_inverse)."""
    k = primals[0]
    return wy_pallas(*primals, sub_chunk=sub_chunk, out_dtype=k.dtype, interpret=interpret,
                     return_inverse=True)[2]


def _dense_inverse_f64(primals, sub_chunk):
    """(I + A)^{-1} per sub-chunk in float64, laid out as wy_pallas returns it: [B, P, H, S]."""
    k, v, beta, gamma, runs = primals
    batch, positions, heads, _ = k.shape
    n, s = positions // sub_chunk, sub_chunk
    with jax.enable_x64(True):
        wide = lambda x: jnp.asarray(np.asarray(x, np.float64))
        kc = wide(k).reshape(batch, n, s, heads, -1).transpose(0, 1, 3, 2, 4)    # [B, n, H, S, K]
        bc = wide(beta).reshape(batch, n, s, heads).transpose(0, 1, 3, 2)
        gc = jnp.zeros_like(bc) if gamma is None else wide(gamma).reshape(batch, n, s, heads
                                                                          ).transpose(0, 1, 3, 2)
        rc = jnp.zeros((batch, n, 1, s), jnp.int32) if runs is None else runs.reshape(batch, n, 1, s)
        mask = (rc[..., :, None] == rc[..., None, :]) & jnp.tril(jnp.ones((s, s), bool), -1)
        a = jnp.where(mask, bc[..., :, None] * jnp.exp2(gc[..., :, None] - gc[..., None, :])
                      * jnp.einsum("...jd,...id->...ji", kc, kc), 0.0)
        t_inv = np.linalg.inv(np.eye(s) + np.asarray(a))                        # [B, n, H, S, S]
    return t_inv.transpose(0, 1, 3, 2, 4).reshape(batch, positions, heads, s)


def _check(primals, cotangents, sub_chunk, tol, **kernel_kw):
    inverse = _forward_inverse(primals, sub_chunk)
    grads = wy_bwd_pallas(*primals, inverse, *cotangents, sub_chunk=sub_chunk, interpret=True,
                          **kernel_kw)
    expected = _reference_f64(primals, cotangents, sub_chunk)
    for name, got, want, primal in zip(NAMES, grads, expected, primals):
        if want is None:
            assert got is None, name
            continue
        assert got.dtype == jnp.float32 and got.shape == primal.shape, name
        assert np.linalg.norm(want) > 0, name          # so a wrong or missing term cannot hide
        assert rel_err(got, want) < tol, (name, rel_err(got, want))


@pytest.mark.parametrize("sub_chunk,gated,segments", [(16, True, True), (32, False, False),
                                                      (64, True, False), (64, False, True)])
def test_against_float64_autodiff(sub_chunk, gated, segments):
    primals, cotangents = _inputs(sub_chunk + 2 * gated + segments, sub_chunk=sub_chunk,
                                  num_sub_chunks=3 if sub_chunk < 64 else 2, key_dim=32,
                                  value_dim=64, gated=gated, segments=segments)
    _check(primals, cotangents, sub_chunk, TOL[np.float32])


@pytest.mark.parametrize("sub_chunk,gated,segments", [(64, True, True)])
def test_bfloat16_inputs(sub_chunk, gated, segments):
    """16-bit k, v, beta and cotangents (the forward's gram blocks are then 16-bit dots); float32
    results."""
    primals, cotangents = _inputs(7 + sub_chunk, sub_chunk=sub_chunk, num_sub_chunks=2, key_dim=32,
                                  value_dim=64, gated=gated, segments=segments, dtype=jnp.bfloat16)
    _check(primals, cotangents, sub_chunk, TOL[jnp.bfloat16])


@pytest.mark.parametrize("sub_chunk,block_cols", [(64, 16), (32, 32)])
def test_column_blocks(sub_chunk, block_cols):
    """Column blocks narrower than K and V (the loops take several steps; default 64 takes one
    here)."""
    primals, cotangents = _inputs(3 + sub_chunk, sub_chunk=sub_chunk, num_sub_chunks=2, key_dim=64,
                                  value_dim=32, gated=True, segments=True)
    _check(primals, cotangents, sub_chunk, TOL[np.float32], block_cols=block_cols)


def test_16_bit_operands():
    """operand_dtype=bfloat16 rounds every dot's operands (T, M, F and the scaled tiles once more
    than the inputs), so it is held to the half-input tolerance against float64, not float32's."""
    sub_chunk = 64
    primals, cotangents = _inputs(43, sub_chunk=sub_chunk, num_sub_chunks=2, key_dim=32,
                                  value_dim=64, gated=True, segments=True, dtype=jnp.bfloat16)
    inverse = _forward_inverse(primals, sub_chunk)
    got = wy_bwd_pallas(*primals, inverse, *cotangents, sub_chunk=sub_chunk, interpret=True,
                        operand_dtype=jnp.bfloat16)
    for name, x, want in zip(NAMES, got, _reference_f64(primals, cotangents, sub_chunk)):
        assert x.dtype == jnp.float32, name
        assert rel_err(x, want) < 2e-2, (name, rel_err(x, want))


def test_dk_accumulate_and_16_bit_outputs():
    """dk_accumulate is added to dk in float32 and dk, dv come rounded to out_dtype (the op passes
    the state walk's dk and the inputs' dtype); dbeta, dgamma stay float32 and unchanged."""
    sub_chunk = 64
    primals, cotangents = _inputs(41, sub_chunk=sub_chunk, num_sub_chunks=2, key_dim=32,
                                  value_dim=64, gated=True, segments=True, dtype=jnp.bfloat16)
    inverse = _forward_inverse(primals, sub_chunk)
    extra = jax.random.normal(jax.random.PRNGKey(3), primals[0].shape, jnp.float32)
    got = wy_bwd_pallas(*primals, inverse, *cotangents, sub_chunk=sub_chunk, interpret=True,
                        dk_accumulate=extra, out_dtype=jnp.bfloat16)
    dk, dv, dbeta, dgamma = _reference_f64(primals, cotangents, sub_chunk)
    assert got[0].dtype == got[1].dtype == jnp.bfloat16
    assert got[2].dtype == got[3].dtype == jnp.float32
    bf16_rounding = 2.0 ** -8                                # relative, round to nearest
    assert rel_err(got[0], dk + np.asarray(extra)) < bf16_rounding
    assert rel_err(got[0], dk) > 0.1                         # the extra term is really there
    assert rel_err(got[1], dv) < bf16_rounding
    assert rel_err(got[2], dbeta) < TOL[jnp.bfloat16] and rel_err(got[3], dgamma) < TOL[jnp.bfloat16]
    # Several shares (the op passes the state walk's and the output stage's), any dtypes.
    halves = (0.5 * extra, (0.5 * extra).astype(jnp.bfloat16))
    got_two = wy_bwd_pallas(*primals, inverse, *cotangents, sub_chunk=sub_chunk, interpret=True,
                            dk_accumulate=halves, out_dtype=jnp.bfloat16)
    assert rel_err(got_two[0], dk + np.asarray(extra)) < bf16_rounding
    with pytest.raises(ValueError, match="dk_accumulate"):
        wy_bwd_pallas(*primals, inverse, *cotangents, sub_chunk=sub_chunk, interpret=True,
                      dk_accumulate=extra[:, :64])
    with pytest.raises(ValueError, match="dk_accumulate"):
        wy_bwd_pallas(*primals, inverse, *cotangents, sub_chunk=sub_chunk, interpret=True,
                      dk_accumulate=(extra, extra[:, :64]))


@pytest.mark.parametrize("sub_chunk,gated,segments", [(16, False, True), (64, True, True)])
def test_forward_keeps_the_inverse(sub_chunk, gated, segments):
    """wy_pallas(return_inverse=True)'s T is (I + A)^{-1} (float64 inverse of the same A), and its
    w, u are those of the call without it."""
    primals, _ = _inputs(19 + sub_chunk, sub_chunk=sub_chunk, num_sub_chunks=2, key_dim=32,
                         value_dim=64, gated=gated, segments=segments)
    got = _forward_inverse(primals, sub_chunk)
    want = _dense_inverse_f64(primals, sub_chunk)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    assert np.abs(want - np.eye(sub_chunk)[np.arange(want.shape[1]) % sub_chunk][None, :, None]
                  ).max() > 0.1                          # A is far from 0: the test can fail
    assert rel_err(got, want) < 1e-5
    w, u, _ = wy_pallas(*primals, sub_chunk=sub_chunk, out_dtype=jnp.float32, interpret=True,
                        return_inverse=True)
    w0, u0 = wy_pallas(*primals, sub_chunk=sub_chunk, out_dtype=jnp.float32, interpret=True)
    np.testing.assert_array_equal(np.asarray(w), np.asarray(w0))
    np.testing.assert_array_equal(np.asarray(u), np.asarray(u0))


@pytest.mark.parametrize("gated,segments", [(True, True)])
def test_reference_is_wy_xla(gated, segments):
    """_wy_dense is wy_xla on the sub-chunk grid (values and VJP, float32): the kernel's target."""
    sub_chunk = 32
    primals, cotangents = _inputs(11, sub_chunk=sub_chunk, num_sub_chunks=3, key_dim=32,
                                  value_dim=64, gated=gated, segments=segments)
    k, v, beta, gamma, runs = primals
    xla = lambda k, v, beta, g: wy_xla(k, v, beta, g, runs, chunk_size=sub_chunk, num_householder=1)
    dense = functools.partial(_wy_dense, runs=runs, sub_chunk=sub_chunk)
    for got, want in zip(jax.jit(dense)(k, v, beta, gamma), jax.jit(xla)(k, v, beta, gamma)):
        assert rel_err(got, want) < 1e-6
    expected = _reference_f64(primals, cotangents, sub_chunk)
    xla_grads = jax.jit(lambda *primals: _vjp(xla, primals, cotangents))(k, v, beta, gamma)
    for got, want in zip(xla_grads, expected):
        assert (got is None) == (want is None)
        if want is not None:
            assert rel_err(got, want) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["highest", "tf32"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("gated,segments", [(True, True), (False, False)])
def test_compiled_on_gpu(dtype, gated, segments, precision):
    """The compiled Triton kernel at B=2 P=8192 H=4 K=V=128 S=64, with the compiled forward's
    inverse, against jax.vjp of wy_xla in float32. "tf32" (precision None: TF32 tensor-core dots,
    what the op uses for 16-bit inputs; the CPU interpreter computes it in float32) rounds every
    dot operand to 10 mantissa bits (unit roundoff 4.9e-4) through three chained products, hence
    5e-3; "highest" is IEEE float32."""
    sub_chunk = 64
    primals, cotangents = _inputs(5, sub_chunk=sub_chunk, num_sub_chunks=8192 // sub_chunk,
                                  key_dim=128, value_dim=128, gated=gated, segments=segments,
                                  heads=4, dtype=dtype)
    k, v, beta, gamma, runs = primals
    dot_precision = {"highest": jax.lax.Precision.HIGHEST, "tf32": None}[precision]
    tol = {"highest": 1e-4, "tf32": 5e-3}[precision]

    @jax.jit
    def kernel(primals, cotangents):
        inverse = _forward_inverse(primals, sub_chunk, interpret=False)
        return wy_bwd_pallas(*primals, inverse, *cotangents, sub_chunk=sub_chunk,
                             precision=dot_precision)

    grads = kernel(primals, cotangents)

    @jax.jit
    def reference(k, v, beta, gamma, dw, du):
        f32 = lambda x: None if x is None else x.astype(jnp.float32)
        xla = lambda k, v, beta, g: wy_xla(k, v, beta, g, runs, chunk_size=sub_chunk,
                                           num_householder=1)
        with jax.default_matmul_precision("highest"):
            return _vjp(xla, [f32(x) for x in (k, v, beta, gamma)], (f32(dw), f32(du)))

    expected = reference(k, v, beta, gamma, *cotangents)
    for name, got, want in zip(NAMES, grads, expected):
        assert (got is None) == (want is None), name
        if want is not None:
            err = rel_err(got, np.asarray(want, np.float64))
            assert err < tol, (name, err)
