"""Which implementation, dtype and kernel runs, decided in one place from plain values.

Implementations: "xla" (jnp, any backend), "pallas" (Triton kernels, compiled for a GPU),
"interpret" (the Triton kernels in Pallas' interpreter: CPU tests), "mosaic" (chunk_gdp_fwd_o's
forward and backward as Mosaic GPU kernels, every other kernel as for "pallas"),
"mosaic_interpret" (those kernels in Mosaic GPU's interpreter, the others as for "interpret").
"pallas" runs Triton kernels except where the table below gives a Mosaic GPU one.
``None`` means "pallas" on a GPU backend whose Pallas has the Triton lowering, "mosaic" on one
without it, "xla" elsewhere.

Where a request cannot run as asked, it runs the next implementation down, never fails at launch:

| case | runs | why |
|---|---|---|
| float64 inputs, any implementation | "xla" in float64 | the kernels accumulate in float32 and have no 8-byte tiles |
| "pallas", K or V padded above 256 | "xla" | every kernel was compiled (sm_90a) and run up to 256 |
| "pallas" chunk_o, 4-byte inputs, K padded above 128, chunk 128 | "xla" (chunk_o only) | the [128, 256] f32 q and k tiles alone are 256 KiB; the forward asks 256 KiB of shared memory, the backward 288 KiB (227 KiB on an H200) |
| "mosaic" chunk_o outside ``mosaic_supported`` (4-byte inputs, h of another dtype, chunk other than 64, K or V padded above 256) | the "pallas" rule, both directions | wgmma takes 16-bit operands in 64-row tiles; SMEM holds K, V up to 256 |
| "pallas" chunk_o forward where the Mosaic one runs, K or V padded above 128 (jax >= 0.11), except the full op's forward with l2norm's factors in the kernels | the Mosaic GPU forward | 0.96x the Triton forward's time at B2 T16384 H16 K256 M2, both at 96-100 % of the floor; level (0.99-1.00x) at K = V = 64 and 128, so Triton stays there (RESULTS.md, "The Mosaic grids' head axis"); only the Triton kernel takes the factors |
| "pallas" chunk_o backward where the Mosaic one runs, K and V padded to at most 128 (jax >= 0.11) | the Mosaic GPU backward, one kernel | 1.2-1.4x faster than the Triton backward on an H200 (RESULTS.md, "chunk_gdp_fwd_o on Mosaic GPU") |
| "pallas" chunk_o backward where the Mosaic one runs, K or V padded above 128 (jax >= 0.11) | the Mosaic GPU backward, two kernels (``mosaic_bwd``) | at K = 256, chunk_o forward + backward on Mosaic GPU took 0.97-0.99x the Triton pair's time gated (M = 1..3), 0.90-0.94x ungated, one process on an H100, with the slower forward of the two (RESULTS.md, "The two-kernel Mosaic backward against the Triton one") |
| "mosaic", the full op's other stages | the "pallas" rule | no Mosaic GPU kernel of theirs yet |
| use_qk_l2norm, the queries, ungated, where chunk_o's backward is the one-kernel Mosaic GPU one | the normalisation's VJP inside that kernel (``queries_l2norm_vjp_in_chunk_o_kernel``) | it holds whole dq rows: no pass over HBM of its own (gated it measured slower) |
| use_qk_l2norm, the keys, K up to 128, where the WY VJP kernel runs | the normalisation's VJP inside that kernel (``keys_l2norm_vjp_in_wy_kernel``) | it sums dk's shares anyway: no pass over HBM of its own (at K = 256 it measured slower) |
| use_qk_l2norm under "pallas" / "interpret", rows not one power-of-two tile up to 256, or 2^31 elements or more | autodiff of the jnp formula | the backward kernel (``ops.l2norm``) takes one tile per row and 32-bit offsets |
| use_qk_l2norm, the full op's forward when not differentiated, on the Triton kernels, at least 128 walk programs | q and k normalised inside the kernels (``l2norm_fused``) | two XLA passes fewer (RESULTS.md, "use_qk_l2norm") |

The interpreters have no shared-memory limit and run every 2- and 4-byte input (the Mosaic GPU
one: what ``mosaic_supported`` accepts). The dtype rules of the full op's Pallas path are the
functions below; RESULTS.md, "Dtype rules of the full op", has the measurements.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from gdp_jax._src.layout import tile_width
from gdp_jax._src import pallas

IMPLEMENTATIONS = ("pallas", "xla", "interpret", "mosaic", "mosaic_interpret")
KERNEL_MAX_WIDTH = 256
MOSAIC_CHUNK_SIZE = 64      # wgmma's 64-row tile: one warpgroup, one chunk
MOSAIC_TILE = 64            # 16-bit SMEM tiles pad K and V to 64 columns (128-byte swizzle)


def resolve_implementation(implementation: Optional[str]) -> str:
    """None -> "pallas" on a GPU backend ("mosaic" where Pallas has no Triton lowering), "xla"
    elsewhere; validates explicit choices.

    "pallas" is not refused on a CPU host: lowering for CUDA there is legitimate (AOT, jax.export
    with lowering_platforms=("cuda",)); compiled for the CPU it fails in Pallas itself."""
    if implementation is None:
        if jax.default_backend() != "gpu":
            return "xla"
        return "pallas" if has_triton_lowering() else "mosaic"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None; got {implementation!r}")
    if implementation in ("pallas", "interpret") and not has_triton_lowering():
        raise ValueError(f"implementation={implementation!r} needs Pallas' Triton lowering, which "
                         f"jax {jax.__version__} lacks; use 'mosaic', 'mosaic_interpret' or 'xla'")
    return implementation


def has_triton_lowering() -> bool:
    """Whether this jax's Pallas still has its Triton backend (deprecated in jax 0.11)."""
    return pallas.plgpu is not None


