#!/usr/bin/env python3
"""Scaling of gdp_jax.sharded_chunk_gdp_fwd_o (--op chunk_o, the default) or of the full op
gdp_jax.sharded_chunk_gated_delta_product (--op full) over N GPUs (issue 7), forward and
forward+backward.

Run on a 2-GPU box from the repo root:

    PYTHONPATH=. python3 benchmarks/bench_sharding.py --out $OUT/sharding.json
    PYTHONPATH=. python3 benchmarks/bench_sharding.py --shapes quick --no-grad
    PYTHONPATH=. python3 benchmarks/bench_sharding.py --op full --out $OUT/sharding_full.json
    PYTHONPATH=. python3 benchmarks/bench_sharding.py --cpu-devices 2 --shapes tiny --impl xla   # CPU logic check
    PYTHONPATH=. python3 benchmarks/bench_sharding.py --cpu-devices 2 --shapes tiny --impl xla --op full

--op chunk_o times chunk_gdp_fwd_o(q, k, v, h, g); --op full times chunk_gated_delta_product(q, k, v,
g, beta) (natural-log gate g, no initial state, o only; the backward differentiates q, k, v, g and
beta). In both, fwd+bwd is jax.grad of sum(o**2).

For each shape and layout (``data``: B split over N devices; ``model``: H split over N devices):
  * sharded   : the wrapper on the whole problem, inputs already laid out as it wants (jit);
  * local_1gpu: the plain op on ONE device on one device's share (B/N rows, or H/N heads): the ideal
                per-device time. scaling efficiency = local_1gpu / sharded (1.0 = perfect);
  * full_1gpu : the plain op on one device on the whole problem. speedup = full_1gpu / sharded (ideal N);
  * unwrapped : the plain op under jit on the same sharded inputs (what issue 7 reports: XLA gathers
                every operand to every device), with the all-gathers counted in its compiled HLO.
The sharded program's compiled HLO is scanned too: "collectives" should be [] for the forward and
for the backward. Times are wall clock over --iters back-to-back calls after block_until_ready,
median of --reps loops. Nothing is asserted; failures are printed and the run goes on.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
import traceback

SHAPE_SETS = {
    "default": [
        dict(B=8, T=4096, H=16, K=128, V=128, M=2),
        dict(B=8, T=4096, H=16, K=128, V=128, M=1),
        dict(B=4, T=8192, H=32, K=64, V=64, M=3),
        dict(B=16, T=2048, H=8, K=128, V=128, M=2),
    ],
    "quick": [dict(B=8, T=4096, H=16, K=128, V=128, M=2)],
    "tiny": [dict(B=4, T=200, H=4, K=32, V=32, M=2)],   # logic check on CPU; numbers mean nothing
}
COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", default="chunk_o", choices=["chunk_o", "full"],
                    help="chunk_o: sharded_chunk_gdp_fwd_o (default); full: the full op "
                         "sharded_chunk_gated_delta_product")
    ap.add_argument("--shapes", default="default", help=f"one of {sorted(SHAPE_SETS)}")
    ap.add_argument("--devices", type=int, default=2, help="GPUs to shard over (default 2)")
    ap.add_argument("--impl", default=None, help="implementation (default: pallas on GPU, xla on CPU)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--layouts", default="data,model", help="comma list of data, model")
    ap.add_argument("--no-grad", action="store_true", help="forward only")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpu-devices", type=int, default=0,
                    help="fake N CPU devices (XLA_FLAGS) to check the script without GPUs")
    ap.add_argument("--out", default=None, help="write results as JSON here")
    return ap.parse_args()


def main():
    args = parse_args()
    if args.cpu_devices:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.cpu_devices}")
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import gdp_jax
    from gdp_jax.sharding import sharded_chunk_gated_delta_product, sharded_chunk_gdp_fwd_o

    n = args.devices
    devices = jax.devices()
    if len(devices) < n:
        sys.exit(f"needs {n} devices, have {len(devices)}: {devices}")
    impl = args.impl or ("pallas" if jax.default_backend() == "gpu" else "xla")
    dtype = getattr(jnp, args.dtype)
    bt = args.chunk_size
    mesh = Mesh(np.array(devices[:n]), ("x",))
    info = dict(op=args.op, jax=jax.__version__, backend=jax.default_backend(), devices=[str(d) for d in devices[:n]],
                device_kind=devices[0].device_kind, impl=impl, dtype=args.dtype, chunk_size=bt,
                iters=args.iters, reps=args.reps)
    print(json.dumps(info), flush=True)

    def make_inputs(shape, device):
        """chunk_o: [q, k, v, h, g] (g chunk-local log2 cumsums); full: [q, k, v, g, beta]
        (g the natural-log gate per token)."""
        b, t, hh, kd, vd, m = (shape[c] for c in "BTHKVM")
        nt = -(-t // bt)
        key = jax.random.split(jax.random.PRNGKey(0), 5)
        with jax.default_device(device):
            q = jax.random.normal(key[0], (b, t, hh, kd), dtype)
            k = jax.random.normal(key[1], (b, t * m, hh, kd), jnp.float32)
            k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
            if args.op == "full":
                v = jax.random.normal(key[2], (b, t * m, hh, vd)).astype(dtype)
                g = -jax.nn.softplus(jax.random.normal(key[3], (b, t, hh))) * 0.1
                beta = jax.random.uniform(key[4], (b, t * m, hh), jnp.float32, 0.05, 1.95)
                return [q, k, v, g, beta]
            v = (0.1 * jax.random.normal(key[2], (b, t * m, hh, vd))).astype(dtype)
            h = (0.1 * jax.random.normal(key[3], (b, nt, hh, kd, vd))).astype(dtype)
            gate = -jax.nn.softplus(jax.random.normal(key[4], (b, nt * bt, hh))) / math.log(2.0) * 0.1
            g = jnp.cumsum(gate.reshape(b, nt, bt, hh), axis=2).reshape(b, nt * bt, hh)[:, :t]
        return [q, k, v, h, g]

    def specs(layout):
        b, hd = ("x", None) if layout == "data" else (None, "x")
        if args.op == "full":   # q, k, v, g, beta
            return [P(b, None, hd, None)] * 3 + [P(b, None, hd), P(b, None, hd)], b, hd
        return [P(b, None, hd, None)] * 3 + [P(b, None, hd, None, None), P(b, None, hd)], b, hd

    def ops(b_axis, h_axis):
        """(sharded, plain): the wrapper and the unwrapped op, each taking make_inputs' list and
        returning o."""
        if args.op == "full":
            return (lambda *a: sharded_chunk_gated_delta_product(
                        *a, mesh=mesh, batch_axis=b_axis, head_axis=h_axis, **op_kw)[0],
                    lambda *a: gdp_jax.chunk_gated_delta_product(*a, **op_kw)[0])
        return (lambda *a: sharded_chunk_gdp_fwd_o(*a, mesh=mesh, batch_axis=b_axis,
                                                   head_axis=h_axis, **op_kw),
                lambda *a: gdp_jax.chunk_gdp_fwd_o(*a, **op_kw))

    def timed(fn, inputs):
        out = fn(*inputs)
        jax.block_until_ready(out)
        runs = []
        for _ in range(args.reps):
            start = time.perf_counter()
            for _ in range(args.iters):
                out = fn(*inputs)
            jax.block_until_ready(out)
            runs.append((time.perf_counter() - start) / args.iters * 1e3)
        return statistics.median(runs)

    def collectives(fn, inputs):
        text = fn.lower(*inputs).compile().as_text()
        return [line.strip()[:160] for line in text.splitlines()
                if any(re.search(rf"\b{c}(-start)?\(", line) for c in COLLECTIVES)]

    op_kw = dict(chunk_size=bt, implementation=impl)
    loss = lambda fn: (lambda *a: jnp.sum(jnp.square(fn(*a).astype(jnp.float32))))
    modes = ["fwd"] if args.no_grad else ["fwd", "fwd+bwd"]
    results = []
    for shape in SHAPE_SETS[args.shapes]:
        for layout in args.layouts.split(","):
            in_specs, b_axis, h_axis = specs(layout)
            split = "B" if layout == "data" else "H"
            if shape[split] % n:
                print(f"skip {shape} {layout}: {split} not divisible by {n}", flush=True)
                continue
            local_shape = dict(shape, **{split: shape[split] // n})
            for mode in modes:
                row = dict(shape=shape, layout=layout, mode=mode, devices=n)
                try:
                    full = make_inputs(shape, devices[0])
                    sharded_in = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(full, in_specs)]
                    local_in = make_inputs(local_shape, devices[0])
                    sharded_o, plain_o = ops(b_axis, h_axis)
                    sharded, plain = sharded_o, plain_o
                    if mode == "fwd+bwd":
                        sharded = jax.grad(loss(sharded), argnums=(0, 1, 2, 3, 4))
                        plain = jax.grad(loss(plain), argnums=(0, 1, 2, 3, 4))
                    sharded, plain = jax.jit(sharded), jax.jit(plain)
                    row["sharded_ms"] = timed(sharded, sharded_in)
                    row["collectives"] = collectives(sharded, sharded_in)
                    row["local_1gpu_ms"] = timed(plain, local_in)
                    row["full_1gpu_ms"] = timed(plain, full)
                    row["scaling_efficiency"] = row["local_1gpu_ms"] / row["sharded_ms"]
                    row["speedup_vs_1gpu"] = row["full_1gpu_ms"] / row["sharded_ms"]
                    try:
                        row["unwrapped_ms"] = timed(plain, sharded_in)
                        row["unwrapped_all_gathers"] = sum("all-gather" in line
                                                           for line in collectives(plain, sharded_in))
                    except Exception as e:  # noqa: BLE001
                        row["unwrapped_error"] = f"{type(e).__name__}: {e}"[:300]
                    ref = np.asarray(jax.jit(plain_o)(*full), np.float32)
                    got = np.asarray(jax.jit(sharded_o)(*sharded_in), np.float32)
                    row["rel_err_vs_1gpu"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                    del full, sharded_in, local_in
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:500]
                    traceback.print_exc()
                results.append(row)
                print(json.dumps(row), flush=True)

    print("\nshape" + " " * 49 + "layout mode     sharded  local1  full1  eff   speedup unwrapped")
    for r in results:
        if "error" in r:
            print(f"{str(r['shape']):54s}{r['layout']:7s}{r['mode']:8s} ERROR {r['error'][:80]}")
            continue
        print(f"{str(r['shape']):54s}{r['layout']:7s}{r['mode']:8s}{r['sharded_ms']:8.3f}{r['local_1gpu_ms']:8.3f}"
              f"{r['full_1gpu_ms']:8.3f}{r['scaling_efficiency']:6.2f}{r['speedup_vs_1gpu']:7.2f}"
              f"{r.get('unwrapped_ms', float('nan')):9.3f}  collectives={len(r['collectives'])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(info=info, results=results), f, indent=1)


if __name__ == "__main__":
    main()
