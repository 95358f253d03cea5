"""chunk_gated_delta_product and the chunk_h kernels compiled for the GPU, against the float64
recurrence (forward), jax.vjp of the jnp walk (the walk's backward kernels) and autodiff of the
jnp path (the full op's gradients). Skipped without a GPU.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax.chunk_h import chunk_h_xla
from gdp_jax.chunk_h_bwd_pallas import chunk_h_bwd_pallas
from gdp_jax.chunk_h_pallas import chunk_h_pallas
from gdp_jax.cumsum import chunk_local_log2_cumsum
from gdp_jax.segments import segment_runs
from gdp_jax.wy import wy_xla
from helpers import rel_err
from test_chunk import make_full_problem
from test_chunk_h_bwd import check, make_inputs, xla_vjp

pytestmark = pytest.mark.gpu
TOL = {np.float32: 2e-3, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}   # SPEC: tf32 dots / half inputs


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("gated,segments", [(True, True), (False, False)])
def test_full_op_against_recurrence(dtype, m, gated, segments):
    p = make_full_problem(10 * m + gated, batch=2, tokens=1000 - 37 * (m == 3), heads=4,
                          key_dim=128, value_dim=128, m=m, chunk_size=64, gated=gated,
                          segments=segments, dtype=dtype)
    o, final_state = gdp_jax.chunk_gated_delta_product(
        p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=p["initial_state"],
        segment_ids=p["segment_ids"], output_final_state=True, chunk_size=64,
        implementation="pallas")
    assert rel_err(o, p["ref"]["o"]) < TOL[dtype]
    assert rel_err(final_state, p["ref"]["final_state"]) < TOL[dtype]


@pytest.mark.parametrize("key_dim,value_dim,m", [(128, 128, 2), (64, 256, 3), (96, 48, 1)])
def test_chunk_h_kernel_compiled(key_dim, value_dim, m):
    p = make_full_problem(key_dim + value_dim, batch=2, tokens=333, heads=3, key_dim=key_dim,
                          value_dim=value_dim, m=m, chunk_size=64)
    runs = segment_runs(p["segment_ids"])
    g = chunk_local_log2_cumsum(p["g"], 64)
    w, u = wy_xla(p["k"], p["v"], p["beta"], g, runs, chunk_size=64, num_householder=m)
    h, v_new, final_state = jax.jit(
        lambda *a: chunk_h_pallas(*a, chunk_size=64, num_householder=m))(
            p["k"], w, u, g, runs, p["initial_state"])
    assert rel_err(h, p["ref"]["h"]) < TOL[np.float32]
    assert rel_err(v_new, p["ref"]["v_new"]) < TOL[np.float32]
    assert rel_err(final_state, p["ref"]["final_state"]) < TOL[np.float32]


# ----------------------------------------------------------------------------------------------
# Backward of stage 3: the compiled reverse-walk and epilogue kernels against jax.vjp of the
# jnp scan (full-precision einsums). k in the inputs' dtype; w, u (WY stage) are float32.

_BWD_SHAPE = dict(batch=2, tokens=1000, heads=4, key_dim=128, value_dim=128, m=2, chunk_size=64)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("gated,segments,init", [(True, True, True), (False, False, False)])
def test_chunk_h_bwd_kernel_compiled(dtype, gated, segments, init):
    # The kernel alone, from the jnp forward's residuals (independent of the forward kernel).
    primals, cotangents, kw = make_inputs(
        3 + gated, gated=gated, segments=segments, init=init, k_dtype=dtype, **_BWD_SHAPE)

    @jax.jit
    def kernel_vjp(primals, cotangents):
        k, w, u, g, runs, state0 = primals
        h, v_new, _ = chunk_h_xla(k, w, u, g, runs, state0, **kw)
        dk, dw, du, dg, dinit = chunk_h_bwd_pallas(
            k, w, g, runs, h, v_new, *cotangents, with_initial_state=state0 is not None, **kw)
        return dk.astype(k.dtype), dw, du, dg, dinit

    check(kernel_vjp(primals, cotangents), xla_vjp(primals, cotangents, **kw), primals,
          tol=TOL[dtype])


@pytest.mark.parametrize("key_dim,value_dim,m,chunk_size", [(64, 256, 3, 64), (96, 48, 1, 32),
                                                           (256, 128, 2, 64), (128, 128, 2, 128)])
def test_chunk_h_bwd_kernel_widths_and_chunks(key_dim, value_dim, m, chunk_size):
    # Other block choices of default_blocks: K = 256 (value blocks of 16), chunk 128 (8 warps),
    # padded K and V, M = 1 and 3.
    primals, cotangents, kw = make_inputs(
        key_dim + value_dim, batch=2, tokens=333, heads=3, key_dim=key_dim, value_dim=value_dim,
        m=m, chunk_size=chunk_size, gated=True, segments=True, init=True)

    @jax.jit
    def kernel_vjp(primals, cotangents):
        k, w, u, g, runs, state0 = primals
        h, v_new, _ = chunk_h_xla(k, w, u, g, runs, state0, **kw)
        return chunk_h_bwd_pallas(k, w, g, runs, h, v_new, *cotangents, with_initial_state=True,
                                  **kw)

    check(kernel_vjp(primals, cotangents), xla_vjp(primals, cotangents, **kw), primals,
          tol=TOL[np.float32])


# ----------------------------------------------------------------------------------------------
# The full op's gradients on the GPU path (sub-chunk kernels forward; reverse-walk kernel and WY
# VJP backward; chunk_o's Pallas backward) against the jnp path's autodiff in float32 on the same
# (rounded) inputs; the jnp path's gradients are checked against the float64 recurrence on CPU.

@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,gated,segments,init", [(2, True, True, True), (3, False, False, False),
                                                   (1, True, False, True)])
def test_full_op_gradients_compiled(dtype, m, gated, segments, init):
    p = make_full_problem(20 * m + gated, batch=2, tokens=700, heads=4, key_dim=128,
                          value_dim=64 if m == 3 else 128, m=m, chunk_size=64, gated=gated,
                          segments=segments, initial_state=init, dtype=dtype)
    rng = np.random.default_rng(m)
    do = jnp.asarray(rng.normal(size=p["ref"]["o"].shape), jnp.float32)
    dfinal = jnp.asarray(rng.normal(size=p["ref"]["final_state"].shape), jnp.float32)
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state") if p[n] is not None]

    def grads(implementation, cast):
        def loss(*args):
            a = dict(zip(names, args))
            o, final_state = gdp_jax.chunk_gated_delta_product(
                a["q"], a["k"], a["v"], a.get("g"), a["beta"], initial_state=a.get("initial_state"),
                segment_ids=p["segment_ids"], output_final_state=True, chunk_size=64,
                implementation=implementation)
            return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(final_state * dfinal)
        return jax.jit(jax.grad(loss, argnums=tuple(range(len(names)))))(
            *[cast(p[n]) for n in names])

    got = grads("pallas", lambda x: x)
    want = grads("xla", lambda x: jnp.asarray(x, jnp.float32))
    errors = {n: rel_err(a, b) for n, a, b in zip(names, got, want)}
    print(jnp.dtype(dtype).name, m, errors)
    for n, a in zip(names, got):
        assert a.dtype == p[n].dtype and a.shape == p[n].shape, n
    assert max(errors.values()) < TOL[dtype], errors


def test_full_op_float16():
    """float16 inputs on the GPU path (16-bit dots in the forward walk; the backward walk keeps
    float32 dots for float16, see chunk._bwd_dot_dtype): forward against the float64
    recurrence and gradients against the jnp path, at the half-input tolerance."""
    test_full_op_against_recurrence(jnp.float16, 2, True, True)
    test_full_op_gradients_compiled(jnp.float16, 2, True, True, True)


def test_forward_matches_fla_packed():
    """The forward against fla 0.6.0's chunk_gated_delta_product on the same bf16 inputs: our packed
    rows (segment ids) go to fla as one flattened row with cu_seqlens from the same packing. Both are
    checked against the float64 recurrence too, so a wrong conversion cannot pass as agreement.
    Skipped where torch or fla is not importable."""
    torch = pytest.importorskip("torch")
    fla_gdp = pytest.importorskip("fla.ops.gated_delta_product")
    m = 2
    p = make_full_problem(5, batch=2, tokens=777, heads=4, key_dim=128, value_dim=64, m=m,
                          chunk_size=64, gated=True, segments=True, initial_state=False,
                          dtype=jnp.bfloat16)
    beta = p["beta"].astype(jnp.bfloat16)        # as fla takes it; the recurrence keeps float32
    o, final_state = gdp_jax.chunk_gated_delta_product(
        p["q"], p["k"], p["v"], p["g"], beta, segment_ids=p["segment_ids"],
        output_final_state=True, chunk_size=64, implementation="pallas")

    ids = np.asarray(p["segment_ids"])
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
        to_torch(p["q"], torch.bfloat16), to_torch(p["k"], torch.bfloat16),
        to_torch(p["v"], torch.bfloat16), to_torch(p["g"], torch.float32),
        to_torch(beta, torch.bfloat16), num_householder=m, output_final_state=True,
        cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.long, device="cuda"))
    o_fla = o_fla.float().cpu().numpy().reshape(o.shape)
    state_fla = state_fla.float().cpu().numpy()[last_segment_of_row]

    errors = dict(o_vs_fla=rel_err(o, o_fla), state_vs_fla=rel_err(final_state, state_fla),
                  fla_o_vs_recurrence=rel_err(o_fla, p["ref"]["o"]),
                  o_vs_recurrence=rel_err(o, p["ref"]["o"]),
                  fla_state_vs_recurrence=rel_err(state_fla, p["ref"]["final_state"]))
    print(errors)
    assert max(errors.values()) < TOL[jnp.bfloat16], errors
