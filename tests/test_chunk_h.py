"""Stage 3, the chunk-state walk: ``chunk_h_pallas`` (forward kernel: value blocks, 16-bit dots,
initial state, ``subchunks`` and ``every_chunk_too``) and ``chunk_h_bwd_pallas`` (reverse walk and
chunk-parallel epilogue: with and without g, segments and initial state, key and value blocks,
``subchunks``, 16-bit operands), interpreted.

Forward reference: the recurrence's own h, v_new and final state (w, u from the jnp WY stage).
Backward reference: float64 autodiff of ``walk64`` below, the walk stated chunk by chunk with
explicit per-token masks (independent of chunk_h_xla's chunk views), checked against the
recurrence here too.
"""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax.ops.chunk_h import chunk_h_bwd_pallas, chunk_h_pallas
from gdp_jax.ops.chunk_h.pallas_bwd import BlockSizes as BwdBlockSizes, default_block_sizes
from gdp_jax.ops.chunk_h.pallas_fwd import BlockSizes
from gdp_jax.ops.cumsum import chunk_local_log2_cumsum
from gdp_jax.ops.wy import wy_xla
from cases import (Case, assert_all_close, assert_close, build, case_id, random_segment_ids,
                   seed_of, to64, tolerance)

NAMES = ("dk", "dw", "du", "dg", "dinitial_state")


def walk64(k, w, u, g, runs, state0, *, chunk_size, m):
    """(h, v_new, final_state) of the walk in float64, one chunk at a time (chunk_h.xla states it):
    h[c] = state (zero at a segment start exactly on c0 > 0), v_new = u - w h[c], state <- d h[c]
    + sum_j a_j k_j v_new_j^T with d = [same(c0, last)] 2^g[last], a_j = [same(t(j), last)]
    2^(g[last] - g[t(j)]), last the chunk's last real token."""
    batch, positions, heads, key_dim = k.shape
    value_dim = u.shape[-1]
    tokens = positions // m
    g = jnp.zeros((batch, tokens, heads), k.dtype) if g is None else g
    runs = np.zeros((batch, tokens), np.int64) if runs is None else np.asarray(runs)
    state = (jnp.zeros((batch, heads, key_dim, value_dim), k.dtype) if state0 is None else state0)
    hs, v_news = [], []
    for c0 in range(0, tokens, chunk_size):
        c1 = min(c0 + chunk_size, tokens)
        last = c1 - 1
        if c0 > 0:
            reset = jnp.asarray(runs[:, c0] != runs[:, c0 - 1])[:, None, None, None]
            state = jnp.where(reset, 0.0, state)
        hs.append(state)
        pos = slice(c0 * m, c1 * m)
        v_new = u[:, pos] - jnp.einsum("bjhk,bhkv->bjhv", w[:, pos], state)
        v_news.append(v_new)
        token_of = np.arange(c0, c1).repeat(m)                                # [L]
        same_last = jnp.asarray(runs[:, token_of] == runs[:, last:last + 1])  # [B, L]
        a = same_last[:, :, None] * jnp.exp2(g[:, last:last + 1] - g[:, token_of])   # [B, L, H]
        d = jnp.asarray(runs[:, c0] == runs[:, last])[:, None] * jnp.exp2(g[:, last])   # [B, H]
        state = d[..., None, None] * state + jnp.einsum("bjh,bjhk,bjhv->bhkv", a, k[:, pos], v_new)
    return jnp.stack(hs, axis=1), jnp.concatenate(v_news, axis=1), state


@functools.lru_cache(maxsize=None)
def walk_inputs(case: Case, segment_ids=None):
    """Primals (k, w, u, g, runs, initial_state) and cotangents (dh, dv_new, dfinal), float32;
    w and u from the jnp WY stage on random keys, values and betas (so the walk is well
    conditioned), g chunk-local log2 decays. ``segment_ids``: a bytes [B, T] int32 packing."""
    rng = np.random.default_rng(seed_of("walk", case.id, segment_ids))
    b, t, hd, kd, vd, m = case.batch, case.tokens, case.heads, case.key_dim, case.value_dim, case.m
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
    k = normal(b, t * m, hd, kd)
    k = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), case.jnp_dtype)
    v = jnp.asarray(normal(b, t * m, hd, vd))
    beta = jnp.asarray(rng.uniform(0.05, 1.95, size=(b, t * m, hd)), jnp.float32)
    g = None
    if case.gated:
        g = chunk_local_log2_cumsum(jnp.asarray(-rng.uniform(0.0, 0.25, size=(b, t, hd)),
                                                jnp.float32), case.chunk_size)
    ids = None
    if segment_ids is not None:
        ids = np.frombuffer(segment_ids, np.int32).reshape(b, t)
    elif case.segments:
        ids = random_segment_ids(rng, b, t, case.chunk_size)
    runs = None if ids is None else gdp_jax.segment_runs(jnp.asarray(ids))
    state0 = jnp.asarray(0.5 * normal(b, hd, kd, vd)) if case.initial_state else None
    w, u = jax.jit(functools.partial(wy_xla, chunk_size=case.chunk_size, num_householder=m))(
        k, v, beta, g, runs)
    cotangents = (jnp.asarray(normal(b, case.num_chunks, hd, kd, vd)),
                  jnp.asarray(normal(b, t * m, hd, vd)), jnp.asarray(normal(b, hd, kd, vd)))
    return (k, w, u, g, runs, state0), cotangents


