"""Argument checking for gdp_jax's public ops, in one place.

Every check raises ``ValueError`` (wrong shape or value) or ``TypeError`` (wrong dtype or kind) with
a message that names the argument, what it got and what was expected, so bad input never reaches a
kernel. All checks read static shapes and dtypes only, so they cost nothing under ``jax.jit``.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MIN_CHUNK_SIZE, MAX_CHUNK_SIZE = 16, 128


def _shape(x) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _dtype(x):
    return jnp.result_type(x)


def check_float_array(name: str, x: Any, rank: int, axes: str) -> tuple[int, ...]:
    """Checks that ``x`` is a floating-point array of the given rank; returns its shape."""
    shape = _shape(x)
    if len(shape) != rank:
        raise ValueError(f"{name} must have rank {rank} with axes [{axes}]; got shape {shape}")
    if not jnp.issubdtype(_dtype(x), jnp.floating):
        raise TypeError(f"{name} must be a floating-point array; got dtype {_dtype(x)}")
    return shape


def check_shape(name: str, x: Any, expected: tuple[int, ...], axes: str) -> None:
    shape = _shape(x)
    if shape != tuple(expected):
        raise ValueError(f"{name} must have shape [{axes}] = {tuple(expected)}; got {shape}")


def check_segment_ids(segment_ids: Any, batch: int, tokens: int) -> None:
    check_shape("segment_ids", segment_ids, (batch, tokens), "B, T")
    if not jnp.issubdtype(_dtype(segment_ids), jnp.integer):
        raise TypeError(f"segment_ids must be an integer array; got dtype {_dtype(segment_ids)}")


def check_chunk_size(chunk_size: Any) -> int:
    if (isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer))
            or not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE
            or chunk_size & (chunk_size - 1)):
        raise ValueError(f"chunk_size must be a power of two in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]; "
                         f"got {chunk_size!r}")
    return int(chunk_size)


def check_scale(scale: Any, key_dim: int) -> float:
    """None -> K ** -0.5; otherwise a concrete finite real number (it is baked into the kernel)."""
    if scale is None:
        return key_dim ** -0.5
    try:
        if isinstance(scale, (bool, str, bytes)) or np.ndim(scale) != 0:
            raise TypeError
        value = float(scale)
    except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
        raise TypeError(f"scale must be a concrete real number or None (it is static, not traced); "
                        f"got {type(scale).__name__} {scale!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite; got {scale}")
    return value


def infer_num_householder(num_householder: Any, q_tokens: int, k_positions: int) -> int:
    """M from k's expanded length T*M, checked against an explicit num_householder."""
    if q_tokens == 0:
        raise ValueError("q.shape[1] (T, tokens per row) must be at least 1; got 0")
    if num_householder is None:
        if k_positions % q_tokens or k_positions == 0:
            raise ValueError(f"k.shape[1] must be a multiple T*M (M >= 1) of q.shape[1] = T = "
                             f"{q_tokens}; got k.shape[1] = {k_positions}")
        num_householder = k_positions // q_tokens
    _check_num_householder(num_householder)
    if k_positions != q_tokens * num_householder:
        raise ValueError(f"k.shape[1] must be T*M = {q_tokens}*{num_householder} = "
                         f"{q_tokens * num_householder} for num_householder={num_householder}; "
                         f"got {k_positions} (k.shape[1] / T = {k_positions / q_tokens:g})")
    return int(num_householder)


def check_float_shape(name: str, x: Any, expected: tuple[int, ...], axes: str) -> None:
    """A floating-point array of exactly the expected shape (rank first, then every axis)."""
    check_float_array(name, x, len(expected), axes)
    check_shape(name, x, expected, axes)


def check_same_dtype(**arrays: Any) -> None:
    """Arrays that must share one dtype (e.g. q, k and v), named in the error."""
    dtypes = {name: _dtype(x) for name, x in arrays.items()}
    if len(set(dtypes.values())) > 1:
        names = ", ".join(dtypes)
        got = ", ".join(f"{name} {dtype}" for name, dtype in dtypes.items())
        raise TypeError(f"{names} must share one dtype; got {got}")


def check_bool(name: str, x: Any) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a Python bool (it is static); got {type(x).__name__}")
    return bool(x)


def check_num_householder_equals(num_householder: Any, inferred: int, name: str, axis_desc: str) -> int:
    """An explicit num_householder must match the M read from an array's shape (decode step)."""
    if num_householder is None:
        return inferred
    _check_num_householder(num_householder)
    if num_householder != inferred:
        raise ValueError(f"{name}.shape[{axis_desc}] must be M = num_householder = {num_householder}; "
                         f"got {inferred}")
    return int(num_householder)


def _check_num_householder(num_householder: Any) -> None:
    if isinstance(num_householder, bool) or not isinstance(num_householder, (int, np.integer)) \
            or num_householder < 1:
        raise ValueError(f"num_householder must be a positive integer; got {num_householder!r}")
