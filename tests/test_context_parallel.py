"""Context parallelism (gdp_jax.context_parallel): the ops with T sharded over a mesh axis equal the
unsharded ops, values and gradients, and no collective of the compiled programs moves anything of
size O(T).

The multi-device checks need 4 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4
before jax initialises), so they run in a subprocess: this file run as a script
(``python tests/test_context_parallel.py``), which asserts and exits non-zero on failure. Checks
that need one device (argument errors, the two-call local pass, a one-device token mesh) run
in-process; the GPU test runs the Pallas path on a one-device token mesh.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if __name__ == "__main__":  # the subprocess: make gdp_jax and tests/cases.py importable without install
    sys.path[:0] = [ROOT, HERE]

import gdp_jax  # noqa: E402
from gdp_jax import context_parallel  # noqa: E402
from gdp_jax.sharding import sharded_chunk_gated_delta_product, sharded_chunk_gdp_fwd_o  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta", "initial_state")          # the full op's differentiable inputs
COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute",
               "collective-broadcast", "ragged-all-to-all")
TOL = 1e-4                                                      # float32, relative (brief)

# T = 256 in blocks of 64 (4 devices) or 128 (2 devices), chunk_size 16. Row 0: a segment starts
# exactly on the edge at 64, one at a chunk boundary inside block 0 (48), a length-1 segment, and the
# last segment crosses the edges at 128 and 192 (a whole block with no reset). Row 1: the first
# segment carries initial_state across the edge at 64, one starts exactly at 128, one at a chunk
# boundary inside block 2 (160), and the last crosses 192.
SEGMENT_STARTS = ({0, 48, 64, 100, 101}, {0, 90, 91, 128, 160, 203})


def _segment_ids(tokens, starts_per_row):
    rows = []
    for r, starts in enumerate(starts_per_row):
        mark = np.zeros(tokens, np.int32)
        mark[sorted(s for s in starts if s < tokens)] = 1
        ids = np.cumsum(mark) - 1
        rows.append(np.where(ids % 3 == 2, 0, ids) if r % 2 else ids)  # ids may repeat non-adjacently
    return np.stack(rows).astype(np.int32)


def _problem(*, batch=2, tokens=256, heads=2, key_dim=8, value_dim=12, m=2, chunk_size=16,
             gated=True, segments=SEGMENT_STARTS, initial_state=True, seed=5, dtype=jnp.float32):
    """Random full-op inputs. K = 8, V = 12 (K + V = 20) keep every state-sized dimension distinct
    from the T-sized ones (64, 128, 256, 512), which the HLO check relies on."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(batch, tokens * m, heads, key_dim))
    cast = lambda x: jnp.asarray(x, dtype)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return dict(
        q=cast(rng.normal(size=(batch, tokens, heads, key_dim))),
        k=cast(k / np.linalg.norm(k, axis=-1, keepdims=True)),
        v=cast(rng.normal(size=(batch, tokens * m, heads, value_dim))),
        g=f32(-rng.uniform(0.0, 0.25, size=(batch, tokens, heads))) if gated else None,
        beta=f32(rng.uniform(0.05, 1.95, size=(batch, tokens * m, heads))),
        initial_state=(f32(0.5 * rng.normal(size=(batch, heads, key_dim, value_dim)))
                       if initial_state else None),
        segment_ids=(None if segments is None
                     else jnp.asarray(_segment_ids(tokens, [segments[r % len(segments)]
                                                            for r in range(batch)]))),
        chunk_size=chunk_size, m=m)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all()
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# ---------------------------------------------------------------------------------------------
# HLO: every collective's operands and results

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")


def _shapes(text):
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _SHAPE.findall(text)]


