"""gdp_jax.sharding: chunk_gdp_fwd_o and the full op chunk_gated_delta_product over a mesh equal the
unsharded ops, values and gradients, and compile to programs with no all-gather.

The multi-device checks need 4 CPU devices, i.e. XLA_FLAGS=--xla_force_host_platform_device_count=4
before jax initialises. The suite shares one process, so they run in one subprocess (this file run
as a script: ``python tests/test_sharding.py``, chunk_gdp_fwd_o then the full op; ``chunk_o`` or
``full`` for one of them), which asserts and exits non-zero on failure. The checks that need one device
only (argument errors, a 1x1 mesh) run in-process. Sharding over the token axis (context
parallelism, ``token_axis``) is tested in test_context_parallel.py.
"""
from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if __name__ == "__main__":  # the subprocess: make gdp_jax and cases importable without install
    sys.path[:0] = [ROOT, HERE]

import gdp_jax  # noqa: E402
from gdp_jax.sharding import sharded_chunk_gated_delta_product, sharded_chunk_gdp_fwd_o  # noqa: E402
from cases import Case, build, random_segment_ids  # noqa: E402

NAMES = ("q", "k", "v", "h", "g")
COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute")


def _problem(batch=4, heads=2, tokens=37, key_dim=16, value_dim=16, chunk_size=16):
    """chunk_o inputs of a ragged, packed, gated problem (a dict: the sharded checks compare
    sharded with unsharded, so only the inputs matter)."""
    p = build(Case(tokens, key_dim, value_dim, 2, chunk_size, batch=batch, heads=heads))
    return dict(q=p.q, k=p.k, v=p.v_new, h=p.h, g=p.g, segment_ids=p.segment_ids,
                chunk_size=chunk_size)


def _specs(b, hd):
    return dict(q=P(b, None, hd, None), k=P(b, None, hd, None), v=P(b, None, hd, None),
                h=P(b, None, hd, None, None), g=P(b, None, hd), segment_ids=P(b, None))


def _loss(fn):
    return lambda *a: jnp.sum(jnp.square(fn(*a).astype(jnp.float32)))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all()
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _collective_lines(hlo: str):
    return [line.strip() for line in hlo.splitlines()
            if any(re.search(rf"\b{c}(-start)?\(", line) for c in COLLECTIVES)]


def check_mesh(p, mesh, batch_axis, head_axis, implementation, grad=True, tol=1e-5):
    """Sharded == unsharded (values, and gradients in q, k, v, h, g), no collective in the program."""
    kw = dict(chunk_size=p["chunk_size"], implementation=implementation)
    specs = _specs(batch_axis, head_axis)
    put = lambda name: jax.device_put(p[name], NamedSharding(mesh, specs[name]))
    args, seg = [put(n) for n in NAMES], put("segment_ids")
    plain_args = [p[n] for n in NAMES]

    sharded = lambda *a: sharded_chunk_gdp_fwd_o(*a[:5], segment_ids=a[5], mesh=mesh,
                                                 batch_axis=batch_axis, head_axis=head_axis, **kw)
    plain = lambda *a: gdp_jax.chunk_gdp_fwd_o(*a[:5], segment_ids=a[5], **kw)
    fwd = jax.jit(sharded)
    o = fwd(*args, seg)
    o_ref = jax.jit(plain)(*plain_args, p["segment_ids"])
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
    assert o.sharding.is_equivalent_to(NamedSharding(mesh, P(batch_axis, None, head_axis, None)), 4)
    err = _rel(o, o_ref)
    assert err < tol, f"forward differs from unsharded by {err}"
    # The op's own work needs no communication: no collective of any kind in the forward program.
    lines = _collective_lines(fwd.lower(*args, seg).compile().as_text())
    assert not lines, f"forward program has collectives: {lines}"
    if not grad:
        return
    wrt = tuple(range(5))
    grad_fn = jax.jit(jax.grad(_loss(sharded), argnums=wrt))
    grads = grad_fn(*args, seg)
    grads_ref = jax.jit(jax.grad(_loss(plain), argnums=wrt))(*plain_args, p["segment_ids"])
    for name, d, d_ref, x in zip(NAMES, grads, grads_ref, args):
        assert d.shape == d_ref.shape and d.dtype == d_ref.dtype, name
        assert d.sharding.is_equivalent_to(x.sharding, x.ndim), (name, d.sharding, x.sharding)
        err = _rel(d, d_ref)
        assert err < tol, f"d{name} differs from unsharded by {err}"
    # Backward: no collective either (the loss' cotangent needs none: d sum / d o is local).
    lines = _collective_lines(grad_fn.lower(*args, seg).compile().as_text())
    assert not lines, f"backward program has collectives: {lines}"


