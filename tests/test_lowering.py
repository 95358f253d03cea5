"""The compiled kernels' lowering for CUDA, on this CPU host.

``jit(...).trace(...).lower(lowering_platforms=("cuda",))`` builds every kernel's GPU program
short of the GPU compiler, through the branches only compiled kernels take (the interpreter tests
never trace them: the Mosaic GPU layouts and the float32 WY backward in jnp, for two). The Triton
kernels are lowered to Triton IR, so a primitive or block shape its lowering refuses fails here. The Mosaic GPU kernels run Mosaic GPU's layout inference and SMEM-budget
check (also test_chunk_o_mosaic.py). Not checked here: Triton's and ptxas's compilation, the
Triton kernels' shared memory, the results (the GPU tests).
"""
import jax
import jax.numpy as jnp
import pytest

import gdp_jax
from gdp_jax._src import dispatch

# (T, K, V, M, dtype, gated, segments, use_qk_l2norm): each dtype's dot rule (bf16 operands, TF32
# for f16 where the rule says so, IEEE f32 and the WY backward in jnp for f32), ragged T, K != V,
# M 1..3, K = V = 256.
CASES = [
    (200, 128, 128, 2, "bfloat16", True, True, False),
    (200, 64, 96, 3, "float32", True, True, False),
    (200, 256, 256, 1, "float16", False, True, False),
    (130, 128, 128, 2, "bfloat16", True, False, True),
]


def _spec(*shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


# The target card, for lowerings that ask for one (jax 0.11's Triton lowering reads the compute
# capability from the device; on a CPU host only an abstract device gives it).
H200 = jax.sharding.AbstractMesh(
    (1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
    abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="cuda"))


def _lowered_text(fn, args):
    with jax.sharding.use_abstract_mesh(H200):
        return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("implementation", ["pallas", "mosaic"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_full_op_forward_and_backward_lower_for_cuda(case, implementation):
    tokens, key_dim, value_dim, m, dtype, gated, segments, l2norm = case
    batch, heads = 1, 2
    args = [_spec(batch, tokens, heads, key_dim, dtype=dtype),
            _spec(batch, tokens * m, heads, key_dim, dtype=dtype),
            _spec(batch, tokens * m, heads, value_dim, dtype=dtype),
            _spec(batch, tokens, heads, dtype="float32") if gated else None,
            _spec(batch, tokens * m, heads, dtype=dtype),
            _spec(batch, tokens, dtype="int32") if segments else None]

    def loss(q, k, v, g, beta, ids):
        o, _ = gdp_jax.chunk_gated_delta_product(q, k, v, g, beta, segment_ids=ids,
                                                 use_qk_l2norm=l2norm,
                                                 implementation=implementation)
        return jnp.sum(o.astype(jnp.float32))

    argnums = (0, 1, 2, 3, 4) if gated else (0, 1, 2, 4)
    text = _lowered_text(jax.jit(jax.value_and_grad(loss, argnums=argnums)), args)
    assert "triton" in text                       # the WY and walk kernels: Triton either way
    uses_mosaic = jnp.dtype(dtype).itemsize == 2 and (
        implementation == "mosaic" or dispatch.chunk_o_backward_implementation(
            implementation, jnp.dtype(dtype), key_dim, value_dim, 64) == "mosaic")
    assert ("mosaic_gpu" in text) == uses_mosaic