def triton_counterpart(implementation: str) -> str:
    """The implementation of the stages that have no Mosaic GPU kernel: "mosaic" -> "pallas",
    "mosaic_interpret" -> "interpret" (both "xla" on a jax without the Triton lowering), others
    unchanged."""
    if implementation not in ("mosaic", "mosaic_interpret"):
        return implementation
    if not has_triton_lowering():
        return "xla"
    return "pallas" if implementation == "mosaic" else "interpret"


def mosaic_padded_width(n: int) -> int:
    """K or V as the Mosaic GPU kernel pads it: a multiple of MOSAIC_TILE."""
    return -(-n // MOSAIC_TILE) * MOSAIC_TILE


def _mosaic_width(key_dim: int, value_dim: int) -> int:
    return max(mosaic_padded_width(key_dim), mosaic_padded_width(value_dim))


def mosaic_supported(dtype, h_dtype, key_dim: int, value_dim: int, chunk_size: int) -> bool:
    """Whether chunk_o's Mosaic GPU forward runs the case: 16-bit q, k, v with h of the same
    dtype (wgmma's operands), chunk 64, K and V padded to multiples of 64 up to 256."""
    return (jnp.dtype(dtype).itemsize == 2 and jnp.dtype(h_dtype) == jnp.dtype(dtype)
            and chunk_size == MOSAIC_CHUNK_SIZE
            and _mosaic_width(key_dim, value_dim) <= KERNEL_MAX_WIDTH)


MOSAIC_BWD_ONE_KERNEL_WIDTH = 128   # one backward kernel's SMEM tiles: 193 KiB at K = V = 128


def chunk_o_backward_implementation(forward: str, dtype, key_dim: int, value_dim: int,
                                    chunk_size: int, h_dtype=None) -> str:
    """What chunk_gdp_fwd_o's backward runs, given its forward's implementation (the answer of
    ``chunk_o_implementation`` for the same arguments): the Mosaic GPU backward where
    ``mosaic_backward_supported``, under "mosaic" and (measured faster, see the module's table)
    under "pallas"; else ``triton_counterpart``. "interpret" keeps the Triton backward: it is the
    interpreter of the Triton kernels."""
    fits = mosaic_backward_supported(dtype, dtype if h_dtype is None else h_dtype, key_dim,
                                     value_dim, chunk_size)
    if forward in ("mosaic", "mosaic_interpret") and fits:
        return forward
    if forward == "pallas" and fits and mosaic_by_default():
        return "mosaic"
    return triton_counterpart(forward)


def mosaic_backward_supported(dtype, h_dtype, key_dim: int, value_dim: int,
                              chunk_size: int) -> bool:
    """Whether chunk_o's Mosaic GPU backward runs the case: what the forward takes."""
    return mosaic_supported(dtype, h_dtype, key_dim, value_dim, chunk_size)


def mosaic_by_default() -> bool:
    """Whether "pallas" takes chunk_o's Mosaic GPU kernels where the module's table says so: on
    the jax they were run and timed on (0.11; on 0.10 they are only lowered, never run)."""
    return tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)