def collectives(hlo: str):
    """[(op, result shapes, operand shapes)] for every collective instruction of a compiled HLO
    module; operand shapes are looked up from their defining instructions."""
    defined, found = {}, []
    for line in hlo.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            defined[match.group(1)] = _shapes(match.group(2))
    for line in hlo.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        op = match.group(3)
        if not any(op == c or op == c + "-start" for c in COLLECTIVES):
            continue
        args = match.group(4).split(")")[0]
        operands = []
        for arg in (a.strip() for a in args.split(",") if a.strip()):
            inline = _shapes(arg)
            operands += inline if inline else defined.get(arg.split()[-1].lstrip("%"), [("?", ())])
        found.append((op, _shapes(match.group(2)), operands))
    return found


def assert_state_sized(hlo: str, *, bound: int, token_sizes, what: str):
    """Every collective's operands and results have at most ``bound`` elements and no dimension in
    ``token_sizes`` (the sizes of T, T*M and their per-device blocks). Returns the collectives."""
    found = collectives(hlo)
    for op, results, operands in found:
        for dtype, shape in results + operands:
            assert dtype != "?", (what, op, results, operands)
            assert int(np.prod(shape)) <= bound, f"{what}: {op} moves {dtype}{list(shape)} > {bound}"
            assert not set(shape) & set(token_sizes), (
                f"{what}: {op} moves {dtype}{list(shape)}, a dimension of size O(T)")
    return found


def _describe(found):
    return "; ".join(f"{op} {[f'{d}{list(s)}' for d, s in operands]} -> "
                     f"{[f'{d}{list(s)}' for d, s in results]}" for op, results, operands in found)


# ---------------------------------------------------------------------------------------------
# The checks (run in the 4-device subprocess)

def _full_loss(fn):
    def loss(*a):
        o, state = fn(*a)
        total = jnp.sum(jnp.square(o.astype(jnp.float32)))
        return total if state is None else total + jnp.sum(jnp.square(state))
    return loss


def _reference(p, kw, grad):
    """The unsharded op's (o, final_state) and gradients, cached per problem and keywords."""
    cache = p.setdefault("_ref", {})
    wrt = [i for i, n in enumerate(NAMES) if p[n] is not None]
    args = [p[n] for n in NAMES]

    def plain(kw):
        return lambda *a: gdp_jax.chunk_gated_delta_product(
            *a[:5], segment_ids=p["segment_ids"], initial_state=a[5], **kw)
    # The forward once per problem and implementation (with the final state); gradients per kw.
    base = {**kw, "output_final_state": True}
    key = tuple(sorted(base.items()))
    if key not in cache:
        cache[key] = jax.jit(plain(base))(*args)
    o, state = cache[key]
    grads = None
    if grad:
        key = (tuple(sorted(kw.items())), "grad")
        if key not in cache:
            cache[key] = jax.jit(jax.grad(_full_loss(plain(kw)), argnums=wrt))(*args)
        grads = cache[key]
    return (o, state if kw["output_final_state"] else None), grads