def _four_device_meshes():
    """Meshes (4,) over "data" and (2, 2) over ("data", "model") on the subprocess' 4 devices."""
    devices = np.array(jax.devices())
    return Mesh(devices, ("data",)), Mesh(devices.reshape(2, 2), ("data", "model"))


def _two_gpu_cases():
    """(mesh, batch_axis, head_axis) on 2 GPUs: B split, B split on a 2x1 grid, H split, and H
    replicated over "model" (an auto axis)."""
    devices = np.array(jax.devices()[:2])
    data = Mesh(devices, ("data",))
    grid = Mesh(devices.reshape(2, 1), ("data", "model"))
    model = Mesh(devices.reshape(1, 2), ("data", "model"))
    return [(data, "data", None), (grid, "data", "model"), (model, "data", "model"),
            (model, "data", None)]


def worker() -> None:
    """Runs in the 4-device subprocess; raises (non-zero exit) on any failure."""
    assert jax.device_count() == 4, jax.devices()
    start = time.perf_counter()
    p = _problem()
    data, grid = _four_device_meshes()
    cases = [
        (grid, "data", "model", "xla", True),
        # The Pallas kernels, interpreted, forward only: chunk_o's backward kernel under
        # shard_map runs in test_context_parallel.py's interpret gradients case.
        (grid, "data", "model", "interpret", False),
        (grid, "data", None, "xla", False),             # replicated over "model": same numbers
        (grid, ("data", "model"), None, "xla", False),  # B over both axes
        (grid, None, "model", "xla", False),            # heads only (tensor parallel)
    ]
    for mesh, b, hd, impl, grad in cases:
        t0 = time.perf_counter()
        check_mesh(p, mesh, b, hd, impl, grad=grad)
        print(f"ok mesh={dict(mesh.shape)} batch_axis={b!r} head_axis={hd!r} {impl} "
              f"grad={grad} {time.perf_counter() - t0:.1f}s", flush=True)

    # Under jax.checkpoint (remat) too.
    specs = _specs("data", "model")
    args = [jax.device_put(p[n], NamedSharding(grid, specs[n])) for n in NAMES]
    remat = jax.checkpoint(lambda *a: sharded_chunk_gdp_fwd_o(
        *a, segment_ids=p["segment_ids"], mesh=grid, batch_axis="data", head_axis="model",
        chunk_size=16, implementation="xla"))
    plain = lambda *a: gdp_jax.chunk_gdp_fwd_o(*a, segment_ids=p["segment_ids"], chunk_size=16,
                                               implementation="xla")
    grads = jax.jit(jax.grad(_loss(remat), argnums=(0, 1, 2, 3, 4)))(*args)
    grads_ref = jax.jit(jax.grad(_loss(plain), argnums=(0, 1, 2, 3, 4)))(*[p[n] for n in NAMES])
    assert all(_rel(d, d_ref) < 1e-5 for d, d_ref in zip(grads, grads_ref))

    # Control: the unwrapped Pallas op (interpreted) on the same sharded inputs is what
    # gdp_jax.sharding exists for: XLA cannot split the kernel, so it all-gathers the operands.
    # This also shows the HLO scan above would see an all-gather if there were one.
    args = [jax.device_put(p[n], NamedSharding(grid, specs[n])) for n in NAMES + ("segment_ids",)]
    plain = jax.jit(lambda *a: gdp_jax.chunk_gdp_fwd_o(*a[:5], segment_ids=a[5], chunk_size=16,
                                                       implementation="interpret"))
    lines = _collective_lines(plain.lower(*args).compile().as_text())
    assert any("all-gather" in line for line in lines), lines

    # No g, no segment_ids; the context mesh (jax.set_mesh) instead of mesh=.
    args = [p[n] for n in ("q", "k", "v", "h")]
    o_ref = gdp_jax.chunk_gdp_fwd_o(*args, chunk_size=16, implementation="xla")
    with jax.set_mesh(grid):
        o = jax.jit(lambda *a: sharded_chunk_gdp_fwd_o(*a, batch_axis="data", head_axis="model",
                                                       chunk_size=16, implementation="xla"))(*args)
    assert _rel(o, o_ref) < 1e-5
    with pytest.raises(ValueError, match="B = 3 must be a multiple"):
        sharded_chunk_gdp_fwd_o(*[x[:3] for x in args], mesh=data, chunk_size=16)
    with pytest.raises(ValueError, match="H = 2 must be a multiple"):
        sharded_chunk_gdp_fwd_o(*args, mesh=data, batch_axis=None, head_axis="data", chunk_size=16)
    # No axis named: the plain op (XLA replicates it over the mesh).
    o = sharded_chunk_gdp_fwd_o(*args, mesh=grid, batch_axis=None, chunk_size=16, implementation="xla")
    assert _rel(o, o_ref) < 1e-5
    print(f"all sharding checks passed in {time.perf_counter() - start:.1f}s", flush=True)