def kernel_dtype_supported(dtype) -> bool:
    """2- and 4-byte floats; float64 runs the jnp path."""
    return jnp.dtype(dtype).itemsize <= 4


def kernel_widths_supported(key_dim: int, value_dim: int) -> bool:
    """K and V, padded to tile widths, within KERNEL_MAX_WIDTH."""
    return max(tile_width(key_dim), tile_width(value_dim)) <= KERNEL_MAX_WIDTH


# "pallas" takes chunk_o's Mosaic GPU forward where K or V pads above this (the module's table).
MOSAIC_FWD_MIN_WIDTH = 128


def chunk_o_implementation(implementation: str, dtype, key_dim: int, value_dim: int,
                           chunk_size: int, h_dtype=None, scaled: bool = False) -> str:
    """What chunk_gdp_fwd_o's forward runs for a resolved ``implementation`` (h_dtype: h's
    dtype, default ``dtype``). ``scaled``: the forward applies l2norm's factors
    (``chunk_o_scaled_forward``), which only the Triton kernel takes, so "pallas" keeps it.
    Its backward: ``chunk_o_backward_implementation``."""
    mosaic = mosaic_supported(dtype, dtype if h_dtype is None else h_dtype, key_dim, value_dim,
                              chunk_size)
    if implementation in ("mosaic", "mosaic_interpret"):
        if mosaic:
            return implementation
        implementation = triton_counterpart(implementation)
    if (implementation == "pallas" and mosaic and not scaled and mosaic_by_default()
            and _mosaic_width(key_dim, value_dim) > MOSAIC_FWD_MIN_WIDTH):
        return "mosaic"
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
    implementation = triton_counterpart(implementation)
    if implementation == "xla" or not kernel_dtype_supported(dtype):
        return "xla"
    if implementation == "pallas" and not kernel_widths_supported(key_dim, value_dim):
        return "xla"
    return implementation


# Below this many walk programs (B * H * value blocks) the walk is latency-bound, one step after
# another on few SMs, and the factors' per-step work shows (l2norm_fused).
L2NORM_FUSED_MIN_WALK_PROGRAMS = 128


def l2norm_fused(states: str, chunk_o_forward: str, walk_programs: int) -> bool:
    """Whether the full op's undifferentiated forward normalises q and k inside its kernels
    (use_qk_l2norm), given what ``states_implementation`` and ``chunk_o_implementation``
    answered and the state walk's program count (B * H * value blocks of 64). Under
    differentiation the normalisation stays a separate step (``ops.l2norm``), whose VJP the
    backward needs. Rows, first match wins (RESULTS.md,
    "use_qk_l2norm"):

    | case | fused | why |
    |---|---|---|
    | a stage off the Triton kernels ("xla", Mosaic chunk_o) | no | only the Triton kernels take the factors |
    | fewer than L2NORM_FUSED_MIN_WALK_PROGRAMS walk programs | no | B1 T65536 H16 (32 programs): the op 1.05x, the walk 0.6 ms slower |
    | otherwise | yes | the op's forward 0.93-0.94x (M = 2 at K = 128 and 256, 16 segments a row): two XLA passes for one reduction over q |
    """
    kernels = states == chunk_o_forward and states in ("pallas", "interpret")
    return kernels and walk_programs >= L2NORM_FUSED_MIN_WALK_PROGRAMS