def check_full(p, mesh, *, batch_axis=None, head_axis=None, token_axis="seq", grad=True,
               tol=TOL, reference_implementation=None, **op_kwargs):
    """Context-parallel full op == unsharded (o, final_state, gradients of every input); every
    collective of the compiled forward and backward programs is state-sized. The unsharded op runs
    ``reference_implementation`` (default: the same implementation). Returns a summary."""
    kw = dict(chunk_size=p["chunk_size"], implementation="xla", output_final_state=True)
    kw.update(op_kwargs)
    ref_kw = dict(kw, implementation=reference_implementation or kw["implementation"])
    tok = token_axis
    specs = dict(q=P(batch_axis, tok, head_axis, None), k=P(batch_axis, tok, head_axis, None),
                 v=P(batch_axis, tok, head_axis, None), g=P(batch_axis, tok, head_axis),
                 beta=P(batch_axis, tok, head_axis), initial_state=P(batch_axis, head_axis, None, None),
                 segment_ids=P(batch_axis, tok))
    put = lambda n: None if p[n] is None else jax.device_put(p[n], NamedSharding(mesh, specs[n]))
    args, seg = [put(n) for n in NAMES], put("segment_ids")
    present = [i for i, x in enumerate(args) if x is not None]

    def sharded(*a):
        full = [None] * len(NAMES)
        for i, x in zip(present, a):
            full[i] = x
        return sharded_chunk_gated_delta_product(
            *full[:5], segment_ids=seg, initial_state=full[5], mesh=mesh, batch_axis=batch_axis,
            head_axis=head_axis, token_axis=token_axis, **kw)

    live = [args[i] for i in present]
    (o_ref, state_ref), grads_ref = _reference(p, ref_kw, grad)
    names = lambda axis: () if axis is None else ((axis,) if isinstance(axis, str) else tuple(axis))
    shards = lambda axis: int(np.prod([mesh.shape[n] for n in names(axis)]))
    n_tok = shards(token_axis)
    batch, tokens, heads, key_dim = p["q"].shape
    value_dim, m = p["v"].shape[-1], p["m"]
    local_rows = batch // shards(batch_axis) * heads // shards(head_axis)
    bound = n_tok * local_rows * key_dim * (key_dim + value_dim)   # all [S0 | A] of the token axis
    token_sizes = {tokens, tokens * m, tokens // n_tok, tokens * m // n_tok}

    fwd = jax.jit(sharded).lower(*live).compile()
    report = {"forward": _describe(assert_state_sized(fwd.as_text(), bound=bound,
                                                      token_sizes=token_sizes, what="forward"))}
    o, state = fwd(*live)
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
    assert o.sharding.is_equivalent_to(NamedSharding(mesh, P(batch_axis, tok, head_axis, None)), 4)
    err = _rel(o, o_ref)
    assert err < tol, f"o differs from unsharded by {err}"
    if kw["output_final_state"]:
        assert state.shape == state_ref.shape and state.dtype == state_ref.dtype
        assert state.sharding.is_equivalent_to(NamedSharding(mesh, specs["initial_state"]), 4)
        err = _rel(state, state_ref)
        assert err < tol, f"final_state differs from unsharded by {err}"
    else:
        assert state is None and state_ref is None
    if not grad:
        return report
    grad_fn = jax.jit(jax.grad(_full_loss(sharded), argnums=tuple(range(len(live)))))
    grad_fn = grad_fn.lower(*live).compile()
    report["backward"] = _describe(assert_state_sized(grad_fn.as_text(), bound=bound,
                                                      token_sizes=token_sizes, what="backward"))
    for i, d, d_ref in zip(present, grad_fn(*live), grads_ref):
        name, x = NAMES[i], args[i]
        assert d.shape == d_ref.shape and d.dtype == d_ref.dtype, name
        assert d.sharding.is_equivalent_to(x.sharding, x.ndim), (name, d.sharding, x.sharding)
        err = _rel(d, d_ref)
        assert err < tol, f"d{name} differs from unsharded by {err}"
    return report


def check_fwd_o(mesh, batch_axis, token_axis):
    """sharded_chunk_gdp_fwd_o over a token axis == unsharded, values and gradients in q, k, v,
    h, g; no collective at all, forward or backward."""
    # chunk_o's inputs from the float64 recurrence (SPEC's identity: its own h, v_new and g
    # reproduce its o), on T = 128 in blocks of 64 with segments touching and crossing the edge.
    raw = _problem(tokens=128, segments=({0, 32, 50, 51}, {0, 20, 64, 96, 100}), seed=3)
    f64 = lambda x: None if x is None else np.asarray(x, np.float64)
    ref = gdp_jax.reference.recurrence(
        *(f64(raw[n]) for n in ("q", "k", "v", "g", "beta")), initial_state=f64(raw["initial_state"]),
        segment_ids=np.asarray(raw["segment_ids"]), chunk_size=16, dtype=jnp.float64)
    f32 = lambda x: jnp.asarray(np.asarray(x), jnp.float32)
    p = dict(q=raw["q"], k=raw["k"], v=f32(ref.v_new), h=f32(ref.h), g=f32(ref.g),
             segment_ids=raw["segment_ids"], o_ref=np.asarray(ref.o))
    names = ("q", "k", "v", "h", "g")
    specs = dict(q=P(batch_axis, token_axis, None, None), k=P(batch_axis, token_axis, None, None),
                 v=P(batch_axis, token_axis, None, None),
                 h=P(batch_axis, token_axis, None, None, None), g=P(batch_axis, token_axis, None))
    args = [jax.device_put(p[n], NamedSharding(mesh, specs[n])) for n in names]
    seg = jax.device_put(p["segment_ids"], NamedSharding(mesh, P(batch_axis, token_axis)))
    kw = dict(chunk_size=16, implementation="xla")
    sharded = lambda *a: sharded_chunk_gdp_fwd_o(*a, segment_ids=seg, mesh=mesh, batch_axis=batch_axis,
                                                 token_axis=token_axis, **kw)
    plain = lambda *a: gdp_jax.chunk_gdp_fwd_o(*a, segment_ids=p["segment_ids"], **kw)
    loss = lambda fn: lambda *a: jnp.sum(jnp.square(fn(*a)))
    fwd = jax.jit(sharded).lower(*args).compile()
    assert not collectives(fwd.as_text()), collectives(fwd.as_text())
    o = fwd(*args)
    assert o.sharding.is_equivalent_to(NamedSharding(mesh, P(batch_axis, token_axis, None, None)), 4)
    plain_args = [p[n] for n in names]
    assert _rel(o, jax.jit(plain)(*plain_args)) < TOL
    assert _rel(o, p["o_ref"]) < TOL                       # and the float64 recurrence
    grad_fn = jax.jit(jax.grad(loss(sharded), argnums=tuple(range(5)))).lower(*args).compile()
    assert not collectives(grad_fn.as_text()), collectives(grad_fn.as_text())
    grads_ref = jax.jit(jax.grad(loss(plain), argnums=tuple(range(5))))(*plain_args)
    for name, d, d_ref, x in zip(names, grad_fn(*args), grads_ref, args):
        assert d.sharding.is_equivalent_to(x.sharding, x.ndim), name
        err = _rel(d, d_ref)
        assert err < TOL, f"d{name} differs from unsharded by {err}"


def worker() -> None:
    """Runs in the 4-device subprocess; raises (non-zero exit) on any failure."""
    assert jax.device_count() == 4, jax.devices()
    start = time.perf_counter()
    devices = np.array(jax.devices())
    seq = Mesh(devices, ("seq",))
    grid = Mesh(devices.reshape(2, 2), ("data", "seq"))
    p = _problem()
    bare = _problem(gated=False, segments=None, initial_state=False, seed=6)
    cases = [
        ("(4,) seq: gate, segments, initial state", p, seq, dict()),
        ("(2,2) data x seq: no gate, segments or initial state; l2norm", bare, grid,
         dict(batch_axis="data", use_qk_l2norm=True)),
        ("(2,2) heads x seq, forward", p, grid, dict(head_axis="data", grad=False)),
        ("(2,2) token_axis=('data', 'seq'), no final state", p, grid,
         dict(token_axis=("data", "seq"), grad=False, output_final_state=False)),
    ]
    for label, problem, mesh, kw in cases:
        t0, c0 = time.perf_counter(), time.process_time()
        report = check_full(problem, mesh, **kw)
        print(f"ok {label} {time.perf_counter() - t0:.1f}s (cpu {time.process_time() - c0:.1f}s)",
              flush=True)
        for program, text in report.items():
            print(f"   {program} collectives: {text}", flush=True)

    # The Pallas kernels (WY, walk, output, and the stages' custom_vjp) in the interpreter, against
    # the unsharded jnp path's numbers (computed above).
    t0, c0 = time.perf_counter(), time.process_time()
    check_full(p, seq, implementation="interpret", reference_implementation="xla")
    print(f"ok (4,) seq interpret, gradients {time.perf_counter() - t0:.1f}s "
          f"(cpu {time.process_time() - c0:.1f}s)", flush=True)

    t0 = time.perf_counter()
    check_fwd_o(grid, "data", "seq")
    print(f"ok chunk_gdp_fwd_o (2,2) data x seq, no collectives {time.perf_counter() - t0:.1f}s",
          flush=True)
    print(f"all context-parallel checks passed in {time.perf_counter() - start:.1f}s", flush=True)


# ---------------------------------------------------------------------------------------------
# pytest side

def test_context_parallel_on_4_cpu_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE] + [x for x in [env.get("PYTHONPATH")] if x])
    result = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    if result.returncode:
        pytest.fail(f"4-device context-parallel checks failed (exit {result.returncode}):\n"
                    f"{result.stdout}\n{result.stderr[-6000:]}")
    assert "all context-parallel checks passed" in result.stdout, result.stdout