# ---------------------------------------------------------------------------------------------
# The full op: sharded_chunk_gated_delta_product

FULL_NAMES = ("q", "k", "v", "g", "beta", "initial_state")     # the differentiable operands


def _full_problem(batch=4, tokens=37, heads=2, key_dim=16, value_dim=16, m=2, chunk_size=16,
                  seed=11):
    """Random inputs of the full op (no reference needed: the check is sharded == unsharded).
    T = 37 is ragged against chunk_size 16; the segments include one starting on a chunk boundary."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(batch, tokens * m, heads, key_dim))
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return dict(
        q=f32(rng.normal(size=(batch, tokens, heads, key_dim))),
        k=f32(k / np.linalg.norm(k, axis=-1, keepdims=True)),
        v=f32(rng.normal(size=(batch, tokens * m, heads, value_dim))),
        g=f32(-rng.uniform(0.0, 0.25, size=(batch, tokens, heads))),
        beta=f32(rng.uniform(0.05, 1.95, size=(batch, tokens * m, heads))),
        initial_state=f32(0.5 * rng.normal(size=(batch, heads, key_dim, value_dim))),
        segment_ids=jnp.asarray(random_segment_ids(rng, batch, tokens, chunk_size)),
        chunk_size=chunk_size)


def _full_specs(b, hd):
    return dict(q=P(b, None, hd, None), k=P(b, None, hd, None), v=P(b, None, hd, None),
                g=P(b, None, hd), beta=P(b, None, hd), initial_state=P(b, hd, None, None),
                segment_ids=P(b, None))


def _full_loss(fn):
    def loss(*a):
        o, state = fn(*a)
        return jnp.sum(jnp.square(o)) + jnp.sum(jnp.square(state))
    return loss


def _full_reference(p, implementation, grad):
    """The unsharded op's (o, final_state) and gradients, computed once per problem and config."""
    key = (implementation, grad)
    cache = p.setdefault("_ref", {})
    if key not in cache:
        kw = dict(chunk_size=p["chunk_size"], implementation=implementation, output_final_state=True)
        plain = lambda *a: gdp_jax.chunk_gated_delta_product(*a[:5], segment_ids=a[6],
                                                             initial_state=a[5], **kw)
        args = [p[n] for n in FULL_NAMES] + [p["segment_ids"]]
        grads = None
        if grad:
            grads = jax.jit(jax.grad(_full_loss(plain), argnums=tuple(range(6))))(*args)
        cache[key] = jax.jit(plain)(*args), grads
    return cache[key]


def check_full_mesh(p, mesh, batch_axis, head_axis, implementation, grad=True, tol=1e-5):
    """Sharded full op == unsharded (o, final_state, and gradients in q, k, v, g, beta and
    initial_state); no collective in the compiled forward or backward program."""
    kw = dict(chunk_size=p["chunk_size"], implementation=implementation, output_final_state=True)
    specs = _full_specs(batch_axis, head_axis)
    put = lambda name: jax.device_put(p[name], NamedSharding(mesh, specs[name]))
    args = [put(n) for n in FULL_NAMES] + [put("segment_ids")]
    (o_ref, state_ref), grads_ref = _full_reference(p, implementation, grad)

    def sharded(q, k, v, g, beta, state, seg):
        return sharded_chunk_gated_delta_product(
            q, k, v, g, beta, segment_ids=seg, initial_state=state, mesh=mesh,
            batch_axis=batch_axis, head_axis=head_axis, **kw)

    # One compilation serves both the values and the HLO scan.
    fwd = jax.jit(sharded).lower(*args).compile()
    lines = _collective_lines(fwd.as_text())
    assert not lines, f"forward program has collectives: {lines}"
    o, state = fwd(*args)
    for name, x, x_ref, spec in [("o", o, o_ref, P(batch_axis, None, head_axis, None)),
                                 ("final_state", state, state_ref, specs["initial_state"])]:
        assert x.shape == x_ref.shape and x.dtype == x_ref.dtype, name
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (name, x.sharding)
        err = _rel(x, x_ref)
        assert err < tol, f"{name} differs from unsharded by {err}"
    if not grad:
        return
    grad_fn = jax.jit(jax.grad(_full_loss(sharded), argnums=tuple(range(6)))).lower(*args).compile()
    lines = _collective_lines(grad_fn.as_text())
    assert not lines, f"backward program has collectives: {lines}"
    for name, d, d_ref, x in zip(FULL_NAMES, grad_fn(*args), grads_ref, args):
        assert d.shape == d_ref.shape and d.dtype == d_ref.dtype, name
        assert d.sharding.is_equivalent_to(x.sharding, x.ndim), (name, d.sharding, x.sharding)
        err = _rel(d, d_ref)
        assert err < tol, f"d{name} differs from unsharded by {err}"