# Keys up to this padded width take their l2norm VJP inside the WY VJP kernel.
KEYS_L2NORM_IN_WY_MAX_WIDTH = 128


def keys_l2norm_vjp_in_wy_kernel(states: str, dtype, interpret: bool, key_dim: int) -> bool:
    """Whether use_qk_l2norm's VJP for the keys runs inside the WY VJP kernel (``wy_bwd_pallas``
    with ``key_factor``), given what ``states_implementation`` answered; elsewhere the
    normalisation is its own step (``l2norm_implementation``). One H100, bf16, M = 2, gated
    (RESULTS.md, "use_qk_l2norm's VJP inside the backward kernels"):

    | case | in the kernel | why |
    |---|---|---|
    | the WY VJP kernel does not run (``wy_bwd_runs_kernel``: compiled float32) | no | nothing to fuse into |
    | keys padded past KEYS_L2NORM_IN_WY_MAX_WIDTH | no | K = 256: the kernel 2.667 ms against 2.064, more than the 0.518 ms pass it saves (its extra gram dots and second reads of the dk shares over four key blocks) |
    | otherwise | yes | K = 128: the kernel +0.14 ms, the 0.273 ms pass gone |
    """
    return (states in ("pallas", "interpret") and wy_bwd_runs_kernel(dtype, interpret)
            and tile_width(key_dim) <= KEYS_L2NORM_IN_WY_MAX_WIDTH)


def queries_l2norm_vjp_in_chunk_o_kernel(backward: str, key_dim: int, value_dim: int,
                                         gated: bool) -> bool:
    """Whether use_qk_l2norm's VJP for the queries runs inside chunk_o's backward kernel
    (``chunk_o_bwd_mosaic`` with ``q_factor``), given what ``chunk_o_backward_implementation``
    answered; elsewhere the normalisation is its own step (``l2norm_implementation``):

    | case | in the kernel | why |
    |---|---|---|
    | not the one-kernel Mosaic GPU backward (K or V past 128, Triton, jnp) | no | only that kernel holds whole dq rows |
    | gated | no | the kernel took 0.19-0.21 ms longer, against 0.142 for the separate pass (one H100, B8 T4096 H16 K128 M2; RESULTS.md, "use_qk_l2norm's VJP inside the backward kernels") |
    | ungated | yes | the kernel 0.006 ms longer, the 0.142 ms pass gone (same run) |
    """
    return (backward in ("mosaic", "mosaic_interpret") and not gated
            and _mosaic_width(key_dim, value_dim) <= MOSAIC_BWD_ONE_KERNEL_WIDTH)


def l2norm_implementation(implementation: str, dtype, width: int, size: int) -> str:
    """What ``use_qk_l2norm``'s normalisation of an [..., width] array of ``size`` elements runs:
    its backward's Pallas kernel (``ops.l2norm``) under "pallas" / "interpret" and their Mosaic
    counterparts, for 2- and 4-byte inputs whose rows are one power-of-two tile of at most
    KERNEL_MAX_WIDTH and fewer than 2^31 elements in all (32-bit offsets); autodiff of the jnp
    formula otherwise."""
    implementation = triton_counterpart(implementation)
    fits = (tile_width(width) == width <= KERNEL_MAX_WIDTH and size < 2 ** 31
            and kernel_dtype_supported(dtype))
    return implementation if implementation in ("pallas", "interpret") and fits else "xla"


