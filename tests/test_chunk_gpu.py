"""chunk_gated_delta_product and the chunk_h kernel compiled for the GPU, against the float64 recurrence.

Skipped without a GPU. The chunk_h kernel has so far only run in Pallas' interpreter; once these
pass on the H200, set gdp_jax.chunk_h_pallas.USE_ON_GPU = True so implementation="pallas" uses it.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax.chunk_h_pallas import chunk_h_pallas
from gdp_jax.cumsum import chunk_local_log2_cumsum
from gdp_jax.segments import segment_runs
from gdp_jax.wy import wy_xla
from helpers import rel_err
from test_chunk import make_full_problem

pytestmark = pytest.mark.gpu
TOL = {np.float32: 2e-3, jnp.bfloat16: 2e-2}   # SPEC: tf32 dots / half inputs


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