def _one_device_token_mesh():
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "seq"))


def test_argument_errors():
    p = _problem(tokens=40, segments=None)
    args = [p[n] for n in ("q", "k", "v", "g", "beta")]
    mesh = _one_device_token_mesh()
    with pytest.raises(ValueError, match=r"T = 40 must be a multiple of chunk_size \* \(shards of "
                                         r"token_axis='seq'\) = 16 \* 1 = 16"):
        sharded_chunk_gated_delta_product(*args, mesh=mesh, token_axis="seq", chunk_size=16)
    with pytest.raises(ValueError, match=r"T = 40 must be a multiple of chunk_size"):
        sharded_chunk_gdp_fwd_o(p["q"], p["k"], p["v"], jnp.zeros((2, 3, 2, 8, 12)), mesh=mesh,
                                token_axis="seq", chunk_size=16)
    with pytest.raises(ValueError, match=r"named in both batch_axis='seq' and token_axis='seq'"):
        sharded_chunk_gated_delta_product(*args, mesh=mesh, batch_axis="seq", token_axis="seq",
                                          chunk_size=8)
    with pytest.raises(ValueError, match=r"named in both head_axis=.* and token_axis="):
        sharded_chunk_gated_delta_product(*args, mesh=mesh, batch_axis=None, head_axis="seq",
                                          token_axis=("data", "seq"), chunk_size=8)
    with pytest.raises(ValueError, match="token_axis='tokens': mesh has no axis 'tokens'"):
        sharded_chunk_gated_delta_product(*args, mesh=mesh, token_axis="tokens", chunk_size=8)
    with pytest.raises(TypeError, match="token_axis must be a mesh axis name"):
        sharded_chunk_gated_delta_product(*args, mesh=mesh, token_axis=3, chunk_size=8)