def work_dtype(dtype):
    """w, u and h of the Pallas path, and the forward walk's dot operands: 16-bit for 16-bit
    inputs (as fla keeps them; the carried state stays float32), float32 otherwise."""
    return jnp.dtype(dtype) if jnp.dtype(dtype).itemsize == 2 else jnp.dtype(jnp.float32)


def walk_bwd_dot_dtype(dtype):
    """The reverse walk's dot operands and the intermediates it passes through HBM: bfloat16 for
    bfloat16 inputs; float32 (TF32 dots) otherwise. Not float16: the state's cotangent sums a whole
    row's cotangents and can outgrow float16's range, where bfloat16 keeps float32's exponent."""
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(jnp.float32)


def wy_fwd_runs_kernel(dtype, interpret: bool) -> bool:
    """Whether the full op's WY stage runs its Pallas kernel (``wy.pallas_fwd``): for 16-bit
    inputs, and always in the interpreter. Compiled float32 inputs take ``wy_xla`` on the same
    sub-chunk grid: the kernel's IEEE float32 dots are unrolled FMA loops, 25.8 ms at the
    headline and a 23-26 s compile; the op's float32 forward took 5.99 against 33.4 ms that way,
    first call 5 s (RESULTS.md, "The walk applies T, float32's WY forward in jnp")."""
    return jnp.dtype(dtype).itemsize == 2 or interpret


def walk_applies_inverse(dtype, key_dim: int) -> bool:
    """Whether the op's undifferentiated forward has the WY kernel write T alone and the state
    walk apply it (v_new = T (beta (v - live 2^gamma s (k h))), w and u never written): for 16-bit
    inputs, whose w and u round to 16 bits anyway. RESULTS.md, "The walk applies T" and "The
    backward works from T": the op's forward 0.90-0.92x at K = 128, 0.79x at K = 256, 0.97x at
    K = 64 with the WY kernel writing T at one warp (1.16x at two), 0.92x with it at one
    sub-chunk a program ("Few-program walks, ..."). float32 inputs keep the IEEE w and u (the
    walk's dots are TF32)."""
    return jnp.dtype(dtype).itemsize == 2


def backward_walks_from_inverse(dtype) -> bool:
    """Whether the op's differentiable forward has the WY kernel write T alone (kept for the WY
    VJP anyway) and both state walks work from it: the forward walk applies T, the reverse walk
    forms w^T dvt as k^T (r (T^T dvt)), and w and u never reach HBM. For bfloat16 inputs, whose
    VJP keeps T in bfloat16, the walks' dot dtype (float16 keeps it in float32 for TF32 dots), at
    every K. RESULTS.md, "The backward works from T" and "fla re-timed; whole chunks ...": the
    op's forward + backward 0.90-0.94x at K = 128 (M 1-3), 0.81x at K = 256, 0.96x at K = 64."""
    return jnp.dtype(dtype) == jnp.bfloat16


def wy_bwd_runs_kernel(dtype, interpret: bool) -> bool:
    """Whether the WY stage's VJP runs its Pallas kernel (from the forward's inverses): for 16-bit
    inputs, and always in the interpreter. Compiled float32 inputs take ``wy_bwd_xla``: IEEE
    float32 dots on whole 64 x 64 tiles are FMA loops that spill, and the kernel's TF32x3 form
    faulted on a GPU (RESULTS.md, ideas tried and dropped)."""
    return jnp.dtype(dtype).itemsize == 2 or interpret


def wy_bwd_dots(dtype):
    """(precision, operand_dtype) of the WY VJP kernel's dots: bfloat16 operands for bfloat16
    inputs, TF32 for float16 (its M and F sums can outgrow float16), IEEE float32 for float32
    (the interpreter's case: compiled float32 takes ``wy_bwd_xla``)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return pallas.HIGHEST, None
    return None, (dtype if dtype == jnp.bfloat16 else None)
