"""What every test file shares: one case type, one tolerance table, the problem builder and the
float64 references.

A ``Case`` names a shape and the options of one problem; ``build(case)`` draws fresh random inputs
for it (seeded by the case's id, so every case gets its own) and pushes them through SPEC's
recurrence in float64 (``recurrence64``: numpy, no compiles; checked against the library's
``gdp_jax.reference.recurrence`` in tests/test_full_op.py). The result serves both the full op (its
raw inputs and the reference o and final state) and chunk_o (the recurrence's own h, v_new and g,
which SPEC's identity says reproduce o). Inputs are rounded to the case's dtype *before* the
reference sees them, so the reference is exact for what the op is given.

Gradients are checked against float64 autodiff: of the recurrence for the full op
(``recurrence_grads``) and of ``dense_chunked_form``, an independent dense statement of SPEC's
chunked form (one [T, T*M] weight matrix per row and head, no chunk reshapes), for chunk_o
(``dense_chunked_grads``). ``dense_chunked_form`` is itself checked against the recurrence
(tests/test_chunk_o_bwd.py).
"""
from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from gdp_jax import reference
from gdp_jax._src.segments import segment_runs

# ---------------------------------------------------------------------------------------------
# The tolerance table: SPEC's bounds on the relative Frobenius error ||out - ref|| / ||ref||
# against a float64 evaluation, by input dtype and where the arithmetic runs. "cpu" is the jnp
# path ("xla") and the Pallas kernels in the interpreter ("interpret"), full float32 dots; "gpu"
# is the compiled kernels, whose float32 dots are TF32. float64 inputs are accumulated in float32
# (SPEC: "Accumulate in float32 whatever the input dtype"), so they take float32's bound.
# One entry is not SPEC's: "ill-conditioned" is the WY kernel's stress test (test_wy.py), repeated
# keys with beta near 2, where (I + A) has condition number ~600 and even a backward-stable
# float32 solve has a forward error of ~kappa * u (1.5e-5 measured); it keeps that test's bound.

TOLERANCE = {
    ("float32", "cpu"): 1e-5,
    ("float64", "cpu"): 1e-5,
    ("bfloat16", "cpu"): 2e-2,
    ("float16", "cpu"): 2e-2,
    ("float32", "gpu"): 2e-3,
    ("bfloat16", "gpu"): 2e-2,
    ("float16", "gpu"): 2e-2,
    ("float32", "cpu, ill-conditioned"): 5e-5,
}


def tolerance(dtype, where: str = "cpu") -> float:
    """SPEC's bound for inputs of ``dtype`` computed ``where`` ("cpu" or "gpu", see TOLERANCE)."""
    return TOLERANCE[(jnp.dtype(dtype).name, where)]