def worker_full() -> None:
    """The full op in the 4-device subprocess; raises (non-zero exit) on any failure."""
    assert jax.device_count() == 4, jax.devices()
    start = time.perf_counter()
    p = _full_problem()
    data, grid = _four_device_meshes()
    for mesh, b, hd, impl, grad in [(data, "data", None, "xla", False),
                                    (grid, "data", "model", "xla", True)]:
        t0 = time.perf_counter()
        check_full_mesh(p, mesh, b, hd, impl, grad=grad)
        print(f"ok full op mesh={dict(mesh.shape)} batch_axis={b!r} head_axis={hd!r} {impl} "
              f"grad={grad} {time.perf_counter() - t0:.1f}s", flush=True)
    # The Pallas kernels (WY, state walk, output) in the interpreter, on a smaller problem.
    t0 = time.perf_counter()
    check_full_mesh(_full_problem(tokens=20, key_dim=8, value_dim=8), grid, "data", "model",
                    "interpret", grad=False)
    print(f"ok full op mesh={dict(grid.shape)} data/model interpret grad=False "
          f"{time.perf_counter() - t0:.1f}s", flush=True)

    # No g, segments or initial state, no final state, l2norm, the context mesh: (o, None).
    args = [p[n] for n in ("q", "k", "v")]
    kw = dict(chunk_size=16, implementation="xla", use_qk_l2norm=True)
    o_ref, none = jax.jit(lambda *a: gdp_jax.chunk_gated_delta_product(*a, **kw))(
        *args, None, p["beta"])
    assert none is None
    with jax.set_mesh(grid):
        o, none = jax.jit(lambda *a: sharded_chunk_gated_delta_product(
            *a, batch_axis="data", head_axis="model", **kw))(*args, None, p["beta"])
    assert none is None and _rel(o, o_ref) < 1e-5
    # Divisibility, checked on the global shapes.
    with pytest.raises(ValueError, match="B = 3 must be a multiple"):
        sharded_chunk_gated_delta_product(*[x[:3] for x in args], None, p["beta"][:3], mesh=data,
                                          chunk_size=16)
    with pytest.raises(ValueError, match="H = 2 must be a multiple"):
        sharded_chunk_gated_delta_product(*args, None, p["beta"], mesh=data, batch_axis=None,
                                          head_axis="data", chunk_size=16)
    print(f"all full-op sharding checks passed in {time.perf_counter() - start:.1f}s", flush=True)


# ---------------------------------------------------------------------------------------------
# pytest side

def _run_worker(*argv) -> str:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE] + [x for x in [env.get("PYTHONPATH")] if x])
    result = subprocess.run([sys.executable, os.path.abspath(__file__), *argv], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    if result.returncode:
        pytest.fail(f"4-device sharding checks {argv} failed (exit {result.returncode}):\n"
                    f"{result.stdout}\n{result.stderr[-6000:]}")
    return result.stdout


def test_sharded_ops_equal_unsharded_on_4_cpu_devices():
    out = _run_worker()
    assert "all sharding checks passed" in out, out
    assert "all full-op sharding checks passed" in out, out


def _one_device_mesh():
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))


def test_one_device_mesh_matches_op():
    p = _problem(batch=2)
    args = [p[n] for n in NAMES]
    kw = dict(segment_ids=p["segment_ids"], chunk_size=16, implementation="xla")
    o = jax.jit(lambda *a: sharded_chunk_gdp_fwd_o(*a, mesh=_one_device_mesh(), head_axis="model",
                                                   **kw))(*args)
    chex.assert_trees_all_close(o, jax.jit(lambda *a: gdp_jax.chunk_gdp_fwd_o(*a, **kw))(*args),
                                rtol=1e-6, atol=1e-6)


