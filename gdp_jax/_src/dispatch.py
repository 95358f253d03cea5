"""Which implementation, dtype and kernel runs, decided in one place from plain values.

Implementations: "xla" (jnp, any backend), "pallas" (Triton kernels, compiled for a GPU),
"interpret" (the same kernels in Pallas' interpreter: CPU tests). ``None`` means "pallas" on a GPU
backend and "xla" elsewhere.

Where a request cannot run as asked, it runs the jnp path instead, never fails at launch:

| case | runs | why |
|---|---|---|
| float64 inputs, any implementation | "xla" in float64 | the kernels accumulate in float32 and have no 8-byte tiles |
| "pallas", K or V padded above 256 | "xla" | every kernel was compiled (sm_90a) and run up to 256 |
| "pallas" chunk_o, 4-byte inputs, K padded above 128, chunk 128 | "xla" (chunk_o only) | the [128, 256] f32 q and k tiles alone are 256 KiB; the forward asks 256 KiB of shared memory, the backward 288 KiB (227 KiB on an H200) |

The interpreter has no shared-memory limit and runs every 2- and 4-byte input. The dtype rules of
the full op's Pallas path are the functions below; RESULTS.md, "Dtype rules of the full op", has
the measurements.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from gdp_jax._src.layout import tile_width
from gdp_jax._src.pallas import TF32X3

IMPLEMENTATIONS = ("pallas", "xla", "interpret")
KERNEL_MAX_WIDTH = 256


def resolve_implementation(implementation: Optional[str]) -> str:
    """None -> "pallas" on a GPU backend, "xla" elsewhere; validates explicit choices.

    "pallas" is not refused on a CPU host: lowering for CUDA there is legitimate (AOT, jax.export
    with lowering_platforms=("cuda",)); compiled for the CPU it fails in Pallas itself."""
    if implementation is None:
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None; got {implementation!r}")
    return implementation


def kernel_dtype_supported(dtype) -> bool:
    """2- and 4-byte floats; float64 runs the jnp path."""
    return jnp.dtype(dtype).itemsize <= 4


def kernel_widths_supported(key_dim: int, value_dim: int) -> bool:
    """K and V, padded to tile widths, within KERNEL_MAX_WIDTH."""
    return max(tile_width(key_dim), tile_width(value_dim)) <= KERNEL_MAX_WIDTH


def chunk_o_implementation(implementation: str, dtype, key_dim: int, value_dim: int,
                           chunk_size: int) -> str:
    """What chunk_gdp_fwd_o runs, forward and backward, for a resolved ``implementation``."""
    if implementation == "xla" or not kernel_dtype_supported(dtype):
        return "xla"
    if implementation == "pallas":
        wide_f32 = (jnp.dtype(dtype).itemsize >= 4 and tile_width(key_dim) > 128
                    and chunk_size >= 128)
        if not kernel_widths_supported(key_dim, value_dim) or wide_f32:
            return "xla"
    return implementation


def states_implementation(implementation: str, dtype, key_dim: int, value_dim: int) -> str:
    """What the full op's WY and state-walk stages (2-3) run, forward and backward."""
    if implementation == "xla" or not kernel_dtype_supported(dtype):
        return "xla"
    if implementation == "pallas" and not kernel_widths_supported(key_dim, value_dim):
        return "xla"
    return implementation


def work_dtype(dtype):
    """w, u and h of the Pallas path, and the forward walk's dot operands: 16-bit for 16-bit
    inputs (as fla keeps them; the carried state stays float32), float32 otherwise."""
    return jnp.dtype(dtype) if jnp.dtype(dtype).itemsize == 2 else jnp.dtype(jnp.float32)


def walk_bwd_dot_dtype(dtype):
    """The reverse walk's dot operands and the intermediates it passes through HBM: bfloat16 for
    bfloat16 inputs; float32 (TF32 dots) otherwise. Not float16: the state's cotangent sums a whole
    row's cotangents and can outgrow float16's range, where bfloat16 keeps float32's exponent."""
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(jnp.float32)


def wy_bwd_dots(dtype):
    """(precision, operand_dtype) of the WY VJP kernel's dots: bfloat16 operands for bfloat16
    inputs, TF32 for float16 (its M and F sums can outgrow float16), TF32x3 (float32-level) for
    float32: IEEE float32 dots on whole 64 x 64 tiles are FMA loops that spill."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return TF32X3, None
    return None, (dtype if dtype == jnp.bfloat16 else None)