_SHORT = {"float32": "f32", "float64": "f64", "bfloat16": "bf16", "float16": "f16"}


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem: shapes and options. ``dtype`` is a dtype name ("float32", "bfloat16", ...)."""
    tokens: int
    key_dim: int
    value_dim: int
    m: int
    chunk_size: int
    gated: bool = True
    segments: bool = True
    initial_state: bool = True
    dtype: str = "float32"
    batch: int = 2
    heads: int = 2

    @property
    def id(self) -> str:
        parts = [f"T{self.tokens}", f"K{self.key_dim}", f"V{self.value_dim}", f"M{self.m}",
                 f"BT{self.chunk_size}", "g" if self.gated else "nog",
                 "seg" if self.segments else "noseg", "init" if self.initial_state else "noinit",
                 _SHORT[self.dtype]]
        if (self.batch, self.heads) != (2, 2):
            parts.append(f"B{self.batch}H{self.heads}")
        return "-".join(parts)

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def num_chunks(self) -> int:
        return -(-self.tokens // self.chunk_size)

    def replace(self, **changes) -> "Case":
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:          # pytest ids
        return self.id


def case_id(case) -> str:
    return case.id


def seed_of(*parts) -> int:
    """A stable seed from anything printable (a case id, a test name)."""
    return zlib.crc32("/".join(str(p) for p in parts).encode())


# ---------------------------------------------------------------------------------------------
# Segment ids

def random_segment_ids(rng, batch: int, tokens: int, chunk_size: int) -> np.ndarray:
    """[B, T] int32 ids with several segments per row, packed differently in each row: always one
    segment starting exactly on a chunk boundary (when T > chunk_size) and one of length 1, and in
    odd rows an id that repeats non-adjacently (ids define runs, not identity across runs)."""
    rows = []
    for b in range(batch):
        starts = {0}
        if tokens > chunk_size:
            starts.add(chunk_size)                          # starts exactly on a chunk boundary
        if tokens > 2:
            single = int(rng.integers(1, tokens - 1))
            starts.update({single, single + 1})             # a segment of length 1
        if tokens > 1:
            starts.update(int(x) for x in rng.integers(1, tokens, size=2 + b))
        boundaries = np.zeros(tokens, np.int32)
        boundaries[sorted(s for s in starts if s < tokens)] = 1
        ids = np.cumsum(boundaries) - 1
        rows.append(np.where(ids % 3 == 2, 0, ids) if b % 2 else ids)
    return np.stack(rows).astype(np.int32)


def run_numbers(segment_ids, batch: int, tokens: int) -> np.ndarray:
    """[B, T] run numbers in numpy (a new run wherever the id changes); zeros without ids."""
    if segment_ids is None:
        return np.zeros((batch, tokens), np.int64)
    ids = np.asarray(segment_ids)
    changes = np.concatenate([np.zeros((batch, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    return np.cumsum(changes, axis=1)


# ---------------------------------------------------------------------------------------------
# Problems

@dataclasses.dataclass(frozen=True, eq=False)
class Problem:
    """Inputs of one case and the float64 recurrence over them.

    Full-op inputs: q, k, v (case dtype), g_raw [B, T, H] natural-log gates, beta, initial_state
    (float32, or None), segment_ids (int32, or None).
    chunk_o inputs: q, k, v_new and h (case dtype), g (float32 chunk-local log2 decays, or None).
    ref: the recurrence's o, h, v_new, g and final_state (float64 numpy).
    raw: the full-op inputs as float64 numpy (what the reference saw), None where absent.
    """
    case: Case
    q: jax.Array
    k: jax.Array
    v: jax.Array
    g_raw: Optional[jax.Array]
    beta: jax.Array
    initial_state: Optional[jax.Array]
    segment_ids: Optional[jax.Array]
    v_new: jax.Array
    h: jax.Array
    g: Optional[jax.Array]
    ref: Mapping[str, np.ndarray]
    raw: Mapping[str, Optional[np.ndarray]]

    @property
    def runs(self):
        """[B, T] int32 run numbers (the kernels' segment input), or None."""
        return None if self.segment_ids is None else segment_runs(self.segment_ids)

    @property
    def scale(self) -> float:
        return self.case.key_dim ** -0.5

    def chunk_o_args(self):
        """(q, k, v_new, h, g): the positional arguments of chunk_gdp_fwd_o."""
        return self.q, self.k, self.v_new, self.h, self.g

    def full_args(self):
        """(q, k, v, g_raw, beta): the positional arguments of chunk_gated_delta_product."""
        return self.q, self.k, self.v, self.g_raw, self.beta


def recurrence64(q, k, v, g_raw, beta, *, initial_state=None, segment_ids=None,
                 chunk_size: int) -> dict:
    """SPEC's recurrence in numpy float64, token by token: o, h, v_new, g and final_state as
    ``gdp_jax.reference.recurrence`` returns them (there: ``RecurrenceOutputs``).

    The forward references of the tests: a second statement of the recurrence, independent of the
    library's (a ``lax.scan`` that autodiff goes through for the gradient references), and free of
    XLA compiles, which cost the CPU suite a compile per shape. test_full_op.py checks the two
    against each other.
    """
    q, k, v, beta = (np.asarray(x, np.float64) for x in (q, k, v, beta))
    b, t, hd, kd = q.shape
    m = k.shape[1] // t
    vd = v.shape[-1]
    g_raw = np.zeros((b, t, hd)) if g_raw is None else np.asarray(g_raw, np.float64)
    state = (np.zeros((b, hd, kd, vd)) if initial_state is None
             else np.array(initial_state, np.float64))
    if segment_ids is None:
        starts = np.zeros((b, t), bool)
    else:
        ids = np.asarray(segment_ids)
        starts = np.concatenate([np.zeros((b, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    num_chunks = -(-t // chunk_size)
    o, v_new = np.zeros((b, t, hd, vd)), np.zeros((b, t * m, hd, vd))
    h = np.zeros((b, num_chunks, hd, kd, vd))
    scale = kd ** -0.5
    for i in range(t):
        state[starts[:, i]] = 0.0                          # a segment carries nothing in
        if i % chunk_size == 0:
            h[:, i // chunk_size] = state                  # the state before the chunk's first token
        state *= np.exp(g_raw[:, i])[..., None, None]      # the gate, once per token
        for j in range(i * m, (i + 1) * m):                # M Householder steps
            step = beta[:, j, :, None] * (v[:, j] - (k[:, j, :, None, :] @ state)[:, :, 0])
            state += k[:, j, :, :, None] * step[:, :, None, :]
            v_new[:, j] = step
        o[:, i] = scale * (q[:, i, :, None, :] @ state)[:, :, 0]
    pad = num_chunks * chunk_size - t
    chunks = np.pad(g_raw, ((0, 0), (0, pad), (0, 0))).reshape(b, num_chunks, chunk_size, hd)
    g = (np.cumsum(chunks, axis=2) / np.log(2.0)).reshape(b, -1, hd)[:, :t]
    return dict(o=o, h=h, v_new=v_new, g=g, final_state=state)


def stress_problem(tokens: int, heads: int, key_dim: int, value_dim: int, m: int, *,
                   chunk_size: int = 64, dtype="bfloat16", seed: int = 0):
    """One row where the recurrence is hardest to follow: unit keys with beta in (1.9, 2) (every
    step close to a reflection, which keeps the state's norm), and gates in runs of 50 tokens,
    either close to 0 (-1e-3..0: memory over thousands of tokens) or strongly negative (-8..-2:
    chunk-local decay sums far below float32's exponent range). Returns (inputs, ref): the op's
    arguments (q, k, v in ``dtype``, g_raw and beta float32) and recurrence64 of exactly those."""
    rng = np.random.default_rng(seed)
    rounded = lambda x: np.asarray(jnp.asarray(x, dtype), np.float64)
    f32 = lambda x: np.asarray(x, np.float32).astype(np.float64)
    q = rounded(rng.normal(size=(1, tokens, heads, key_dim)))
    k = rng.normal(size=(1, tokens * m, heads, key_dim))
    k = rounded(k / np.linalg.norm(k, axis=-1, keepdims=True))
    v = rounded(rng.normal(size=(1, tokens * m, heads, value_dim)))
    beta = f32(rng.uniform(1.9, 1.999, size=(1, tokens * m, heads)))
    near_zero = np.repeat(rng.random(-(-tokens // 50)) < 0.5, 50)[:tokens][None, :, None]
    g_raw = f32(np.where(near_zero, -rng.uniform(0.0, 1e-3, (1, tokens, heads)),
                         -rng.uniform(2.0, 8.0, (1, tokens, heads))))
    ref = recurrence64(q, k, v, g_raw, beta, chunk_size=chunk_size)
    inputs = (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
              jnp.asarray(g_raw, jnp.float32), jnp.asarray(beta, jnp.float32))
    return inputs, ref


def _l2norm64(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


@functools.lru_cache(maxsize=None)
def _build(case: Case, seed: int, segment_ids: Optional[bytes], qk_l2norm: bool) -> Problem:
    rng = np.random.default_rng(seed)
    b, t, hd, kd, vd, m = case.batch, case.tokens, case.heads, case.key_dim, case.value_dim, case.m
    dtype = case.jnp_dtype
    rounded = lambda x: np.asarray(jnp.asarray(x, dtype), np.float64)   # what the op will see
    q = rng.normal(size=(b, t, hd, kd))
    k = rng.normal(size=(b, t * m, hd, kd))
    if qk_l2norm:         # raw q, k of varied norms; the reference sees them normalised
        q *= rng.uniform(0.5, 3.0, size=(b, t, hd, 1))
        k *= rng.uniform(0.5, 3.0, size=(b, t * m, hd, 1))
    else:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q, k = rounded(q), rounded(k)
    v = rounded(rng.normal(size=(b, t * m, hd, vd)))
    beta = rng.uniform(0.05, 1.95, size=(b, t * m, hd)).astype(np.float32).astype(np.float64)
    g_raw = (-rng.uniform(0.0, 0.25, size=(b, t, hd))).astype(np.float32).astype(np.float64) \
        if case.gated else None
    state0 = (0.5 * rng.normal(size=(b, hd, kd, vd))).astype(np.float32).astype(np.float64) \
        if case.initial_state else None
    if segment_ids is not None:
        seg = np.frombuffer(segment_ids, np.int32).reshape(b, t)
    else:
        seg = random_segment_ids(rng, b, t, case.chunk_size) if case.segments else None
    q_ref, k_ref = (_l2norm64(q), _l2norm64(k)) if qk_l2norm else (q, k)
    ref = recurrence64(q_ref, k_ref, v, g_raw, beta, initial_state=state0, segment_ids=seg,
                       chunk_size=case.chunk_size)
    f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
    return Problem(
        case=case, q=jnp.asarray(q, dtype), k=jnp.asarray(k, dtype), v=jnp.asarray(v, dtype),
        g_raw=f32(g_raw), beta=f32(beta), initial_state=f32(state0),
        segment_ids=None if seg is None else jnp.asarray(seg, jnp.int32),
        v_new=jnp.asarray(ref["v_new"], dtype), h=jnp.asarray(ref["h"], dtype),
        g=f32(ref["g"]) if case.gated else None, ref=ref,
        raw=dict(q=q, k=k, v=v, g_raw=g_raw, beta=beta, initial_state=state0, segment_ids=seg))


def build(case: Case, *, seed: Optional[int] = None, segment_ids=None,
          qk_l2norm: bool = False) -> Problem:
    """The problem of ``case`` (cached per process).

    ``segment_ids`` ([B, T] ints) replaces the random packing (the case must have segments=True);
    ``qk_l2norm`` gives raw q, k of varied norms and a reference on their L2-normalised values.
    """
    ids = None
    if segment_ids is not None:
        assert case.segments, case
        ids = np.ascontiguousarray(segment_ids, np.int32)
        assert ids.shape == (case.batch, case.tokens), ids.shape
        ids = ids.tobytes()
    return _build(case, seed_of(case.id) if seed is None else seed, ids, qk_l2norm)


# ---------------------------------------------------------------------------------------------
# Errors and assertions

def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; NaN never passes, and a zero reference is refused (so a
    test whose reference vanished cannot pass)."""
    out, ref = to64(out), to64(ref)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.isfinite(out).all(), "NaN or inf in output"
    norm = np.linalg.norm(ref)
    assert norm > 0, "reference is zero"
    return float(np.linalg.norm(out - ref) / norm)


def assert_close(out, ref, tol: float, name: str = "") -> None:
    err = rel_err(out, ref)
    assert err < tol, f"{name}: relative error {err:.3g} >= {tol}"


def assert_all_close(got: Mapping, want: Mapping, tol: float) -> None:
    """Per-name relative error of two dicts of arrays; a None must meet a None."""
    assert set(got) == set(want), (sorted(got), sorted(want))
    errors = {}
    for name in got:
        if want[name] is None or got[name] is None:
            assert got[name] is None and want[name] is None, name
            continue
        errors[name] = rel_err(got[name], want[name])
    bad = {name: err for name, err in errors.items() if not err < tol}
    assert not bad, f"relative errors over {tol}: {bad} (all: {errors})"


def cotangent(shape, seed, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


# ---------------------------------------------------------------------------------------------
# Float64 references for gradients

GRAD_NAMES = ("q", "k", "v", "g_raw", "beta", "initial_state")     # the full op's primals


@functools.lru_cache(maxsize=None)
def _recurrence_grads(problem: Problem, seed: int, qk_l2norm: bool):
    case = problem.case
    rng = np.random.default_rng(seed)
    do = rng.normal(size=problem.ref["o"].shape)
    dfinal = rng.normal(size=problem.ref["final_state"].shape)
    names = [n for n in GRAD_NAMES if problem.raw[n] is not None]
    seg = problem.raw["segment_ids"]
    with jax.enable_x64(True):
        def loss(*args):
            a = dict(zip(names, args))
            q, k = a["q"], a["k"]
            if qk_l2norm:
                norm = lambda x: x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)
                q, k = norm(q), norm(k)
            out = reference.recurrence(q, k, a["v"], a.get("g_raw"), a["beta"],
                                       initial_state=a.get("initial_state"), segment_ids=seg,
                                       chunk_size=case.chunk_size, dtype=jnp.float64)
            return jnp.sum(out.o * do) + jnp.sum(out.final_state * dfinal)

        grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(names)))))(
            *[jnp.asarray(problem.raw[n], jnp.float64) for n in names])
        grads = {n: np.asarray(x) for n, x in zip(names, grads)}
    return do, dfinal, {n: grads.get(n) for n in GRAD_NAMES}


def recurrence_grads(problem: Problem, seed: int = 0, qk_l2norm: bool = False):
    """(do, dfinal, grads): float64 cotangents of o and the final state, and float64 autodiff of
    sum(o * do) + sum(final_state * dfinal) through the recurrence in every full-op primal
    (a dict over GRAD_NAMES, None where the problem has none)."""
    return _recurrence_grads(problem, seed, qk_l2norm)


def dense_chunked_form(q, k, v, h, g, runs, *, scale, chunk_size):
    """SPEC's chunked form with one [T, T*M] weight matrix per row and head, no chunk reshapes.

    Weight of key position j (token s = j // M) for query t: nonzero iff s and t share a chunk,
    s <= t and s, t are in one segment; then 2^(g[t] - g[s]). The state term of t uses
    h[t // chunk_size], weighted by 2^g[t] iff t is in the segment live at its chunk's first token.
    ``runs``: [B, T] segment run numbers (``run_numbers``; not raw ids, which may repeat), or None.
    """
    batch, tokens, heads, _ = q.shape
    m = k.shape[1] // tokens
    token = np.arange(tokens)
    source = np.arange(tokens * m) // m                              # token of each key position
    chunk_of = token // chunk_size
    run = jnp.zeros((batch, tokens), jnp.int32) if runs is None else jnp.asarray(runs)
    causal = (chunk_of[:, None] == chunk_of[source][None, :]) & (source[None, :] <= token[:, None])
    mask = jnp.asarray(causal)[None] & (run[:, :, None] == run[:, source][:, None, :])  # [B, T, T*M]
    live = run == run[:, chunk_of * chunk_size]                                  # [B, T]
    mask = mask[:, None]                                                         # [B, 1, T, T*M]

    gt = jnp.zeros((batch, heads, tokens), q.dtype) if g is None else jnp.moveaxis(g, 1, 2)
    exponent = jnp.where(mask, gt[..., :, None] - gt[..., source][..., None, :], 0.0)
    weight = jnp.where(mask, jnp.exp2(exponent), 0.0)                           # [B, H, T, T*M]
    hi = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("bthk,bjhk->bhtj", q, k, precision=hi)
    intra = jnp.einsum("bhtj,bjhv->bthv", scores * weight, v, precision=hi)
    state = jnp.einsum("bthk,bthkv->bthv", q, h[:, chunk_of], precision=hi)
    state_weight = live[:, :, None] * jnp.exp2(jnp.moveaxis(gt, 1, 2))          # [B, T, H]
    return scale * (intra + state_weight[..., None] * state)


def to64(x):
    """Any array (bfloat16 included) as float64 numpy; None passes."""
    return None if x is None else np.asarray(x).astype(np.float64)


CHUNK_O_NAMES = ("q", "k", "v", "h", "g")


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size"))
def _dense_vjp(primals, runs, do, *, scale, chunk_size):
    """One compilation per shape (and g present or not), shared by every test of that shape."""
    fn = lambda q, k, v, h, g=None: dense_chunked_form(q, k, v, h, g, runs, scale=scale,
                                                       chunk_size=chunk_size)
    o, vjp = jax.vjp(fn, *primals)
    return o, vjp(do)


def dense_chunked_grads(q, k, v, h, g, segment_ids, do, *, scale, chunk_size):
    """float64 autodiff of ``dense_chunked_form`` at the given (rounded) values: (o, a dict over
    CHUNK_O_NAMES), g's entry None without g. ``segment_ids``: ids or run numbers, or None."""
    batch, tokens = q.shape[:2]
    runs = run_numbers(None if segment_ids is None else np.asarray(segment_ids), batch, tokens)
    with jax.enable_x64(True):
        primals = tuple(jnp.asarray(to64(x)) for x in (q, k, v, h) + (() if g is None else (g,)))
        o, grads = _dense_vjp(primals, jnp.asarray(runs, jnp.int32), jnp.asarray(to64(do)),
                              scale=float(scale), chunk_size=chunk_size)
        grads = [np.asarray(x) for x in grads] + [None] * (5 - len(grads))
    return np.asarray(o), dict(zip(CHUNK_O_NAMES, grads))


# ---------------------------------------------------------------------------------------------
# Jitted entry points, one compilation per static configuration (eager jnp is slow on CPU)

@functools.lru_cache(maxsize=None)
def _jit(fn, kwargs):
    return jax.jit(functools.partial(fn, **dict(kwargs)))


def chunk_o_fn(implementation, chunk_size: int, **kwargs):
    """jit(chunk_gdp_fwd_o) with static options; called as f(q, k, v, h, g, segment_ids=...)."""
    import gdp_jax
    return _jit(gdp_jax.chunk_gdp_fwd_o,
                tuple(sorted(dict(kwargs, chunk_size=chunk_size,
                                  implementation=implementation).items())))


def run_chunk_o(p: Problem, implementation, **kwargs):
    return chunk_o_fn(implementation, p.case.chunk_size, **kwargs)(
        *p.chunk_o_args(), segment_ids=p.segment_ids)


def full_op_fn(implementation, chunk_size: int, **kwargs):
    """jit(chunk_gated_delta_product) with output_final_state=True and static options."""
    import gdp_jax
    return _jit(gdp_jax.chunk_gated_delta_product,
                tuple(sorted(dict(dict(output_final_state=True), **kwargs, chunk_size=chunk_size,
                                  implementation=implementation).items())))


def run_full_op(p: Problem, implementation, **kwargs):
    """(o, final_state) of the full op on the problem's inputs."""
    return full_op_fn(implementation, p.case.chunk_size, **kwargs)(
        *p.full_args(), initial_state=p.initial_state, segment_ids=p.segment_ids)


def l2norm_op_of_qk(p: Problem, implementation):
    """op(q, k) -> (o, final_state): the full op with use_qk_l2norm on the problem's other inputs,
    segment ids and chunk size, q and k its only arguments (to differentiate or not)."""
    import gdp_jax

    def op(q, k):
        return gdp_jax.chunk_gated_delta_product(
            q, k, p.v, p.g_raw, p.beta, initial_state=p.initial_state,
            segment_ids=p.segment_ids, output_final_state=True, use_qk_l2norm=True,
            chunk_size=p.case.chunk_size, implementation=implementation)
    return op


def randomize_biases(module, seed: int = 0) -> None:
    """Give a Flax NNX module's biases N(0, 0.3) values: nnx inits them to zero, where a test
    comparing layers could not see them."""
    from flax import nnx
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        if path[-1] == "bias":
            var.set_value(jnp.asarray(rng.normal(0, 0.3, var.get_value().shape), jnp.float32))