def test_one_device_token_mesh_matches_op():
    """A token axis of one device: the context-parallel path (exchange of one block) on CPU."""
    p = _problem(tokens=64)
    args = [p[n] for n in ("q", "k", "v", "g", "beta")]
    kw = dict(segment_ids=p["segment_ids"], initial_state=p["initial_state"],
              output_final_state=True, chunk_size=16, implementation="xla")
    op = jax.jit(lambda *a: gdp_jax.chunk_gated_delta_product(*a, **kw))
    sharded = jax.jit(lambda *a: sharded_chunk_gated_delta_product(
        *a, mesh=_one_device_token_mesh(), batch_axis="data", token_axis="seq", **kw))
    for x, x_ref in zip(sharded(*args), op(*args)):
        assert _rel(x, x_ref) < TOL


def test_one_device_token_mesh_bfloat16():
    """bfloat16 inputs through the token mesh's finish (o0 + o_r S_in) on a CPU, run eagerly, where
    each dot runs as it stands and XLA's CPU dots take no 16-bit operands with a float32 result:
    o in bfloat16, within bf16 rounding of the op's."""
    p = _problem(tokens=32)
    args = [p[n].astype(jnp.bfloat16) if n in ("q", "k", "v") else p[n]
            for n in ("q", "k", "v", "g", "beta")]
    kw = dict(segment_ids=p["segment_ids"], initial_state=p["initial_state"],
              output_final_state=True, chunk_size=16, implementation="xla")
    o_ref, final_ref = jax.jit(lambda *a: gdp_jax.chunk_gated_delta_product(*a, **kw))(*args)
    o, final = sharded_chunk_gated_delta_product(
        *args, mesh=_one_device_token_mesh(), batch_axis="data", token_axis="seq", **kw)
    assert o.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    assert _rel(o, o_ref) < 2e-2 and _rel(final, final_ref) < 2e-2


