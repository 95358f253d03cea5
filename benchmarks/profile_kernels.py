#!/usr/bin/env python3
"""Per-kernel GPU time of the full op (forward, forward + backward) from a JAX profiler trace.

    PYTHONPATH=. python3 benchmarks/profile_kernels.py --out $OUT/kernels
    PYTHONPATH=. python3 benchmarks/profile_kernels.py --shape B=1,T=256,H=2,K=32,M=2 --interpret

Runs each jitted function a few times under ``jax.profiler.trace(create_perfetto_trace=True)``,
then sums the duration of every event on the GPU's timelines by name (Pallas kernels carry their
``name=``; XLA fusions their HLO names) and divides by the number of calls. Prints one table per
function, largest first, and writes the tables as JSON and the raw trace under --out. Kernel times
here are device time per kernel, so they add up to less than the wall-clock times of the bench
scripts (launch gaps are not counted).
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os

from bench_common import parse_shapes


def gpu_kernel_times(trace_path: str, calls: int) -> list[tuple[str, float, int]]:
    """(name, ms per call, launches per call) of every kernel on the GPU's stream timelines.

    Only threads named "Stream ..." of a GPU process are counted: the trace also has summary
    lines ("XLA Modules", "XLA Ops") over the same time, which would count it twice."""
    with gzip.open(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    meta = [e for e in events if e.get("ph") == "M"]
    gpu_pids = {e["pid"] for e in meta if e.get("name") == "process_name"
                and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
    threads = {(e["pid"], e["tid"]): str(e.get("args", {}).get("name", ""))
               for e in meta if e.get("name") == "thread_name" and e["pid"] in gpu_pids}
    streams = {key for key, name in threads.items() if name.lower().startswith("stream")}
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams:
            total[e["name"]] += float(e.get("dur", 0.0))
            count[e["name"]] += 1
    if not streams:
        print(f"no GPU stream timelines in {trace_path}; GPU threads: {sorted(set(threads.values()))}")
    return sorted(((n, t / 1e3 / calls, count[n] // calls) for n, t in total.items()),
                  key=lambda r: -r[1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="B=8,T=4096,H=16,K=128,M=2")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU logic check)")
    p.add_argument("--out", default="profile_kernels")
    args = p.parse_args()
    import jax
    import jax.numpy as jnp

    from gdp_jax import chunk_gated_delta_product

    (shp,) = parse_shapes(args.shape, {})
    B, T, H, K, V, M = (shp[c] for c in "BTHKVM")
    dt, f32 = jnp.bfloat16, jnp.float32
    impl = "interpret" if args.interpret else "pallas"
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    q = jax.random.normal(ks[0], (B, T, H, K), dt)
    k = jax.random.normal(ks[1], (B, T * M, H, K), f32)
    k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(dt)
    v = jax.random.normal(ks[2], (B, T * M, H, V), dt)
    g = -jax.random.uniform(ks[3], (B, T, H), f32, 0.01, 0.2)
    beta = jax.random.uniform(ks[4], (B, T * M, H), f32, 0.1, 1.9)
    op = lambda q, k, v, g, beta: chunk_gated_delta_product(
        q, k, v, g, beta, chunk_size=args.chunk, implementation=impl)[0]
    loss = lambda *a: jnp.sum(op(*a).astype(f32))

    fns = {
        "fwd": (jax.jit(op), (q, k, v, g, beta)),
        "fwdbwd": (jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))), (q, k, v, g, beta)),
        "fwdbwd_ng": (jax.jit(jax.value_and_grad(lambda q, k, v, beta: loss(q, k, v, None, beta),
                                                 argnums=(0, 1, 2, 3))), (q, k, v, beta)),
    }
    os.makedirs(args.out, exist_ok=True)
    tables = {}
    for name, (fn, fn_args) in fns.items():
        jax.block_until_ready(fn(*fn_args))                      # compile and warm up
        trace_dir = os.path.join(args.out, name)
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(args.calls):
                out = fn(*fn_args)
            jax.block_until_ready(out)
        traces = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
        if not traces:
            print(f"{name}: no perfetto trace under {trace_dir}")
            continue
        rows = gpu_kernel_times(traces[0], args.calls)
        tables[name] = rows
        print(f"\n{name} ({args.shape}, bf16, chunk {args.chunk}): "
              f"{sum(r[1] for r in rows):.3f} ms of GPU events per call")
        for kernel, ms, launches in rows[:25]:
            print(f"  {ms:8.3f} ms  x{launches:<3d} {kernel[:100]}")
    with open(os.path.join(args.out, "kernels.json"), "w") as f:
        json.dump({"shape": args.shape, "chunk": args.chunk, "jax": jax.__version__,
                   "device": jax.devices()[0].device_kind, "tables": tables}, f, indent=1)


if __name__ == "__main__":
    main()
