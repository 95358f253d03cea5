"""chunk_gdp_fwd_o forward on CPU: the jnp path ("xla") and the Pallas kernel in the interpreter
("interpret", or ``chunk_o_fwd_pallas(interpret=True)`` directly for each launch variant).

The primary test is SPEC's identity: the recurrence's own h, v_new and g fed to chunk_o reproduce
its o (float64). Gradients are in test_chunk_o_bwd.py, argument errors in test_validation.py.
"""
import functools

import chex
import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import gdp_jax
from gdp_jax._src import dispatch
from gdp_jax._src.segments import segment_runs, segment_start_rows
from gdp_jax.ops.chunk_o.pallas_fwd import BlockSizes, chunk_o_fwd_pallas, default_block_sizes
from cases import Case, assert_close, build, case_id, chunk_o_fn, run_chunk_o, tolerance

IMPLEMENTATIONS = ["xla", "interpret"]
BASE = Case(77, 32, 16, 2, 16)          # g, segments, initial state, float32

# A covering subset of T x (K, V) x M x chunk size x g x segments x dtype, not the product: every
# M and chunk size with and without g and segments, K != V both ways, ragged T on every chunk size
# and T a multiple of it, K and V that are not powers of two (zero-padded to tiles), and the
# default launch's branches (4 chunks per program at K, V <= 64 and chunk <= 64, copy_order
# "fused" at M = 3, one chunk per program at chunk 128).
FORWARD_CASES = [
    BASE,
    Case(130, 16, 32, 3, 32, initial_state=False),
    Case(130, 24, 20, 1, 64, gated=False),
    Case(77, 32, 16, 1, 16, gated=False, segments=False),
    Case(64, 16, 32, 2, 32, segments=False),
    Case(150, 16, 16, 2, 128),
    Case(77, 16, 32, 2, 16, dtype="bfloat16"),
    Case(130, 32, 16, 3, 32, segments=False, dtype="bfloat16"),
    Case(130, 32, 16, 2, 16, dtype="float16"),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", FORWARD_CASES, ids=case_id)
def test_against_recurrence(case, implementation):
    p = build(case)
    o = run_chunk_o(p, implementation)
    chex.assert_shape(o, (case.batch, case.tokens, case.heads, case.value_dim))
    chex.assert_type(o, case.jnp_dtype)
    # A row left unwritten (zero) would add >= 1/sqrt(B*T*H) ~ 0.05 to the relative error here.
    assert_close(o, p.ref["o"], tolerance(case.dtype), "o")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("tokens", [1, 17])
def test_short_sequences(tokens, implementation):
    """T = 1 (one partial chunk of one token) and T = chunk + 1 (a one-token last chunk); row 1's
    last token starts a segment."""
    ids = np.array([[0] * tokens, [0] * (tokens - 1) + [1]], np.int32)
    p = build(Case(tokens, 16, 32, 2, 16), segment_ids=ids)
    assert_close(run_chunk_o(p, implementation), p.ref["o"], tolerance("float32"))


class DefaultImplementationTest(chex.TestCase):
    """implementation=None is "xla" on a CPU host; eager and jitted calls agree with the recurrence."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_default_implementation(self):
        if jax.default_backend() == "cpu":
            assert dispatch.resolve_implementation(None) == "xla"
        p = build(BASE)
        op = self.variant(functools.partial(gdp_jax.chunk_gdp_fwd_o, chunk_size=16))
        assert_close(op(*p.chunk_o_args(), segment_ids=p.segment_ids), p.ref["o"],
                     tolerance("float32"))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_scale_and_explicit_num_householder(implementation):
    """o is linear in scale (the recurrence used the default K ** -0.5); an explicit M equal to the
    inferred one changes nothing."""
    p = build(BASE)
    o_explicit = run_chunk_o(p, implementation, scale=0.3, num_householder=2)
    assert_close(o_explicit, p.ref["o"] * 0.3 * BASE.key_dim ** 0.5, tolerance("float32"))
    o_scaled = run_chunk_o(p, implementation, scale=0.3)
    np.testing.assert_array_equal(np.asarray(o_explicit), np.asarray(o_scaled))


# ---------------------------------------------------------------------------------------------
# Segments: the carried state reaches only the segment live at the chunk's first token.

CHUNK = 16
# Row 0: segments [0, 10) [10, 16) [16] [17, 30) [30, 41) [41, 48) with ids 0 1 0 1 0 2: one starts
# exactly on the chunk boundary 16 and has length 1, one crosses the boundary 32, ids repeat
# non-adjacently. Row 1: a different packing, segments start at 15 (one before a boundary) and 33.
HAND_IDS = np.array([[0] * 10 + [1] * 6 + [0] + [1] * 13 + [0] * 11 + [2] * 7,
                     [5] * 15 + [6] * 18 + [5] * 15], np.int32)
# Tokens whose segment is live at their chunk's first token (0, 16, 32), written out by hand.
HAND_LIVE = [list(range(0, 10)) + [16] + list(range(32, 41)),
             list(range(0, 15)) + list(range(16, 32)) + [32]]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_state_term_only_reaches_segment_live_at_chunk_start(implementation):
    # With v = 0 only the carried-state term is left: o[t] = scale [same(t, c0)] 2^g[t] q[t]·h[c].
    rng = np.random.default_rng(0)
    batch, tokens, heads, key_dim, value_dim, m = 2, 3 * CHUNK, 2, 16, 16, 2
    q = rng.normal(size=(batch, tokens, heads, key_dim)).astype(np.float32)
    k = rng.normal(size=(batch, tokens * m, heads, key_dim)).astype(np.float32)
    v = np.zeros((batch, tokens * m, heads, value_dim), np.float32)
    h = rng.normal(size=(batch, 3, heads, key_dim, value_dim)).astype(np.float32)
    g = -rng.uniform(0, 3, size=(batch, tokens, heads)).astype(np.float32)
    o = np.asarray(chunk_o_fn(implementation, CHUNK)(q, k, v, h, g, segment_ids=HAND_IDS),
                   np.float64)
    live = np.zeros((batch, tokens), bool)
    for row, tokens_live in enumerate(HAND_LIVE):
        live[row, tokens_live] = True
    chunk_of = np.arange(tokens) // CHUNK
    state_term = np.einsum("bthk,bthkv->bthv", q.astype(np.float64), h.astype(np.float64)[:, chunk_of])
    expected = key_dim ** -0.5 * np.exp2(g.astype(np.float64))[..., None] * state_term
    expected = np.where(live[:, :, None, None], expected, 0.0)
    assert (o[~live] == 0).all(), "state reached a token outside the segment live at c0"
    assert_close(o, expected, tolerance("float32"))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_hand_built_segments_against_recurrence(implementation):
    p = build(Case(3 * CHUNK, 16, 16, 2, CHUNK), segment_ids=HAND_IDS)
    assert_close(run_chunk_o(p, implementation), p.ref["o"], tolerance("float32"))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_repeated_id_does_not_join_segments(implementation):
    # ids [0, 0, 1, 1, 0, 0]: nothing in the first 0-run may reach the second 0-run.
    ids = np.array([[0] * 4 + [1] * 4 + [0] * 8], np.int32)
    p = build(Case(16, 16, 16, 1, CHUNK, batch=1, heads=1), segment_ids=ids)
    op = chunk_o_fn(implementation, CHUNK)
    o = op(*p.chunk_o_args(), segment_ids=p.segment_ids)
    o_perturbed = op(p.q, p.k.at[:, :4].add(1.0), p.v_new.at[:, :4].add(10.0), p.h, p.g,
                     segment_ids=p.segment_ids)
    np.testing.assert_array_equal(np.asarray(o[:, 8:]), np.asarray(o_perturbed[:, 8:]))
    assert not np.allclose(o[:, :4], o_perturbed[:, :4])      # the perturbation did land
    assert_close(o, p.ref["o"], tolerance("float32"))


def test_segment_start_rows_against_brute_force():
    """The kernels' segment input: for each t, the row of t's chunk where t's segment begins.
    Brute force over random packings (many starts, repeated ids, one-token segments), ragged T."""
    for tokens, chunk_size in [(1, 16), (70, 16), (200, 64)]:
        rng = np.random.default_rng(tokens)
        ids = rng.integers(0, 3, size=(3, tokens)).astype(np.int32)
        ids[1] = 7                                                 # one segment for the row
        runs = np.asarray(segment_runs(jnp.asarray(ids)))
        got = np.asarray(segment_start_rows(jnp.asarray(runs), chunk_size))
        chex.assert_shape(got, ids.shape)
        chex.assert_type(got, np.int32)
        for b in range(ids.shape[0]):
            for t in range(tokens):
                c0, s = t - t % chunk_size, t
                while s > c0 and runs[b, s - 1] == runs[b, t]:
                    s -= 1
                assert got[b, t] == s - c0, (tokens, b, t)
        assert (got[1] == 0).all()


# ---------------------------------------------------------------------------------------------
# Property test: random shapes (widths below 16 too) and packings, the jnp path.

@st.composite
def random_problems(draw):
    batch, tokens, heads = draw(st.integers(1, 2)), draw(st.integers(1, 100)), draw(st.integers(1, 2))
    layout = draw(st.sampled_from(["none", "one segment", "every token its own", "random"]))
    if layout == "none":
        ids = None
    elif layout == "one segment":
        ids = np.full((batch, tokens), 7, np.int32)
    elif layout == "every token its own":
        ids = np.tile(np.arange(tokens, dtype=np.int32), (batch, 1))
    else:   # few distinct ids, so runs have random lengths and ids repeat non-adjacently
        ids = np.array([draw(st.lists(st.integers(0, 2), min_size=tokens, max_size=tokens))
                        for _ in range(batch)], np.int32)
    case = Case(tokens, draw(st.sampled_from([8, 16, 32])), draw(st.sampled_from([8, 16, 32])),
                draw(st.integers(1, 3)), draw(st.sampled_from([16, 32])), gated=draw(st.booleans()),
                segments=ids is not None, batch=batch, heads=heads)
    return case, ids, draw(st.integers(0, 2 ** 32 - 1))


@settings(max_examples=3, deadline=None)
@given(random_problems())
@example((Case(1, 8, 32, 3, 16, batch=1, heads=1), np.zeros((1, 1), np.int32), 0))      # T = 1
@example((Case(37, 16, 8, 2, 16, gated=True), np.tile(np.arange(37, dtype=np.int32), (2, 1)), 1))
def test_random_shapes_against_recurrence(problem):
    case, ids, seed = problem
    p = build(case, segment_ids=ids, seed=seed)
    o = run_chunk_o(p, "xla")
    chex.assert_shape(o, p.ref["o"].shape)
    assert_close(o, p.ref["o"], tolerance("float32"))


# ---------------------------------------------------------------------------------------------
# The forward kernel's launch variants (BlockSizes), each forced on a small problem in the
# interpreter: K = V = 32 with 16-wide blocks, so every loop takes several steps, T = 45 (three
# chunks of 16, the last partial), so a program walking 2 chunks owns one in its last launch.

def _sizes(**kw):
    return BlockSizes(**dict(dict(block_v=32, value_blocks_per_program=1), **kw))


# Three problems: M = 1 with g and segments, M = 2 without either, M = 3 with both. The masks and
# decay weights are formed once per chunk the same way in every variant (_src.pallas.chunk_weights),
# so each variant needs g and segments only once; M sets the copy loops.
VARIANT_PROBLEMS = {1: Case(45, 32, 32, 1, 16), 2: Case(45, 32, 32, 2, 16, gated=False, segments=False),
                    3: Case(45, 32, 32, 3, 16)}
LAUNCH_VARIANTS = {
    # name: (M, BlockSizes)
    "value-tiles-2": (2, _sizes(block_v=16, value_blocks_per_program=2)),
    "value-tiles-2-chunks-2": (1, _sizes(block_v=16, value_blocks_per_program=2, chunks_per_program=2)),
    "fused-M1": (1, _sizes(copy_order="fused")),
    "fused-M2-chunks-3": (2, _sizes(copy_order="fused", chunks_per_program=3)),
    "k-loop-M1": (1, _sizes(block_k=16)),
    "k-loop-M2-chunks-2": (2, _sizes(block_k=16, chunks_per_program=2)),
    "k-loop-M3-value-tiles-2": (3, _sizes(block_k=16, block_v=16, value_blocks_per_program=2)),
    "value-step-one-step": (1, _sizes(block_k=16, value_step=32)),
    "value-step-two-tiles": (2, _sizes(block_k=16, block_v=16, value_blocks_per_program=2,
                                       value_step=16)),
    "value-step-M3-chunks-2": (3, _sizes(block_k=16, value_step=16, chunks_per_program=2)),
    "prefetch-M2": (2, _sizes(block_k=16, prefetch_values=True)),
    "prefetch-M3-chunks-2": (3, _sizes(block_k=16, prefetch_values=True, chunks_per_program=2)),
}


@pytest.mark.parametrize("name", list(LAUNCH_VARIANTS))
def test_launch_variants_in_interpreter(name):
    m, sizes = LAUNCH_VARIANTS[name]
    case = VARIANT_PROBLEMS[m]
    p = build(case)
    sizes.check(case.key_dim, case.value_dim)
    op = jax.jit(functools.partial(chunk_o_fwd_pallas, scale=p.scale, chunk_size=16,
                                   num_householder=m, interpret=True, block_sizes=sizes))
    o = op(p.q, p.k, p.v_new, p.h, p.g, p.runs)
    assert_close(o, p.ref["o"], tolerance("float32"))


def test_default_block_sizes_table():
    """The launch table's rows (RESULTS.md, "chunk_o forward launch table"); every choice tiles
    its shape."""
    fields = lambda s: (s.block_k, s.num_stages, s.block_v, s.value_blocks_per_program,
                        s.value_step, s.prefetch_values)
    # 16-bit inputs at chunk 64, K >= 128, M <= 3: the K loop; V = 256 over two value programs.
    assert fields(default_block_sizes(128, 256, 64, 2)) == (32, 5, 128, 1, None, False)
    assert fields(default_block_sizes(128, 128, 64, 1)) == (64, 2, 128, 1, None, False)
    assert fields(default_block_sizes(128, 128, 64, 3)) == (64, 2, 128, 1, 64, False)
    assert fields(default_block_sizes(128, 64, 64, 3)) == (64, 2, 64, 1, None, False)  # 128-wide only
    assert fields(default_block_sizes(256, 256, 64, 2)) == (32, 4, 128, 1, None, True)
    assert not default_block_sizes(256, 256, 64, 1).prefetch_values
    assert not default_block_sizes(256, 256, 64, 3).prefetch_values
    assert default_block_sizes(128, 128, 64, 3).copy_order == "scores_first"
    # Elsewhere no K loop: 4-byte tiles, chunk 128, K = 64, M = 4.
    for args in [(128, 128, 64, 2, 4), (128, 128, 128, 2), (64, 64, 64, 2), (128, 128, 64, 4)]:
        assert default_block_sizes(*args).block_k is None, args
    # Small K and V at chunk <= 64: 4 chunks per program; M >= 3 fuses the copies' dots.
    assert default_block_sizes(64, 64, 64, 2).chunks_per_program == 4
    assert default_block_sizes(64, 64, 128, 2).chunks_per_program == 1
    assert default_block_sizes(128, 128, 64, 4).copy_order == "fused"
    # Without the K loop V > 128 loops over 128-wide value tiles in one program.
    wide = default_block_sizes(128, 256, 64, 2, itemsize=4)
    assert (wide.block_v, wide.value_blocks_per_program) == (128, 2)
    for key_dim in (16, 32, 64, 128, 256):
        for value_dim in (16, 64, 256):
            for chunk_size in (16, 64, 128):
                for m in (1, 2, 3, 4):
                    for itemsize in (2, 4):
                        default_block_sizes(key_dim, value_dim, chunk_size, m, itemsize).check(
                            key_dim, value_dim)


# ---------------------------------------------------------------------------------------------
# Where the compiled kernels would not fit, "pallas" runs the jnp path, forward and backward.

@pytest.mark.parametrize("dtype,key_dim,value_dim,chunk_size,runs", [
    ("float32", 256, 16, 128, "xla"),       # 4-byte q, k tiles of 128 x 256: 256 KiB of shared memory
    ("float32", 200, 16, 128, "xla"),       # K pads to 256
    ("float32", 128, 256, 128, "pallas"),
    ("float32", 256, 256, 64, "pallas"),
    ("bfloat16", 256, 256, 128, "pallas"),
    ("bfloat16", 300, 16, 64, "xla"),       # K pads to 512: wider than the kernels are built for
    ("bfloat16", 16, 257, 64, "xla"),
    ("float64", 16, 16, 64, "xla"),         # no 8-byte tiles
])
def test_dispatch_rule(dtype, key_dim, value_dim, chunk_size, runs):
    got = dispatch.chunk_o_implementation("pallas", jnp.dtype(dtype), key_dim, value_dim, chunk_size)
    assert got == runs
    assert dispatch.chunk_o_implementation("xla", jnp.dtype(dtype), key_dim, value_dim,
                                           chunk_size) == "xla"
    interpreted = dispatch.chunk_o_implementation("interpret", jnp.dtype(dtype), key_dim,
                                                  value_dim, chunk_size)
    assert interpreted == ("xla" if dtype == "float64" else "interpret")   # no shared-memory limit


@pytest.mark.parametrize("case", [Case(137, 200, 16, 2, 128, batch=1, heads=1),
                                  Case(73, 16, 257, 2, 64, dtype="bfloat16", batch=1, heads=1)],
                         ids=case_id)
def test_pallas_runs_the_jnp_path_where_the_kernels_do_not_fit(case):
    """This host has no GPU, so a "pallas" call that reached a kernel would fail here: the unfit
    shapes must run, equal "xla" bit for bit, forward and gradients, and match the recurrence."""
    p = build(case)

    def value_and_grads(implementation):
        def loss(q, k, v, h, g):
            o = gdp_jax.chunk_gdp_fwd_o(q, k, v, h, g, segment_ids=p.segment_ids,
                                        chunk_size=case.chunk_size, implementation=implementation)
            return jnp.sum(o.astype(jnp.float32) ** 2), o
        return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5)), has_aux=True))(
            *p.chunk_o_args())

    (_, o), grads = value_and_grads("pallas")
    (_, o_xla), grads_xla = value_and_grads("xla")
    assert_close(o, p.ref["o"], tolerance(case.dtype))
    chex.assert_trees_all_equal((o, grads), (o_xla, grads_xla))


def _kernel_operand_sources(jaxpr, sources):
    """For every kernel call in ``jaxpr`` (pallas_call, or mpmd_map as ``plgpu.kernel`` traces),
    nested calls followed: the set of labels (``sources``: top-level variable -> label) of the
    operands that are those variables as given. An operand made by any other equation (a
    reshape, pad or copy of an input) carries no label."""
    found = []
    for eqn in jaxpr.eqns:
        args = [sources.get(v) if isinstance(v, jex_core.Var) else None for v in eqn.invars]
        if eqn.primitive.name in ("pallas_call", "mpmd_map"):
            found.append({a for a in args if a is not None})
            continue
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if isinstance(inner, jex_core.Jaxpr) and len(inner.invars) == len(args):
                found += _kernel_operand_sources(
                    inner, {v: a for v, a in zip(inner.invars, args) if a is not None})
    return found


@pytest.mark.parametrize("implementation", ["interpret", "pallas", "mosaic", "mosaic_interpret"])
def test_kernels_read_h_as_given(implementation):
    """The forward and backward kernels take the caller's h itself as an operand: no reshape or
    copy of it first. Outside jit each would be a copy of the whole state array (8.6 GB on a
    row of 2^20 tokens at H16 K = V = 128, enough to run that GPU test out of memory). Traced
    only, so the compiled kernels' wrappers are checked on a CPU too."""
    p = build(Case(130, 64, 64, 2, 64, dtype="bfloat16", segments=False))
    q, k, v, h, g = p.chunk_o_args()
    h = h.astype(q.dtype)                 # the Mosaic kernels take h in q's 16-bit dtype
    assert dispatch.chunk_o_implementation(implementation, q.dtype, 64, 64, 64, h.dtype) \
        == implementation

    def fwd_and_bwd(q, k, v, h, g):
        f = functools.partial(gdp_jax.chunk_gdp_fwd_o, implementation=implementation)
        o, vjp = jax.vjp(f, q, k, v, h, g)
        return o, vjp(o)

    jaxpr = jax.make_jaxpr(fwd_and_bwd)(q, k, v, h, g).jaxpr
    calls = _kernel_operand_sources(jaxpr, {jaxpr.invars[3]: "h"})
    assert len(calls) >= 2, calls                      # the forward and the backward kernels
    assert any("h" in c for c in calls[:1]) and any("h" in c for c in calls[1:]), calls