def test_two_call_block_pass_equals_one():
    """The local pass as two calls ([v] from zero, [0_K] from I: the Pallas path's form when
    V + K is too wide for the kernels) equals the one extended call, values and VJP."""
    p = _problem(tokens=32, segments=({0, 5, 16},))
    from gdp_jax._src.segments import segment_runs
    runs = segment_runs(p["segment_ids"])
    args = (p["k"], p["v"], p["beta"], p["g"])

    @jax.jit
    def both(cot, *a):
        def run(split):
            return lambda *a: context_parallel.block_pass(
                *a, runs, chunk_size=16, num_householder=2, implementation="xla", split=split)
        (one, vjp_one), (two, vjp_two) = jax.vjp(run(False), *a), jax.vjp(run(True), *a)
        # The same cotangent, cut into the two calls' column groups [V | K].
        cut = lambda x: (x[..., :12], x[..., 12:])
        cot_two = context_parallel.BlockPass(cut(cot.h[0]), cut(cot.v_new[0]), cot.summary, cot.k)
        return one, two, vjp_one(cot), vjp_two(cot_two)

    shapes = jax.eval_shape(lambda *a: context_parallel.block_pass(
        *a, runs, chunk_size=16, num_householder=2, implementation="xla", split=False), *args)
    rng = np.random.default_rng(1)
    cot = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), shapes)
    one, two, d_one, d_two = both(cot, *args)
    assert len(one.h) == len(one.v_new) == 1 and len(two.h) == len(two.v_new) == 2
    whole = lambda parts: jnp.concatenate(parts, axis=-1)
    for name, x, y in [("h", whole(one.h), whole(two.h)), ("v_new", whole(one.v_new), whole(two.v_new)),
                       ("summary", one.summary, two.summary), ("k", one.k, two.k)]:
        assert x.shape == y.shape, name
        assert _rel(y, x) < 1e-5, name
    for x, y in zip(d_one, d_two):
        assert _rel(y, x) < 1e-5
    # Widths that decide it on the Pallas path: K = V = 128 fits one call (256), 256 needs two.
    assert not context_parallel.split_block_pass(128, 128, jnp.bfloat16, "pallas")
    assert context_parallel.split_block_pass(256, 256, jnp.bfloat16, "pallas")
    assert context_parallel.split_block_pass(128, 256, jnp.float32, "pallas")
    assert not context_parallel.split_block_pass(256, 256, jnp.bfloat16, "xla")


@pytest.mark.gpu
def test_one_gpu_token_mesh_matches_op():
    """On one GPU: a token_axis mesh of one device (the Pallas path's context-parallel body: the
    extended local pass, the exchange, the finish) equals the plain op, o, final state, gradients."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    for dtype, tol in [(jnp.float32, 2e-3), (jnp.bfloat16, 2e-2)]:
        p = _problem(batch=2, tokens=1024, heads=4, key_dim=128, value_dim=128, chunk_size=64,
                     segments=({0, 64, 300, 301}, {0, 500}), dtype=dtype, seed=3)
        check_full(p, mesh, implementation="pallas", tol=tol)


if __name__ == "__main__":
    worker()
