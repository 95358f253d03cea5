"""use_qk_l2norm's normalisation on its own: its custom_vjp (the backward kernel in the interpreter)
against float64 evaluation and autodiff of fla's formula, and the dispatch rule. The full op
through it: test_full_op.py ("g-seg-init-l2norm"), compiled: test_gpu.py."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax._src import dispatch
from gdp_jax.ops.l2norm import l2norm, l2norm_and_factor
from cases import assert_close, seed_of, to64, tolerance


def _l2norm64(x):
    x = jnp.asarray(x, jnp.float64)
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


# Row counts that are not multiples of the kernel's 64-row blocks (and one below a block), rows of
# very different norms (one near 0, where eps matters), widths 16..256.
CASES = [((3, 37, 5, 128), "float32"), ((2, 50, 3, 64), "bfloat16"), ((130, 16), "float16"),
         ((7, 256), "float32"), ((1, 3, 2, 32), "bfloat16")]


@pytest.mark.parametrize("shape,dtype", CASES, ids=[f"{'x'.join(map(str, s))}-{d}" for s, d in CASES])
def test_against_float64(shape, dtype):
    rng = np.random.default_rng(seed_of(shape, dtype))
    scales = np.exp(rng.uniform(-3, 3, shape[:-1] + (1,)))
    scales.reshape(-1)[0] = 1e-4
    x = jnp.asarray(rng.standard_normal(shape) * scales, dtype)
    dy = jnp.asarray(rng.standard_normal(shape), dtype)
    assert dispatch.l2norm_implementation("interpret", x.dtype, shape[-1], x.size) == "interpret"

    y, vjp = jax.vjp(lambda x: l2norm(x, "interpret"), x)
    (dx,) = vjp(dy)
    with jax.enable_x64(True):
        y64, vjp64 = jax.vjp(_l2norm64, jnp.asarray(to64(x)))
        (dx64,) = vjp64(jnp.asarray(to64(dy)))
        y64, dx64 = np.asarray(y64), np.asarray(dx64)
    assert dx64.dtype == np.float64
    chex.assert_type([y, dx], [x.dtype, x.dtype])
    chex.assert_shape([y, dx], shape)
    assert_close(y, y64, tolerance(dtype), "y")
    assert_close(dx, dx64, tolerance(dtype), "dx")
    # Row by row too: a wrong row (e.g. the masked last block) cannot hide in the Frobenius sum.
    rows = lambda a: np.asarray(a, np.float64).reshape(-1, shape[-1])
    err = np.linalg.norm(rows(dx) - rows(dx64), axis=1) / np.linalg.norm(rows(dx64), axis=1)
    assert err.max() < 4 * tolerance(dtype), (err.argmax(), err.max())


@pytest.mark.parametrize("shape,dtype", CASES, ids=[f"{'x'.join(map(str, s))}-{d}" for s, d in CASES])
def test_rows_and_factors_against_float64(shape, dtype):
    """l2norm_and_factor's kernel (one pass writing y and r) against float64, and against the jnp
    formula it replaces, to within one rounding of y."""
    rng = np.random.default_rng(seed_of("factor", shape, dtype))
    scales = np.exp(rng.uniform(-3, 3, shape[:-1] + (1,)))
    scales.reshape(-1)[0] = 1e-4
    x = jnp.asarray(rng.standard_normal(shape) * scales, dtype)
    y, r = jax.jit(lambda x: l2norm_and_factor(x, "interpret"))(x)
    chex.assert_type([y, r], [x.dtype, jnp.float32])
    chex.assert_shape([y, r], [shape, shape[:-1]])
    x64 = to64(x)
    r64 = 1.0 / np.sqrt(np.sum(x64 * x64, axis=-1) + 1e-6)
    assert_close(r, r64, tolerance("float32"), "r")
    assert_close(y, x64 * r64[..., None], tolerance(dtype), "y")
    y_xla, r_xla = l2norm_and_factor(x, "xla")
    np.testing.assert_allclose(np.asarray(r), np.asarray(r_xla), rtol=1e-6)
    assert_close(y, np.asarray(y_xla, np.float64), tolerance(dtype), "y against the jnp formula")


def test_jit_vmap_grad():
    """vmap (an extra grid axis of the backward kernel, through the custom_vjp) under jit, against
    the jnp formula's autodiff."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((3, 20, 2, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 20, 2, 32)), jnp.float32)

    def run(impl):
        f = lambda x: jax.vmap(lambda r: l2norm(r, impl))(x)
        y, vjp = jax.vjp(f, x)
        return y, vjp(w)[0]
    got, want = jax.jit(run, static_argnums=0)("interpret"), run("xla")
    assert_close(got[0], want[0], 1e-6, "y")
    assert_close(got[1], want[1], 1e-5, "dx")


@pytest.mark.parametrize("implementation,dtype,width,size,runs", [
    ("pallas", jnp.bfloat16, 128, 1 << 20, "pallas"),
    ("mosaic", jnp.bfloat16, 128, 1 << 20, "pallas"),          # no Mosaic kernel: the Triton one
    ("mosaic_interpret", jnp.float32, 64, 1 << 10, "interpret"),
    ("xla", jnp.float32, 128, 1 << 10, "xla"),
    ("pallas", jnp.float64, 128, 1 << 10, "xla"),             # no 8-byte tiles
    ("pallas", jnp.float32, 48, 1 << 10, "xla"),              # not one power-of-two tile
    ("pallas", jnp.float32, 512, 1 << 10, "xla"),             # wider than the kernels take
    ("pallas", jnp.bfloat16, 128, 1 << 31, "xla"),            # past 32-bit offsets
])
def test_dispatch_rule(implementation, dtype, width, size, runs):
    if not dispatch.has_triton_lowering() and runs in ("pallas", "interpret"):
        runs = "xla"
    assert dispatch.l2norm_implementation(implementation, dtype, width, size) == runs