def test_argument_errors():
    p = _problem(batch=2)
    args = [p[n] for n in NAMES]
    mesh = _one_device_mesh()
    with pytest.raises(ValueError, match="mesh has no axis 'tensor'"):
        sharded_chunk_gdp_fwd_o(*args, mesh=mesh, head_axis="tensor", chunk_size=16)
    with pytest.raises(ValueError, match="named in both"):
        sharded_chunk_gdp_fwd_o(*args, mesh=mesh, batch_axis=("data", "model"), head_axis="model",
                                chunk_size=16)
    with pytest.raises(ValueError, match="h must have shape"):  # the op's checks, on global shapes
        sharded_chunk_gdp_fwd_o(*args[:3], args[3][:, :1], args[4], mesh=mesh, chunk_size=16)
    with pytest.raises(TypeError, match="unexpected keyword"):
        sharded_chunk_gdp_fwd_o(*args, mesh=mesh, chunk_sizes=16)
    with pytest.raises(ValueError, match="no mesh"):
        sharded_chunk_gdp_fwd_o(*args, chunk_size=16)


def test_full_op_argument_errors():
    p = _full_problem(batch=2, tokens=20)
    args = [p[n] for n in ("q", "k", "v", "g", "beta")]
    mesh = _one_device_mesh()
    call = functools.partial(sharded_chunk_gated_delta_product, mesh=mesh, chunk_size=16)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['chunk_sizes'\] for "
                                        "chunk_gated_delta_product"):
        call(*args, chunk_sizes=16)
    with pytest.raises(TypeError, match="unexpected keyword"):   # chunk_gdp_fwd_o's h is not ours
        call(*args, h=p["initial_state"])
    with pytest.raises(ValueError, match="named in both"):
        call(*args, batch_axis=("data", "model"), head_axis="model")
    # The op's own checks run on the global shapes: the message names the caller's B = 2.
    with pytest.raises(ValueError, match=r"initial_state must have shape .* = \(2, 2, 16, 16\)"):
        call(*args, initial_state=p["initial_state"][:, :1])
    with pytest.raises(TypeError, match="output_final_state must be a Python bool"):
        call(*args, output_final_state=1)
    with pytest.raises(ValueError, match="implementation must be one of"):
        call(*args, implementation="triton")
    with pytest.raises(ValueError, match="no mesh"):
        sharded_chunk_gated_delta_product(*args, chunk_size=16)


def test_full_op_one_device_mesh_matches_op():
    p = _full_problem(batch=2, tokens=20)
    args = [p[n] for n in ("q", "k", "v", "g", "beta")]
    kw = dict(segment_ids=p["segment_ids"], initial_state=p["initial_state"],
              output_final_state=True, chunk_size=16, implementation="xla")
    op = jax.jit(lambda *a: gdp_jax.chunk_gated_delta_product(*a, **kw))
    sharded = jax.jit(lambda *a: sharded_chunk_gated_delta_product(
        *a, mesh=_one_device_mesh(), head_axis="model", **kw))
    chex.assert_trees_all_close(sharded(*args), op(*args), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_two_gpus_pallas():
    """On 2 GPUs: the Pallas kernel, B and then H sharded, equals one GPU; no collective."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    p = _problem(batch=4, tokens=1000, heads=4, key_dim=128, value_dim=128, chunk_size=64)
    for mesh, b, hd in _two_gpu_cases():
        check_mesh(p, mesh, b, hd, "pallas", grad=True, tol=2e-3)


@pytest.mark.gpu
def test_two_gpus_pallas_full_op():
    """On 2 GPUs: the full op (Pallas WY, state walk and output kernels), B and then H sharded,
    equals one GPU, o, final state and gradients; no collective forward or backward."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    p = _full_problem(batch=4, tokens=1000, heads=4, key_dim=128, value_dim=128, m=2,
                      chunk_size=64, seed=3)
    for mesh, b, hd in _two_gpu_cases():
        check_full_mesh(p, mesh, b, hd, "pallas", grad=True, tol=2e-3)


if __name__ == "__main__":
    if sys.argv[1:] != ["full"]:
        worker()
    if sys.argv[1:] != ["chunk_o"]:
        worker_full()