def reference_vjp(case, primals, cotangents):
    """float64 autodiff of walk64 in (k, w, u, g, initial_state) at the given (rounded) values."""
    k, w, u, g, runs, state0 = primals
    present = [x is not None for x in (k, w, u, g, state0)]
    with jax.enable_x64(True):
        wide = lambda x: jnp.asarray(to64(x))
        diff = [wide(x) for x in (k, w, u, g, state0) if x is not None]

        @jax.jit
        def vjp(diff, cotangents):
            def fn(*diff):
                it = iter(diff)
                k, w, u, g, s0 = (next(it) if here else None for here in present)
                return walk64(k, w, u, g, runs, s0, chunk_size=case.chunk_size, m=case.m)
            return jax.vjp(fn, *diff)[1](cotangents)

        grads = iter(np.asarray(x) for x in vjp(diff, tuple(wide(x) for x in cotangents)))
        return dict(zip(NAMES, (next(grads) if here else None for here in present)))


@functools.lru_cache(maxsize=None)
def _kernels(chunk_size, m, block_sizes, dot_dtype, residual_dtype, interpret):
    """jit(forward walk kernel -> h, v_new in ``residual_dtype``; then the backward kernels)."""
    kw = dict(chunk_size=chunk_size, num_householder=m, interpret=interpret)

    @jax.jit
    def run(primals, cotangents):
        k, w, u, g, runs, state0 = primals
        h, v_new, _ = chunk_h_pallas(k, w, u, g, runs, state0, h_dtype=residual_dtype,
                                     v_new_dtype=residual_dtype, dot_dtype=residual_dtype, **kw)
        return chunk_h_bwd_pallas(k, w, g, runs, h, v_new, *cotangents, dot_dtype=dot_dtype,
                                  with_initial_state=state0 is not None, block_sizes=block_sizes,
                                  **kw)
    return run


def kernel_vjp(case, primals, cotangents, *, block_sizes=None, dot_dtype=jnp.float32,
               residual_dtype=jnp.float32, interpret=True):
    """The forward kernel's h and v_new (in ``residual_dtype``), then the backward kernels
    (interpreted here; compiled in test_gpu.py)."""
    run = _kernels(case.chunk_size, case.m, block_sizes, jnp.dtype(dot_dtype),
                   jnp.dtype(residual_dtype), interpret)
    return dict(zip(NAMES, run(primals, cotangents)))


# ---------------------------------------------------------------------------------------------
# Forward

@pytest.mark.parametrize("case,dot_dtype,block_v", [
    (Case(77, 16, 32, 2, 16), jnp.float32, 16),                    # two value blocks
    (Case(77, 16, 32, 3, 16, gated=False, segments=False, initial_state=False), jnp.float32, None),
    (Case(77, 16, 32, 2, 16), jnp.bfloat16, 16),                    # the op's 16-bit dots
], ids=["value-blocks-2", "nog-noseg-noinit", "bf16-dots"])
def test_walk_against_recurrence(case, dot_dtype, block_v):
    """h, v_new and the final state exactly as SPEC defines them. bfloat16 dots round w, k, the
    state and v_new once per dot: the half-input bound. (K and V padded to tiles: through
    states_pallas in test_full_op.py, and the backward's padded case below.)"""
    p = build(case)
    kw = dict(chunk_size=case.chunk_size, num_householder=case.m)

    @jax.jit
    def stages(k, v, beta, g, runs, initial_state):
        w, u = wy_xla(k, v, beta, g, runs, **kw)
        return chunk_h_pallas(k, w, u, g, runs, initial_state, interpret=True, dot_dtype=dot_dtype,
                              block_sizes=BlockSizes(block_v=block_v), **kw)

    h, v_new, final_state = stages(p.k, p.v, p.beta, p.g, p.runs, p.initial_state)
    tol = tolerance("float32" if dot_dtype == jnp.float32 else "bfloat16")
    assert_close(h, p.ref["h"], tol, "h")
    assert_close(v_new, p.ref["v_new"], tol, "v_new")
    assert_close(final_state, p.ref["final_state"], tol, "final_state")


