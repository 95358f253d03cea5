"""Argument checking: every bad input to a public op is refused with a ValueError or TypeError whose
message names the argument (what it got, what was expected), before any kernel runs; and the
kernels' own launch-parameter checks (BlockSizes.check and friends). Each case changes one thing
from arguments the op accepts (the first test of each group)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax.ops.chunk_h import chunk_h_bwd_pallas
from gdp_jax.ops.chunk_h.pallas_bwd import BlockSizes as WalkBwdBlockSizes
from gdp_jax.ops.chunk_o import pallas_bwd, pallas_fwd
from gdp_jax.ops.wy import wy_bwd_pallas, wy_pallas
from gdp_jax.ops.wy.pallas_bwd import BlockSizes as WyBwdBlockSizes


def _id(overrides):
    return "-".join(f"{name}={getattr(value, 'shape', value)}{getattr(value, 'dtype', '')}"
                    for name, value in overrides.items())


# ---------------------------------------------------------------------------------------------
# chunk_gdp_fwd_o

B, T, H, K, V, M, BT = 2, 40, 2, 16, 8, 2, 16
NT = -(-T // BT)


def _chunk_o(**overrides):
    zeros = lambda *shape, dtype=jnp.float32: jnp.zeros(shape, dtype)
    args = dict(q=zeros(B, T, H, K), k=zeros(B, T * M, H, K), v=zeros(B, T * M, H, V),
                h=zeros(B, NT, H, K, V), g=zeros(B, T, H), segment_ids=zeros(B, T, dtype=jnp.int32),
                chunk_size=BT, implementation="xla")
    args.update(overrides)
    q, k, v, h, g = (args.pop(name) for name in ("q", "k", "v", "h", "g"))
    return gdp_jax.chunk_gdp_fwd_o(q, k, v, h, g, **args)


def test_chunk_o_good_arguments_are_accepted():
    # Traced, not run: the checks read static shapes and dtypes only.
    assert jax.eval_shape(_chunk_o).shape == (B, T, H, V)


CHUNK_O_BAD = [
    # overrides, error type, pattern naming the argument
    (dict(q=jnp.zeros((B, T, H * K))), ValueError, r"^q\b"),
    (dict(k=jnp.zeros((B, T * M, H, K, 1))), ValueError, r"^k\b"),
    (dict(v=jnp.zeros((B, T * M, H * V))), ValueError, r"^v\b"),
    (dict(h=jnp.zeros((B, NT, H, K * V))), ValueError, r"^h\b"),
    (dict(g=jnp.zeros((B, T, H, 1))), ValueError, r"^g\b"),
    (dict(k=jnp.zeros((B, T * M + 1, H, K))), ValueError, r"^k\.shape\[1\]"),
    (dict(k=jnp.zeros((B, 0, H, K)), v=jnp.zeros((B, 0, H, V))), ValueError,
     r"^k\.shape\[1\] must be a multiple T\*M .* got k\.shape\[1\] = 0"),
    (dict(q=jnp.zeros((B, 0, H, K))), ValueError, r"^q\.shape\[1\] \(T, tokens per row\)"),
    (dict(k=jnp.zeros((B, T * M, H, K + 1))), ValueError, r"^k\b"),
    (dict(v=jnp.zeros((B, T * M + 1, H, V))), ValueError, r"^v\b"),
    (dict(num_householder=3), ValueError, r"num_householder"),
    (dict(num_householder=0), ValueError, r"num_householder"),
    (dict(h=jnp.zeros((B, NT + 1, H, K, V))), ValueError, r"^h\b"),
    (dict(h=jnp.zeros((B, NT, H, K + 1, V))), ValueError, r"^h\b"),
    (dict(h=jnp.zeros((B, NT, H, K, V + 1))), ValueError, r"^h\b"),
    (dict(g=jnp.zeros((B, T + 1, H))), ValueError, r"^g\b"),
    (dict(g=jnp.zeros((B, T, H + 1))), ValueError, r"^g\b"),
    (dict(segment_ids=jnp.zeros((B, T + 1), jnp.int32)), ValueError, r"^segment_ids\b"),
    (dict(segment_ids=jnp.zeros((T,), jnp.int32)), ValueError, r"^segment_ids\b"),
    (dict(segment_ids=jnp.zeros((B, T), jnp.float32)), TypeError, r"^segment_ids\b"),
    (dict(chunk_size=48), ValueError, r"^chunk_size\b"),
    (dict(chunk_size=8), ValueError, r"^chunk_size\b"),
    (dict(chunk_size=256), ValueError, r"^chunk_size\b"),
    (dict(chunk_size=64.0), ValueError, r"^chunk_size\b"),
    (dict(chunk_size=True), ValueError, r"^chunk_size\b"),
    (dict(implementation="cuda"), ValueError, r"^implementation\b"),
    (dict(k=jnp.zeros((B, T * M, H, K), jnp.bfloat16)), TypeError, r"q, k, v must share one dtype"),
    (dict(v=jnp.zeros((B, T * M, H, V), jnp.float16)), TypeError, r"q, k, v must share one dtype"),
    (dict(q=jnp.zeros((B, T, H, K), jnp.int32)), TypeError, r"^q\b"),
    (dict(h=jnp.zeros((B, NT, H, K, V), jnp.int32)), TypeError, r"^h\b"),
    (dict(v=jnp.zeros((B, T * M, H, V), jnp.int32)), TypeError, r"^v\b"),
    (dict(g=jnp.zeros((B, T, H), jnp.int32)), TypeError, r"^g\b"),
    (dict(scale=float("nan")), ValueError, r"^scale\b"),
    (dict(scale="0.5"), TypeError, r"^scale\b"),
    (dict(scale=jnp.ones(2)), TypeError, r"^scale\b"),
]


@pytest.mark.parametrize("overrides,error,pattern", CHUNK_O_BAD,
                         ids=[_id(overrides) for overrides, _, _ in CHUNK_O_BAD])
def test_chunk_o_bad_input(overrides, error, pattern):
    with pytest.raises(error, match=pattern):
        _chunk_o(**overrides)


# ---------------------------------------------------------------------------------------------
# chunk_gated_delta_product

def _full(**overrides):
    b, t, h, kd, vd, m = 2, 8, 2, 16, 8, 2
    args = dict(q=np.zeros((b, t, h, kd), np.float32), k=np.zeros((b, t * m, h, kd), np.float32),
                v=np.zeros((b, t * m, h, vd), np.float32), g=np.zeros((b, t, h), np.float32),
                beta=np.ones((b, t * m, h), np.float32), chunk_size=16, implementation="xla")
    args.update(overrides)
    positional = [args.pop(n) for n in ("q", "k", "v", "g", "beta")]
    return gdp_jax.chunk_gated_delta_product(*positional, **args)


def test_full_op_good_arguments_are_accepted():
    o, final_state = jax.eval_shape(lambda: _full(output_final_state=True))
    assert o.shape == (2, 8, 2, 8) and final_state.shape == (2, 2, 16, 8)


FULL_BAD = [
    (dict(beta=np.ones((2, 8, 2), np.float32)), ValueError,
     r"beta must have shape .*\(2, 16, 2\).*got \(2, 8, 2\)"),
    (dict(g=np.zeros((2, 8), np.float32)), ValueError, r"g must have rank 3.*got shape \(2, 8\)"),
    (dict(g=np.zeros((2, 8, 3), np.float32)), ValueError,
     r"g must have shape .*\(2, 8, 2\).*got \(2, 8, 3\)"),
    (dict(initial_state=np.zeros((2, 2, 8, 16), np.float32)), ValueError,
     r"initial_state must have shape .*\(2, 2, 16, 8\).*got \(2, 2, 8, 16\)"),
    (dict(k=np.zeros((2, 12, 2, 16), np.float32)), ValueError, r"k.shape\[1\] must be a multiple"),
    (dict(num_householder=3), ValueError, r"k.shape\[1\] must be T\*M"),
    (dict(v=np.zeros((2, 16, 2, 8), jnp.bfloat16)), TypeError, r"q, k, v must share one dtype"),
    (dict(beta=np.ones((2, 16, 2), np.int32)), TypeError, r"beta must be a floating-point array"),
    (dict(segment_ids=np.zeros((2, 7), np.int32)), ValueError, r"segment_ids must have shape"),
    (dict(chunk_size=48), ValueError, r"chunk_size must be a power of two"),
    (dict(implementation="cuda"), ValueError, r"implementation must be one of"),
    (dict(output_final_state=1), TypeError, r"output_final_state must be a Python bool"),
    (dict(use_qk_l2norm="yes"), TypeError, r"use_qk_l2norm must be a Python bool"),
    (dict(scale=float("inf")), ValueError, r"scale must be finite"),
    (dict(q=np.zeros((2, 0, 2, 16), np.float32), k=np.zeros((2, 0, 2, 16), np.float32),
          v=np.zeros((2, 0, 2, 8), np.float32), g=None, beta=np.zeros((2, 0, 2), np.float32)),
     ValueError, r"^q.shape\[1\] \(T, tokens per row\) must be at least 1"),
]


@pytest.mark.parametrize("overrides,error,pattern", FULL_BAD,
                         ids=[_id(overrides) for overrides, _, _ in FULL_BAD])
def test_full_op_bad_input(overrides, error, pattern):
    with pytest.raises(error, match=pattern):
        _full(**overrides)


# ---------------------------------------------------------------------------------------------
# recurrent_gdp_step

def _decode(**overrides):
    b, m, h, kd, vd = 2, 2, 2, 16, 8
    args = dict(q_t=np.zeros((b, h, kd), np.float32), k_t=np.zeros((b, m, h, kd), np.float32),
                v_t=np.zeros((b, m, h, vd), np.float32), g_t=np.zeros((b, h), np.float32),
                beta_t=np.ones((b, m, h), np.float32), state=np.zeros((b, h, kd, vd), np.float32))
    kwargs = {}
    for name, value in overrides.items():
        (args if name in args else kwargs)[name] = value
    return gdp_jax.recurrent_gdp_step(*args.values(), **kwargs)


def test_decode_good_arguments_are_accepted():
    o, state = jax.eval_shape(lambda: _decode(num_householder=2))
    assert o.shape == (2, 2, 8) and state.shape == (2, 2, 16, 8)


DECODE_BAD = [
    (dict(k_t=np.zeros((2, 2, 2, 8), np.float32)), ValueError, r"k_t must have shape .*\(2, 2, 2, 16\)"),
    (dict(beta_t=np.ones((2, 3, 2), np.float32)), ValueError,
     r"beta_t must have shape .*\(2, 2, 2\).*got \(2, 3, 2\)"),
    (dict(state=np.zeros((2, 2, 8, 16), np.float32)), ValueError, r"state must have shape"),
    (dict(g_t=np.zeros((2,), np.float32)), ValueError, r"g_t must have rank 2"),
    (dict(num_householder=3), ValueError, r"k_t.shape\[1\] must be M = num_householder = 3; got 2"),
    (dict(v_t=np.zeros((2, 2, 2, 8), jnp.bfloat16)), TypeError, r"q_t, k_t, v_t must share one dtype"),
    (dict(use_qk_l2norm=1), TypeError, r"use_qk_l2norm must be a Python bool"),
]


@pytest.mark.parametrize("overrides,error,pattern", DECODE_BAD,
                         ids=[_id(overrides) for overrides, _, _ in DECODE_BAD])
def test_decode_bad_input(overrides, error, pattern):
    with pytest.raises(error, match=pattern):
        _decode(**overrides)


# ---------------------------------------------------------------------------------------------
# The kernels' launch parameters (tuning overrides: dataclasses.replace of the default table)

FWD_DEFAULT = pallas_fwd.default_block_sizes(128, 128, 64, 2)     # the K loop


@pytest.mark.parametrize("changes,pattern", [
    (dict(block_k=48), "block_k"),
    (dict(block_k=32, copy_order="fused"), "block_k takes copy_order='scores_first'"),
    (dict(copy_order="fast"), "copy_order"),
    (dict(block_v=48), "block_v"),
    (dict(block_v=64, value_blocks_per_program=4), "must divide"),
    (dict(value_step=48), "value_step"),
    (dict(value_step=256), "value_step"),
    (dict(block_k=None, value_step=64), "value_step and prefetch_values need the K loop"),
    (dict(block_k=None, prefetch_values=True), "need the K loop"),
    (dict(block_v=64, value_blocks_per_program=2, prefetch_values=True),
     "prefetch_values needs one value tile"),
    (dict(value_step=64, prefetch_values=True), "prefetch_values needs one value tile"),
])
def test_chunk_o_forward_block_sizes_are_checked(changes, pattern):
    sizes = dataclasses.replace(FWD_DEFAULT, **changes)
    with pytest.raises(ValueError, match=pattern):
        sizes.check(128, 128)


def test_chunk_o_kernels_refuse_bad_block_sizes_at_the_call():
    """The kernels check their block sizes (and the backward its cotangent) before launching."""
    q, k, v = jnp.zeros((1, 20, 1, 32)), jnp.zeros((1, 40, 1, 32)), jnp.zeros((1, 40, 1, 32))
    h, do = jnp.zeros((1, 2, 1, 32, 32)), jnp.zeros((1, 20, 1, 32))
    kw = dict(scale=1.0, chunk_size=16, num_householder=2, interpret=True)
    with pytest.raises(ValueError, match="block_v"):
        pallas_fwd.chunk_o_fwd_pallas(q, k, v, h, None, None, **kw, block_sizes=pallas_fwd.BlockSizes(
            block_v=48, value_blocks_per_program=1))
    with pytest.raises(ValueError, match="block_v must be a power of two >= 16 dividing 32"):
        pallas_bwd.chunk_o_bwd_pallas(q, k, v, h, None, None, do, **kw, block_sizes=pallas_bwd.BlockSizes(
            block_k=32, block_v=48, num_warps=4))
    with pytest.raises(ValueError, match="block_k"):
        pallas_bwd.chunk_o_bwd_pallas(q, k, v, h, None, None, do, **kw, block_sizes=pallas_bwd.BlockSizes(
            block_k=8, block_v=32, num_warps=4))
    with pytest.raises(ValueError, match=r"^do must have shape"):
        pallas_bwd.chunk_o_bwd_pallas(q, k, v, h, None, None, do[:, :10], **kw)


def test_wy_and_walk_kernels_refuse_bad_shapes():
    k, v, beta = jnp.zeros((1, 96, 1, 32)), jnp.zeros((1, 96, 1, 32)), jnp.zeros((1, 96, 1))
    inverse = jnp.zeros((1, 96, 1, 32))
    with pytest.raises(ValueError, match="multiple of sub_chunk"):
        wy_pallas(k[:, :80], v[:, :80], beta[:, :80], None, None, sub_chunk=32,
                  out_dtype=jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="at most 64"):
        wy_pallas(jnp.zeros((1, 128, 1, 32)), jnp.zeros((1, 128, 1, 32)), jnp.zeros((1, 128, 1)),
                  None, None, sub_chunk=128, out_dtype=jnp.float32, interpret=True)
    bwd = lambda *a, **kw: wy_bwd_pallas(*a, sub_chunk=kw.pop("sub_chunk", 32), interpret=True, **kw)
    with pytest.raises(ValueError, match="sub_chunk must be 16, 32 or 64"):
        bwd(k, v, beta, None, None, inverse, k, v, sub_chunk=48)
    with pytest.raises(ValueError, match="powers of two"):
        bwd(k[..., :24], v, beta, None, None, inverse, k[..., :24], v)
    with pytest.raises(ValueError, match="powers of two"):
        bwd(k, v, beta, None, None, inverse, k, v, block_sizes=WyBwdBlockSizes(block_cols=48))
    with pytest.raises(ValueError, match="du v's"):
        bwd(k, v, beta, None, None, inverse, k, v[:, :64])
    with pytest.raises(ValueError, match="inverse must be"):
        bwd(k, v, beta, None, None, inverse[..., :16], k, v)
    with pytest.raises(ValueError, match="dk_accumulate must match"):
        bwd(k, v, beta, None, None, inverse, k, v, dk_accumulate=(k, k[:, :64]))
    with pytest.raises(ValueError, match="walk_share_gates needs"):
        bwd(k, v, beta, None, None, inverse, k, v, walk_share_gates=True)
    # The reverse walk's blocks must tile the padded K and V.
    w, dv = jnp.zeros((1, 64, 1, 32)), jnp.zeros((1, 64, 1, 32))
    h = jnp.zeros((1, 2, 1, 32, 32))
    with pytest.raises(ValueError, match="block_v must be a power of two >= 16 dividing 32"):
        chunk_h_bwd_pallas(w, w, None, None, h, dv, h, dv, h[:, 0], chunk_size=16,
                           num_householder=2, with_initial_state=False, interpret=True,
                           block_sizes=WalkBwdBlockSizes(block_k=32, block_v=48, num_warps=4))
