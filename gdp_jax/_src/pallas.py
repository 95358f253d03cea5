"""What every Pallas kernel of gdp_jax shares: one launch helper, row loads, index dtype, the chunk
masks and decay weights, and the constants.

Optional operands follow ``jax/experimental/pallas/ops/gpu/attention.py``: an absent operand is
``None`` with a ``None`` BlockSpec, and the kernel receives ``None`` for its ref.
"""
from __future__ import annotations

import contextlib
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:     # a jax whose Pallas has no Triton lowering: dispatch routes around ours
    plgpu = None

LN2 = math.log(2.0)
LOG2_E = math.log2(math.e)
HIGHEST = jax.lax.Precision.HIGHEST
# Three TF32 passes per dot (Triton's tf32x3): float32-level products on the tensor cores. An
# option of the WY VJP kernel (``precision=``), no default's choice; the interpreter's CPU dots
# have no TF32 algorithms and run it as HIGHEST.
TF32X3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


@contextlib.contextmanager
def triton_backend_warning_filtered():
    """Filters Pallas' Triton-backend DeprecationWarning (jax >= 0.11) around our own calls only,
    never globally: it is the backend our kernels target."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*[Tt]riton.*", category=DeprecationWarning)
        yield


def triton_call(kernel, *operands, name: str, grid, in_specs, out_specs, out_shape,
                num_warps: int, num_stages: int, interpret: bool):
    """``pl.pallas_call(kernel, ...)(*operands)`` with Triton compiler params, under the warning
    filter. Operands and specs are pytrees (tuples, ``None`` for an absent operand)."""
    call = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=name)
    with triton_backend_warning_filtered():
        return call(*operands)


def index(x):
    """An int32 scalar from ``pl.program_id`` in the dtype a Python int index takes (int64 under
    jax_enable_x64, else int32: a no-op). Pallas' interpreter slices a ref with all its indices in
    one dynamic_slice, which refuses mixed int32 and int64."""
    return jnp.asarray(x, dtype=int)


def load_rows(ref, row_valid, other=0):
    """Masked load of a [rows, ...] tile; rows past the end of the sequence read ``other``."""
    mask = row_valid.reshape(row_valid.shape + (1,) * (len(ref.shape) - 1))
    return plgpu.load(ref, mask=mask, other=other)


def row_validity(chunk, chunk_size: int, tokens: int):
    """[BT] bool: which rows of chunk ``chunk`` are real tokens (the last chunk may be partial)."""
    t_in_chunk = jax.lax.broadcasted_iota(jnp.int32, (chunk_size,), 0)
    return chunk * chunk_size + t_in_chunk < tokens


def chunk_weights(g, start_row, chunk_size: int, row_valid=None):
    """The masks and decay weights of one chunk of SPEC's chunked form, as the chunk_o kernels use
    them.

    g: [BT] float32 chunk-local log2 decays, or None. start_row: [BT] int32, the row where each
    token's segment begins within the chunk (``segments.segment_start_rows``), or None.
    row_valid: [BT] bool, or None; when given, pairs with a padding row t are masked too.

    Returns (row_weight, pair_mask, pair_weight):
      row_weight  [BT] f32 = [same(t, c0)] 2^g[t], the carried state's weight; None when all ones.
      pair_mask   [BT, BT] bool = [s <= t, same(s, t)] (and t real).
      pair_weight [BT, BT] f32 = pair_mask 2^(g[t] - g[s]); None without g (the mask alone is
                  the weight). Outside the mask 2^(g[t] - g[s]) may overflow (s > t, or a padding
                  row, whose g is 0); the select replaces it by 0 before any product sees it.
    """
    t_ids = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 0)
    s_ids = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 1)
    pair_mask = s_ids <= t_ids
    if row_valid is not None:
        pair_mask &= row_valid[:, None]
    row_weight = None if g is None else jnp.exp2(g)
    if start_row is not None:
        pair_mask &= s_ids >= start_row[:, None]                    # same(s, t), given s <= t
        live_at_c0 = start_row == 0
        row_weight = (live_at_c0.astype(jnp.float32) if row_weight is None
                      else jnp.where(live_at_c0, row_weight, 0.0))
    pair_weight = None
    if g is not None:
        pair_weight = jnp.where(pair_mask, jnp.exp2(g[:, None] - g[None, :]), 0.0)
    return row_weight, pair_mask, pair_weight


def apply_pair_weight(x, pair_mask, pair_weight):
    """P ⊙ x for a [BT, BT] tile: the decay weights, or the mask alone without decays."""
    return x * pair_weight if pair_weight is not None else jnp.where(pair_mask, x, 0.0)