@pytest.mark.parametrize("subchunks", [1, 2])
def test_walk_every_chunk_too_and_subchunks(subchunks):
    """every_chunk_too (the full op's forward rule): the state before every chunk as a fourth
    result, beside h before every ``subchunks``-th one; both are the plain walk's h, the same bits
    (with one sub-chunk a token chunk, h itself, stored once)."""
    p = build(Case(64, 32, 16, 2, 16))
    kw = dict(chunk_size=16, num_householder=2, interpret=True)
    w, u = jax.jit(functools.partial(wy_xla, chunk_size=16, num_householder=2))(
        p.k, p.v, p.beta, p.g, p.runs)
    walk = lambda **extra: jax.jit(functools.partial(chunk_h_pallas, **kw, **extra))(
        p.k, w, u, p.g, p.runs, p.initial_state)
    h_plain, v_new_plain, final_plain = walk()
    h, v_new, final_state, h_every = walk(subchunks=subchunks, every_chunk_too=True)
    chex.assert_trees_all_equal((h_every, h, v_new, final_state),
                                (h_plain, h_plain[:, ::subchunks], v_new_plain, final_plain))
    jaxpr = jax.make_jaxpr(functools.partial(chunk_h_pallas, **kw, subchunks=subchunks,
                                             every_chunk_too=True))(
        p.k, w, u, p.g, p.runs, p.initial_state)
    (kernel,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert len(kernel.outvars) == (3 if subchunks == 1 else 4)     # h, v_new, final[, h_every]
    assert_close(h_every, p.ref["h"], tolerance("float32"), "h")


@pytest.mark.parametrize("per_step", [1, 2])
def test_walk_chunks_per_step(per_step):
    """A loop step of fewer sub-chunks than a stored chunk's (h stored under a condition) gives
    the same bits as one step per stored chunk, every_chunk_too included, and the recurrence's h."""
    p = build(Case(100, 32, 16, 2, 16))
    kw = dict(chunk_size=16, num_householder=2, subchunks=4, every_chunk_too=True, interpret=True)
    w, u = jax.jit(functools.partial(wy_xla, chunk_size=16, num_householder=2))(
        p.k, p.v, p.beta, p.g, p.runs)
    walk = lambda sizes: jax.jit(functools.partial(chunk_h_pallas, **kw, block_sizes=sizes))(
        p.k, w, u, p.g, p.runs, p.initial_state)
    want = walk(BlockSizes())
    got = walk(BlockSizes(chunks_per_step=per_step))
    chex.assert_trees_all_equal(got, want)
    assert_close(got[3][:, :p.ref["h"].shape[1]], p.ref["h"], tolerance("float32"), "h")
    with pytest.raises(ValueError, match="chunks_per_step must divide subchunks = 4; got 3"):
        walk(BlockSizes(chunks_per_step=3))


@pytest.mark.parametrize("case", [Case(100, 32, 16, 2, 16, dtype="bfloat16"),
                                  Case(77, 16, 32, 3, 32, dtype="float16", initial_state=False),
                                  Case(90, 64, 32, 1, 64, dtype="bfloat16", gated=False, heads=2)],
                         ids=case_id)
def test_walk_applies_inverse(case, monkeypatch):
    """The op's forward stages with the WY kernel writing T alone and the walk applying it (v_new =
    T (beta (v - live 2^gamma k h))) give the recurrence's h, v_new and final state, and those of
    the w, u path to within one 16-bit rounding of what each rounds differently."""
    from gdp_jax._src import dispatch
    from gdp_jax.ops.gated_delta_product import states_pallas
    p = build(case)
    run = lambda: jax.jit(functools.partial(
        states_pallas, chunk_size=case.chunk_size, num_householder=case.m, interpret=True))(
        p.k, p.v, p.beta, p.g_raw, p.runs, p.initial_state)
    monkeypatch.setattr(dispatch, "walk_applies_inverse", lambda dtype, key_dim: True)
    h, v_new, final_state = run()
    monkeypatch.setattr(dispatch, "walk_applies_inverse", lambda dtype, key_dim: False)
    h_wu, v_new_wu, final_wu = run()
    tol = tolerance(case.dtype)
    assert_close(h, p.ref["h"], tol, "h")
    assert_close(v_new, p.ref["v_new"], tol, "v_new")
    assert_close(final_state, p.ref["final_state"], tol, "final_state")
    assert_all_close(dict(h=h, v_new=v_new, final_state=final_state),
                     dict(h=h_wu, v_new=v_new_wu, final_state=final_wu), tol)


def test_walk_transposed_state():
    """BlockSizes(transposed=True), the state carried as h^T: h at every sub-chunk, v_new and the
    final state as the default walk gives them (float32 dots: to float32 rounding), from T, with
    gates, segments, an initial state and key factors, on the sub-chunk grid."""
    import dataclasses
    from gdp_jax.ops.chunk_h import pallas_fwd
    from gdp_jax.ops.gated_delta_product import sub_grid_operands
    from gdp_jax.ops.wy.pallas_fwd import wy_pallas
    case = Case(150, 32, 48, 2, 32)
    p = build(case)
    k_p, v_p, beta_p, gamma, runs_p, h0, sub = sub_grid_operands(
        p.k, p.v, p.beta, p.g_raw, p.runs, p.initial_state, case.chunk_size, case.m)
    key_scale = jnp.asarray(np.random.default_rng(3).uniform(0.5, 1.5, k_p.shape[:3]), jnp.float32)
    (t,) = wy_pallas(k_p, None, beta_p, gamma, runs_p, sub_chunk=sub, out_dtype=jnp.float32,
                     interpret=True, return_inverse=True, w_and_u=False)
    subchunks = case.chunk_size * case.m // sub
    default = pallas_fwd.default_block_sizes(case.key_dim, case.value_dim, sub, subchunks, 1,
                                             jnp.float32, True)
    walk = lambda sizes: chunk_h_pallas(
        k_p, None, v_p, gamma, runs_p, h0, chunk_size=sub, num_householder=1,
        subchunks=subchunks, every_chunk_too=True, key_scale=key_scale, inverse=t, beta=beta_p,
        interpret=True, block_sizes=sizes)
    want = walk(dataclasses.replace(default, block_v=16))
    got = walk(dataclasses.replace(default, block_v=16, transposed=True))
    assert_all_close(dict(zip(("h", "v_new", "final_state", "h_every"), got)),
                     dict(zip(("h", "v_new", "final_state", "h_every"), want)), 1e-6)


def test_walk_transposed_needs_inverse():
    """The state carried transposed is a form of the walk applying T only: given w and u, the
    walk raises a ValueError naming what it needs."""
    from gdp_jax.ops.chunk_h.pallas_fwd import BlockSizes
    k = jnp.zeros((1, 64, 2, 32), jnp.float32)
    u = jnp.zeros((1, 64, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"transposed=True\) needs inverse and beta"):
        chunk_h_pallas(k, k, u, None, None, None, chunk_size=16, num_householder=1, subchunks=2,
                       interpret=True, block_sizes=BlockSizes(block_v=16, transposed=True))


def test_differentiable_forward_walk_applying_inverse_one_sub_chunk_a_step(monkeypatch):
    """bfloat16's differentiable forward (the walk applies T and stores h at every sub-chunk) at
    one sub-chunk a loop step, the launch table's choice from K = 128 (forced here at K = 32):
    the same bits as whole token chunks a step, and the recurrence's h, v_new and final state."""
    import dataclasses
    from gdp_jax._src import dispatch
    from gdp_jax.ops.chunk_h import pallas_fwd
    from gdp_jax.ops.gated_delta_product import states_pallas
    case = Case(100, 32, 16, 2, 16, dtype="bfloat16")
    p = build(case)
    monkeypatch.setattr(dispatch, "backward_walks_from_inverse", lambda dtype: True)
    run = lambda: jax.jit(functools.partial(
        states_pallas, chunk_size=16, num_householder=2, interpret=True, every_sub_chunk=True))(
        p.k, p.v, p.beta, p.g_raw, p.runs, p.initial_state)
    steps, table = [], pallas_fwd.default_block_sizes

    def one_a_step(*args, **kwargs):
        sizes = dataclasses.replace(table(*args, **kwargs), chunks_per_step=1, num_stages=2)
        steps.append(kwargs.get("applies_inverse"))
        return sizes

    whole = run()
    monkeypatch.setattr(pallas_fwd, "default_block_sizes", one_a_step)
    one = run()
    assert steps == [True]
    assert whole[3][0] is None and one[3][0] is None               # no w: the route from T
    chex.assert_trees_all_equal(one, whole)
    tol = tolerance(case.dtype)
    for name, x in zip(("h", "v_new", "final_state"), one[:3]):
        assert_close(x, p.ref[name], tol, name)


def test_walk_inverse_arguments_are_checked():
    p = build(Case(40, 16, 16, 1, 16, dtype="bfloat16", segments=False))
    k = p.k
    t = jnp.zeros(k.shape[:3] + (16,), k.dtype)
    with pytest.raises(ValueError, match="give w, or inverse and beta"):
        chunk_h_pallas(k, None, p.v, None, None, None, chunk_size=16, num_householder=1,
                       inverse=t, interpret=True)
    with pytest.raises(ValueError, match="T's last axis = chunk_size 32"):
        chunk_h_pallas(k, None, p.v, None, None, None, chunk_size=32, num_householder=1,
                       inverse=t, beta=p.beta, interpret=True)


def test_reverse_walk_inverse_arguments_are_checked():
    from gdp_jax.ops.chunk_h.pallas_bwd import chunk_h_bwd_walk
    p = build(Case(40, 16, 16, 1, 16, dtype="bfloat16", segments=False))
    k = p.k
    t = jnp.zeros(k.shape[:3] + (16,), k.dtype)
    dh = jnp.zeros((1, 3, 2, 16, 16), jnp.float32)
    kw = dict(chunk_size=16, num_householder=1, with_initial_state=False, interpret=True)
    with pytest.raises(ValueError, match="give w, or inverse and beta"):
        chunk_h_bwd_walk(k, k, None, None, dh, p.v, dh[:, 0], inverse=t, beta=p.beta, **kw)
    with pytest.raises(ValueError, match="give w, or inverse and beta"):
        chunk_h_bwd_walk(k, None, None, None, dh, p.v, dh[:, 0], inverse=t, **kw)
    with pytest.raises(ValueError, match="T's last axis = chunk_size 32"):
        chunk_h_bwd_walk(k, None, None, None, dh, p.v, dh[:, 0], inverse=t, beta=p.beta,
                         **dict(kw, chunk_size=32))


def test_walk64_matches_recurrence():
    """The backward's float64 reference walk reproduces the recurrence (w, u float32 from wy_xla)."""
    case = Case(77, 16, 32, 2, 16)
    p = build(case)
    w, u = jax.jit(functools.partial(wy_xla, chunk_size=16, num_householder=2))(
        p.k, p.v, p.beta, p.g, p.runs)
    with jax.enable_x64(True):
        wide = lambda x: jnp.asarray(to64(x))
        runs = np.asarray(p.runs)
        out = jax.jit(lambda *a: walk64(*a[:4], runs, a[4], chunk_size=16, m=2))(
            wide(p.k), wide(w), wide(u), wide(p.g), wide(p.initial_state))
    for name, x in zip(("h", "v_new", "final_state"), out):
        assert_close(x, p.ref[name], tolerance("float32"), name)


# ---------------------------------------------------------------------------------------------
# Backward

BWD_CASES = {
    # name: (case, block sizes or None for the default table)
    "g-seg-init-blocks-2x2": (Case(77, 32, 32, 2, 16),
                              BwdBlockSizes(block_k=16, block_v=16, num_warps=4)),
    "nog-seg-noinit-M3": (Case(64, 16, 32, 3, 16, gated=False, initial_state=False), None),
    "g-noseg-init-M1": (Case(50, 16, 16, 1, 16, segments=False), None),
    "nog-noseg-noinit-padded": (Case(33, 24, 48, 3, 32, gated=False, segments=False,
                                     initial_state=False), None),
}


@pytest.mark.parametrize("name", list(BWD_CASES))
def test_walk_bwd_against_float64_autodiff(name):
    case, block_sizes = BWD_CASES[name]
    primals, cotangents = walk_inputs(case)
    got = kernel_vjp(case, primals, cotangents, block_sizes=block_sizes)
    for name_, x, primal in zip(NAMES, got.values(), (primals[0], *primals[1:4], primals[5])):
        if primal is not None:
            chex.assert_equal_shape([x, primal])
            chex.assert_type(x, jnp.float32)
    assert_all_close(got, reference_vjp(case, primals, cotangents), tolerance("float32"))


# T = 40, chunk 16: segments start at 16 (a chunk boundary), 21, 22 (length 1) and 32, the first
# token of the partial last chunk; row 1 has a single segment ending in a length-1 one at 39.
BOUNDARY_IDS = np.array([[0] * 16 + [1] * 5 + [2] + [3] * 10 + [4] * 8, [7] * 39 + [8]], np.int32)


def test_walk_bwd_segments_on_chunk_boundaries():
    """Segment starts on chunk boundaries and at the partial last chunk's first token, length-1
    segments mid-row and at the end. The initial state reaches only each row's first segment: in
    row 0 it ends at 16, so the initial state's cotangent ignores every cotangent after it."""
    case = Case(40, 16, 32, 2, 16)
    primals, cotangents = walk_inputs(case, BOUNDARY_IDS.tobytes())
    got = kernel_vjp(case, primals, cotangents)
    assert_all_close(got, reference_vjp(case, primals, cotangents), tolerance("float32"))
    dh, dv_new, dfinal = cotangents
    later_changed = (dh.at[0, 1:].add(1.0), dv_new.at[0, 32:].add(1.0), dfinal.at[0].add(1.0))
    again = kernel_vjp(case, primals, later_changed)
    chex.assert_trees_all_equal(again["dinitial_state"][0], got["dinitial_state"][0])
    assert not np.allclose(again["dk"][0], got["dk"][0])          # the change did land


def test_walk_bwd_subchunks():
    """subchunks=2, as the full op's backward calls it: dh only for the states stored before every
    second chunk, i.e. the VJP with dh zero at the other chunks. T must fill whole groups of
    chunks (edge padding would decay the final state's cotangent)."""
    case = Case(64, 16, 32, 2, 16)
    primals, (dh, dv_new, dfinal) = walk_inputs(case)
    k, w, u, g, runs, state0 = primals
    kw = dict(chunk_size=16, num_householder=2, interpret=True)
    h, v_new, _ = jax.jit(functools.partial(chunk_h_pallas, **kw))(k, w, u, g, runs, state0)
    got = jax.jit(functools.partial(chunk_h_bwd_pallas, with_initial_state=True, subchunks=2, **kw))(
        k, w, g, runs, h, v_new, dh[:, ::2], dv_new, dfinal)
    want = reference_vjp(case, primals, (dh.at[:, 1::2].set(0.0), dv_new, dfinal))
    assert_all_close(dict(zip(NAMES, got)), want, tolerance("float32"))
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        chunk_h_bwd_pallas(k[:, :96], w[:, :96], g[:, :48], runs[:, :48], h[:, :3], v_new[:, :96],
                           dh[:, :3:2], dv_new[:, :96], dfinal, with_initial_state=True,
                           subchunks=2, **kw)


def test_walk_bwd_without_key_gate_terms():
    """key_gate_terms=False leaves out of dg exactly the terms a caller forms from dk:
    z_t = ln2 sum over t's copies of k·dk, -z_t at t and the chunk's sum at its last token
    (T ragged: the padded last token's share lands on token T-1, as the edge padding does)."""
    case = Case(77, 32, 16, 2, 16)
    primals, cotangents = walk_inputs(case)
    k, w, u, g, runs, state0 = primals
    kw = dict(chunk_size=16, num_householder=2, with_initial_state=True, interpret=True)
    h, v_new, _ = jax.jit(functools.partial(chunk_h_pallas, chunk_size=16, num_householder=2,
                                            interpret=True))(k, w, u, g, runs, state0)
    bwd = lambda **extra: jax.jit(functools.partial(chunk_h_bwd_pallas, **kw, **extra))(
        k, w, g, runs, h, v_new, *cotangents)
    full, partial = bwd(), bwd(key_gate_terms=False)
    chex.assert_trees_all_equal(partial[:3] + partial[4:], full[:3] + full[4:])
    dk = np.asarray(full[0], np.float64)
    batch, positions, heads, _ = dk.shape
    z = np.log(2.0) * np.sum(np.asarray(k, np.float64) * dk, axis=-1)
    z = z.reshape(batch, positions // 2, 2, heads).sum(axis=2)                 # [B, T, H]
    tokens = z.shape[1]
    chunks = -(-tokens // 16)
    z = np.pad(z, ((0, 0), (0, chunks * 16 - tokens), (0, 0))).reshape(batch, chunks, 16, heads)
    terms = -z
    terms[:, :, -1] += z.sum(axis=2)
    terms = terms.reshape(batch, chunks * 16, heads)
    terms[:, tokens - 1] += terms[:, tokens:].sum(axis=1)
    assert not np.allclose(partial[3], full[3])
    assert_close(np.asarray(partial[3]) + terms[:, :tokens], full[3], tolerance("float32"), "dg")


@pytest.mark.parametrize("dtype,dot_dtype,block_sizes", [
    ("bfloat16", jnp.bfloat16, None),
    ("float16", jnp.float32, None),
    # bf16 dots over two key blocks and two value blocks: the form K = 256 takes (128 keys, 32 columns)
    ("bfloat16", jnp.bfloat16, BwdBlockSizes(block_k=16, block_v=16, num_warps=4)),
], ids=["bf16-bf16-dots", "f16-f32-dots", "bf16-bf16-dots-blocks-2x2"])
def test_walk_bwd_16_bit(dtype, dot_dtype, block_sizes):
    """The op's configurations for 16-bit inputs: k, w, h and v_new in the inputs' dtype; the
    reverse walk's dots on bf16 operands for bf16 (dvt, dS, dw pass through HBM in bf16), float32
    for float16. Against float64 autodiff at the same rounded k and w: the half-input bound."""
    case = Case(77, 32, 32, 2, 16, dtype=dtype)
    (k, w, u, g, runs, state0), cotangents = walk_inputs(case)
    primals = (k, w.astype(dtype), u, g, runs, state0)
    got = kernel_vjp(case, primals, cotangents, block_sizes=block_sizes, dot_dtype=dot_dtype,
                     residual_dtype=case.jnp_dtype)
    chex.assert_type([got["dw"], got["du"], got["dk"]], [dot_dtype, dot_dtype, dot_dtype])
    assert_all_close(got, reference_vjp(case, primals, cotangents), tolerance(dtype))


def test_walk_bwd_default_block_sizes_table():
    """RESULTS.md, "Reverse state walk and its epilogue": (block_k, block_v, num_warps) and two
    stages for 16-bit dots where one step's k, w and dv fit (a token chunk, chunk_size * M
    rows)."""
    fields = lambda *a: (lambda s: (s.block_k, s.block_v, s.num_warps))(default_block_sizes(*a))
    assert fields(128, 128, 64, 64 * 2, jnp.bfloat16) == (128, 64, 4)
    assert fields(128, 128, 64, 64 * 2, jnp.float32) == (64, 32, 4)
    assert fields(256, 128, 64, 64 * 2, jnp.float32) == (64, 16, 4)
    assert fields(256, 128, 64, 64 * 2, jnp.bfloat16) == (128, 32, 4)    # 16-bit at K = 256: 0.73x of (64, 16)
    assert fields(200, 256, 64, 64 * 3, jnp.bfloat16) == (128, 32, 4)
    assert fields(256, 256, 128, 128 * 2, jnp.bfloat16) == (64, 16, 8)   # chunk 128: not measured there
    assert fields(256, 256, 32, 32 * 2, jnp.bfloat16) == (64, 16, 4)     # nor chunk 32
    assert fields(96, 48, 128, 128, jnp.float32) == (64, 32, 8)          # padded widths; chunk 128: 8 warps
    assert fields(16, 16, 16, 16, jnp.bfloat16) == (16, 16, 4)
    stages = lambda *a: default_block_sizes(*a).num_stages
    assert stages(64, 64, 64, 64 * 2, jnp.bfloat16) == 2         # measured: 0.72x
    assert stages(128, 128, 64, 64 * 1, jnp.float16) == 2        # M = 1: 0.89x
    assert stages(100, 256, 64, 64 * 1, jnp.bfloat16) == 2       # K padded to 128, 64-wide v blocks
    assert stages(128, 128, 64, 64 * 2, jnp.bfloat16) == 1       # measured: 1.02x
    assert stages(64, 64, 64, 64 * 3, jnp.bfloat16) == 1         # a larger step than measured
    assert stages(128, 128, 64, 64 * 1, jnp.float32) == 1        # float32 dots: one stage
    assert stages(256, 256, 64, 64 * 1, jnp.bfloat16) == 1
    # from T, a step's rows carry T's chunk_size columns in w's place: K = 256, M = 1 measured 1.03x
    assert default_block_sizes(256, 256, 64, 64, jnp.bfloat16, applies_inverse=True).num_stages == 1
    assert default_block_sizes(128, 128, 64, 128, jnp.bfloat16, walks=128, steps=1024,
                               applies_inverse=True).num_stages == 1      # headline: 1.03x with two


def test_walk_bwd_two_stages_where_few_programs():
    """On a long walk with few programs (one an SM, each latency-bound) the reverse walk takes two
    stages: 16-bit dots up to FEW_PROGRAMS_TWO_STAGE_STEP_BYTES a step, float32 dots up to
    FEW_PROGRAMS_FLOAT32_TWO_STAGE_ROWS rows; never at padded K = 256."""
    from gdp_jax.ops.chunk_h import pallas_bwd, pallas_fwd
    long = pallas_fwd.LONG_WALK_STEPS
    sizes = lambda *a, **kw: (lambda s: (s.block_v, s.num_stages))(default_block_sizes(*a, **kw))
    bf16, f32 = jnp.bfloat16, jnp.float32
    assert sizes(128, 128, 64, 128, bf16, walks=16, steps=long, applies_inverse=True) == (16, 2)
    assert sizes(128, 128, 64, 192, bf16, walks=16, steps=long, applies_inverse=True) == (16, 2)   # 78 KiB
    assert sizes(128, 128, 64, 128, bf16, walks=32, steps=long, applies_inverse=True) == (32, 2)
    assert sizes(128, 128, 64, 192, bf16, walks=16, steps=long) == (16, 1)    # from w: 102 KiB
    assert sizes(128, 128, 64, 128, bf16, walks=16, steps=long - 1, applies_inverse=True) == (64, 1)
    assert sizes(128, 128, 64, 128, f32, walks=16, steps=long) == (32, 2)     # 64 programs
    assert sizes(128, 128, 64, 192, f32, walks=16, steps=long) == (32, 2)
    assert sizes(128, 128, 64, 256, f32, walks=16, steps=long) == (32, 1)
    assert sizes(128, 128, 64, 128, f32, walks=32, steps=long) == (32, 1)     # 128 programs
    assert sizes(256, 256, 64, 64, bf16, walks=1, steps=long, applies_inverse=True) == (16, 1)
    assert sizes(256, 256, 64, 128, bf16, walks=32, steps=long, applies_inverse=True) == (32, 1)
    assert pallas_bwd.FEW_PROGRAMS_TWO_STAGE_STEP_BYTES >= 192 * (128 + 64 + 16) * 2


def test_walks_narrow_their_value_blocks_where_few():
    """pallas_fwd.value_block: below FEW_PROGRAMS programs on a walk of LONG_WALK_STEPS steps or
    more, value blocks halve down to 16; both walks' launch tables take it for 16-bit dots."""
    from gdp_jax.ops.chunk_h import pallas_fwd
    long = pallas_fwd.LONG_WALK_STEPS
    block = pallas_fwd.value_block
    assert block(128, 16, long) == 16                  # B1 H16: 32 programs at 64, 128 at 16
    assert block(128, 32, long) == 32                  # B2 H16: 64 at 64, 128 at 32
    assert block(256, 16, long) == 32                  # K = V = 256, B1 H16
    assert block(128, 128, long) == 64                 # B8 H16: 256 programs already
    assert block(128, 16, long - 1) == 64              # a short walk keeps 64
    assert block(128, 1, long) == 16                   # never below 16
    assert block(48, 1, long) == 16 and block(48, 128, long) == 64    # V padded to 64
    assert block(128, 16, 0) == 64                     # steps not known: many programs assumed
    from gdp_jax.ops.chunk_h.pallas_fwd import default_block_sizes as walk_sizes
    assert walk_sizes(128, 128, 64, 2, 1, jnp.bfloat16, walks=16, steps=long).block_v == 16
    assert walk_sizes(128, 128, 64, 2, 1, jnp.bfloat16, walks=128, steps=long).block_v is None
    assert walk_sizes(128, 128, 64, 2, 1, jnp.float32, walks=16, steps=long).block_v is None
    assert default_block_sizes(128, 128, 64, 128, jnp.bfloat16, walks=16, steps=long).block_v == 16
    assert default_block_sizes(128, 128, 64, 128, jnp.bfloat16, walks=128, steps=long).block_v == 64
    assert default_block_sizes(128, 128, 64, 128, jnp.float32, walks=16, steps=long).block_v == 32


def test_walk_transposed_where_narrowed():
    """The walk's launch table carries the state transposed where few programs narrow its value
    blocks and it applies T at padded K <= 128, with or without h at every sub-chunk; not at 64
    columns, not from w and u, not at K = 256, not for float32 dots."""
    from gdp_jax.ops.chunk_h import pallas_fwd
    long = pallas_fwd.LONG_WALK_STEPS
    transposed = lambda *a, **kw: pallas_fwd.default_block_sizes(*a, steps=long, **kw).transposed
    bf16 = jnp.bfloat16
    assert transposed(128, 128, 64, 2, 1, bf16, walks=16, applies_inverse=True)        # B1 H16 M2
    assert transposed(128, 128, 64, 2, 1, bf16, True, walks=16, applies_inverse=True)  # h every sub-chunk
    assert transposed(128, 128, 64, 3, 1, bf16, walks=16, applies_inverse=True)        # M = 3
    assert transposed(128, 128, 64, 2, 1, bf16, walks=32, applies_inverse=True)        # 32 columns
    assert transposed(100, 96, 64, 2, 1, bf16, walks=16, applies_inverse=True)         # padded to 128
    assert not transposed(128, 128, 64, 2, 1, bf16, walks=128, applies_inverse=True)   # 64 columns
    assert not transposed(128, 128, 64, 2, 1, bf16, walks=16)                          # from w, u
    assert not transposed(256, 256, 64, 2, 1, bf16, walks=16, applies_inverse=True)    # K = 256
    assert not transposed(128, 128, 64, 2, 1, jnp.float32, walks=16, applies_inverse=True)


def test_walk_default_block_sizes_table():
    """RESULTS.md, "State walk": on the full op's sub-chunk grid without h at every sub-chunk, one
    sub-chunk a step at two stages for 16-bit dots from K = 128 up; elsewhere two stages for
    16-bit dots where a whole stored chunk's k, w and u fit (chunk_size * subchunks * M rows),
    one otherwise; whole token chunks again where few programs narrow the value blocks; 32 value
    columns for the walk applying T at padded K = 256."""
    from gdp_jax.ops.chunk_h import pallas_fwd
    from gdp_jax.ops.chunk_h.pallas_fwd import default_block_sizes as walk_sizes
    sizes = lambda *a, **kw: (lambda s: (s.num_stages, s.chunks_per_step))(walk_sizes(*a, **kw))
    bf16 = jnp.bfloat16
    # The full op's forward: chunk 64, M sub-chunks a token chunk, one row a sub-chunk position.
    assert sizes(128, 128, 64, 2, 1, bf16) == (2, 1)                # measured: 0.89x
    assert sizes(128, 128, 64, 3, 1, bf16) == (2, 1)                # measured: 0.79x
    assert sizes(256, 256, 64, 2, 1, bf16) == (2, 1)                # measured: 0.76x
    assert sizes(64, 64, 64, 2, 1, jnp.float16) == (2, None)        # one a step: the op's forward 1.06x
    assert sizes(100, 64, 64, 2, 1, jnp.float16) == (2, 1)          # K padded to 128
    assert sizes(128, 128, 64, 2, 1, jnp.float32) == (1, None)      # float32 dots: 1.9x slower
    # Its backward's walk stores h at every sub-chunk: whole token chunks a step.
    every = dict(every_chunk_too=True)
    assert sizes(128, 128, 64, 2, 1, bf16, **every) == (2, None)    # one a step: 1.18x
    assert sizes(128, 128, 64, 3, 1, bf16, **every) == (1, None)    # one a step: 1.02x
    assert sizes(256, 256, 64, 2, 1, bf16, **every) == (1, None)    # shared memory overflows
    assert sizes(64, 64, 64, 3, 1, bf16, **every) == (2, None)      # a smaller step than M = 2, K = 128
    assert sizes(100, 256, 64, 2, 1, bf16, **every) == (2, None)    # K padded to 128, 64-wide v blocks
    assert sizes(129, 128, 64, 2, 1, bf16, **every) == (1, None)    # K padded to 256
    # ... unless the walk applies T (bfloat16's differentiable forward): one sub-chunk a step.
    every_t = dict(every_chunk_too=True, applies_inverse=True)
    assert sizes(128, 128, 64, 2, 1, bf16, **every_t) == (2, 1)     # offline: 74 KiB, not 131.6
    assert sizes(256, 256, 64, 2, 1, bf16, **every_t) == (2, 1)
    assert sizes(64, 64, 64, 2, 1, bf16, **every_t) == (2, None)    # K = 64: whole chunks, as w, u
    assert sizes(128, 128, 64, 2, 1, bf16, applies_inverse=True) == (2, 1)   # the primal walk as before
    # Few programs on a long walk (narrowed value blocks): whole token chunks where two stages fit.
    few = dict(applies_inverse=True, walks=16, steps=pallas_fwd.LONG_WALK_STEPS)
    assert sizes(128, 128, 64, 2, 1, bf16, **few) == (2, None)      # measured: 0.88x (16 columns)
    assert sizes(128, 128, 64, 2, 1, bf16, every_chunk_too=True, **few) == (2, None)   # 0.79x
    assert sizes(128, 128, 64, 3, 1, bf16, **few) == (2, None)      # M = 3: 0.72x
    assert sizes(256, 256, 64, 2, 1, bf16, **few) == (2, 1)         # 32 columns: a whole chunk is too large
    # The walk applying T at padded K = 256: 32 value columns at 4 warps, h at every sub-chunk or not.
    cols = lambda *a, **kw: (lambda s: (s.block_v, s.num_warps))(walk_sizes(*a, **kw))
    assert cols(256, 256, 64, 2, 1, bf16, **every_t) == (32, 4)     # 0.80x of 64 columns at 8 warps
    assert cols(200, 128, 64, 2, 1, bf16, **every_t) == (32, 4)
    assert cols(256, 256, 64, 2, 1, bf16, applies_inverse=True) == (32, 4)          # 0.77x of 64
    assert cols(256, 16, 64, 2, 1, bf16, applies_inverse=True) == (None, 4)         # V = 16: one block
    assert cols(128, 128, 64, 2, 1, bf16, **every_t) == (None, 4)   # K = 128: 64 columns
    assert cols(256, 256, 64, 2, 1, bf16) == (None, 4)              # reading w, u: not measured
    assert cols(256, 256, 32, 2, 1, bf16, applies_inverse=True) == (None, 4)        # chunk 32: not measured
    assert cols(256, 256, 32, 2, 1, bf16, **every_t) == (None, 8)   # ... where 64 columns at 4 warps spill
    assert cols(256, 256, 64, 2, 1, bf16, every_chunk_too=True, **few) == (32, 4)   # narrowed already
    # The seed op's walk: a token chunk of M rows a token, no sub-chunk grid.
    assert sizes(128, 128, 64, 1, 2, bf16) == (2, None)             # measured: 0.86x
    assert sizes(128, 128, 64, 1, 1, jnp.float16) == (2, None)      # M = 1: 0.75x
    assert sizes(64, 64, 64, 1, 2, bf16) == (2, None)               # K = 64: 0.56x
    assert sizes(128, 128, 64, 1, 3, bf16) == (1, None)             # shared memory overflows
    assert sizes(128, 128, 64, 1, 2, jnp.float32) == (1, None)
    assert BlockSizes() == walk_sizes(128, 128, 64, 1, 3, bf16)
