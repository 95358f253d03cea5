"""L2 normalisation of q and k over their last axis (``use_qk_l2norm``), with its VJP.

    y = x r,   r = (sum_d x_d^2 + eps)^(-1/2)            (float32, y rounded to x's dtype)
    dx = r (dy - y32 sum_d dy_d y32_d),   y32 = x r in float32

One ``jax.custom_vjp``: the forward is the jnp formula (``layout.l2norm``), which XLA fuses into
the passes that consume y; the backward is a Pallas kernel (Triton lowering), one pass over HBM
that reads x and dy and writes dx, recomputing r from x, so x is the only residual. Rows are
``[N, D]`` tiles of 64 rows; the last block's extra rows are masked. Measured against autodiff
of the formula, and a forward kernel against XLA's, in RESULTS.md ("use_qk_l2norm").

``l2norm_and_factor``: y and r for a backward kernel that applies the normalisation's VJP itself
(no custom_vjp here), in one pass over x: a Pallas kernel where the backward kernel would run
(XLA writes y and r in two passes, reading x twice: RESULTS.md, "use_qk_l2norm's VJP inside the
backward kernels").
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gdp_jax._src import dispatch
from gdp_jax._src.layout import L2NORM_EPS, l2norm as l2norm_xla
from gdp_jax._src.layout import l2norm_and_factor as l2norm_and_factor_xla
from gdp_jax._src.pallas import load_rows, plgpu, triton_call

__all__ = ["l2norm", "l2norm_and_factor"]

BLOCK_ROWS = 64
NUM_WARPS = 4


def l2norm(x: jax.Array, implementation: str = "xla") -> jax.Array:
    """x / sqrt(sum(x^2) + 1e-6) over the last axis, computed in float32, returned in x's dtype
    (fla's formula); differentiable.

    x: [..., D] float. ``implementation`` resolved as for the op: "pallas" and "interpret" run
    the backward kernel where ``dispatch.l2norm_implementation`` takes it, "xla" autodiff of
    the jnp formula.
    """
    impl = dispatch.l2norm_implementation(implementation, x.dtype, x.shape[-1], x.size)
    if impl == "xla":
        return l2norm_xla(x)
    return _l2norm(x, impl == "interpret")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _l2norm(x, interpret):
    return l2norm_xla(x)


def _l2norm_fwd(x, interpret):
    return l2norm_xla(x), x


def _l2norm_bwd(interpret, x, dy):
    return (_call(x, dy, interpret),)


_l2norm.defvjp(_l2norm_fwd, _l2norm_bwd)


def _kernel(x_ref, dy_ref, dx_ref, *, rows: int, eps: float):
    first = pl.program_id(0) * BLOCK_ROWS
    row_valid = first + jax.lax.broadcasted_iota(jnp.int32, (BLOCK_ROWS,), 0) < rows
    x = load_rows(x_ref, row_valid).astype(jnp.float32)                 # [BR, D]
    r = jax.lax.rsqrt(jnp.sum(x * x, axis=1) + eps)[:, None]             # [BR, 1]
    y = x * r
    dy = load_rows(dy_ref, row_valid).astype(jnp.float32)
    dx = r * (dy - y * jnp.sum(dy * y, axis=1)[:, None])
    plgpu.store(dx_ref, dx.astype(dx_ref.dtype), mask=row_valid[:, None])


def _call(x, dy, interpret: bool):
    """dx in x's dtype; x, dy [..., D] as ``dispatch.l2norm_implementation`` admits."""
    shape, width = x.shape, x.shape[-1]
    rows = x.size // width
    flat = lambda a: a.reshape(rows, width)
    spec = pl.BlockSpec((BLOCK_ROWS, width), lambda i: (i, 0))
    out = triton_call(
        functools.partial(_kernel, rows=rows, eps=L2NORM_EPS), flat(x), flat(dy),
        name="gdp_l2norm_bwd", grid=(pl.cdiv(rows, BLOCK_ROWS),),
        in_specs=(spec, spec), out_specs=spec,
        out_shape=jax.ShapeDtypeStruct((rows, width), x.dtype),
        num_warps=NUM_WARPS, num_stages=1, interpret=interpret)
    return out.reshape(shape)


def l2norm_and_factor(x: jax.Array, implementation: str = "xla"):
    """(y, r): ``l2norm(x)``'s rows in x's dtype and their float32 factors [...] (``layout.
    l2norm_and_factor``'s formula), not differentiable: for a custom_vjp whose backward kernel
    applies the normalisation's VJP. One Pallas pass over x where ``dispatch.l2norm_implementation``
    takes the kernels, the jnp formula otherwise."""
    impl = dispatch.l2norm_implementation(implementation, x.dtype, x.shape[-1], x.size)
    if impl == "xla":
        return l2norm_and_factor_xla(x)
    shape, width = x.shape, x.shape[-1]
    rows = x.size // width
    spec = pl.BlockSpec((BLOCK_ROWS, width), lambda i: (i, 0))
    y, r = triton_call(
        functools.partial(_forward_kernel, rows=rows, eps=L2NORM_EPS), x.reshape(rows, width),
        name="gdp_l2norm_fwd", grid=(pl.cdiv(rows, BLOCK_ROWS),), in_specs=(spec,),
        out_specs=(spec, pl.BlockSpec((BLOCK_ROWS,), lambda i: (i,))),
        out_shape=(jax.ShapeDtypeStruct((rows, width), x.dtype),
                   jax.ShapeDtypeStruct((rows,), jnp.float32)),
        num_warps=NUM_WARPS, num_stages=1, interpret=impl == "interpret")
    return y.reshape(shape), r.reshape(shape[:-1])


def _forward_kernel(x_ref, y_ref, r_ref, *, rows: int, eps: float):
    first = pl.program_id(0) * BLOCK_ROWS
    row_valid = first + jax.lax.broadcasted_iota(jnp.int32, (BLOCK_ROWS,), 0) < rows
    x = load_rows(x_ref, row_valid).astype(jnp.float32)                 # [BR, D]
    r = jax.lax.rsqrt(jnp.sum(x * x, axis=1) + eps)                      # [BR]
    plgpu.store(y_ref, (x * r[:, None]).astype(y_ref.dtype), mask=row_valid[:, None])
    plgpu.store(r_ref, r, mask=row_valid)
