#!/usr/bin/env python3
"""Sustained against rested timing of the chunk_o forward, ours and fla's, with the SM clock of each.

A kernel near the bandwidth floor also keeps the tensor cores busy, and on an H200 the K = V = 256
forward runs into the card's 700 W limit: over bench-length loops the driver's power cap pulls
the SM clock down (twelfth session, benchmarks/RESULTS.md). This script separates the kernel from
the cap. Per shape it times:

  * sustained: bench_chunk_o.py's method (``time_jax`` / ``time_torch``: back-to-back loops of
    --target-ms each, median of --reps), the clock sampled during the loops;
  * rested: --bursts loops of about --burst-ms each, every one after --rest seconds idle, so the
    card starts each at full clock; the median over loops.

    PYTHONPATH=. python3 benchmarks/burst_chunk_o.py --shapes "B=2,T=16384,H=16,K=256,V=256,M=2"

fla is timed when torch and fla import (--no-fla to skip). Prints a line per measurement, then a
table: ms and % of the copy-bandwidth floor for each, and fla / ours. Returns the rows.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (GpuMonitor, add_timing_args, copy_bandwidth, nbytes, parse_shapes,  # noqa: E402
                          shape_label, short_exc, time_jax, time_torch)

DEFAULT_SHAPES = ("B=2,T=16384,H=16,K=256,V=256,M=2;B=8,T=4096,H=16,K=128,V=128,M=2;"
                  "B=8,T=4096,H=16,K=128,V=128,M=1")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help="'B=..,T=..,H=..,K=..,V=..,M=..;...' (unpacked shapes)")
    p.add_argument("--burst-ms", type=float, default=50.0, help="GPU time of one rested loop")
    p.add_argument("--rest", type=float, default=2.0, help="idle seconds before each rested loop")
    p.add_argument("--bursts", type=int, default=5)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--no-fla", action="store_true")
    add_timing_args(p)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import gdp_jax
    from bench_chunk_o import load_fla, make_set, to_torch

    on_cpu = jax.devices()[0].platform == "cpu"
    implementation = "interpret" if on_cpu else "pallas"   # on a CPU only the script's logic is checked
    bandwidth = copy_bandwidth(args, on_cpu)["GBps"] * 1e9
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; copy bandwidth "
          f"{bandwidth / 1e12:.3f} TB/s", flush=True)
    torch = fla_fwd_o = None
    if not args.no_fla and not on_cpu:
        try:
            torch, fla_fwd_o, _, _ = load_fla()
        except Exception as e:  # noqa: BLE001 - fla is optional
            print("fla unavailable, skipping it:", short_exc(e))
    monitor = GpuMonitor() if not on_cpu else None

    def rested(run_loop, est_ms, phase):
        """Median ms per call of --bursts loops, each after --rest seconds idle."""
        n = max(args.sets, int(args.burst_ms / est_ms) // args.sets * args.sets)
        per_call = []
        with monitor.phase(phase) if monitor else contextlib.nullcontext():
            for _ in range(args.bursts):
                time.sleep(args.rest)
                per_call.append(run_loop(n))
        return statistics.median(per_call), n

    def report(label, ms, floor_ms, phase, extra=""):
        print(f"{label}: {ms:.4f} ms ({floor_ms / ms:.1%} of the floor){extra}  "
              f"{GpuMonitor.describe(monitor and monitor.summary(phase))}", flush=True)

    rows = []
    try:
        for shp in parse_shapes(args.shapes, {}):
            B, T, H, V, M = (shp[c] for c in "BTHVM")
            keys = jax.random.split(jax.random.PRNGKey(1), args.sets)
            inputs = [(q, k, v, h, g) for q, k, v, h, _, g in
                      (make_set(key, shp, jnp.bfloat16, args.chunk) for key in keys)]
            floor_ms = (nbytes(*inputs[0]) + B * T * H * V * 2) / bandwidth * 1e3
            label = shape_label(shp)
            row = dict(shape=label, floor_ms=floor_ms)
            fn = jax.jit(lambda q, k, v, h, g: gdp_jax.chunk_gdp_fwd_o(
                q, k, v, h, g, chunk_size=args.chunk, num_householder=M,
                implementation=implementation))
            phase = f"{label} ours sustained"
            row["ours_sustained_ms"], _ = time_jax(
                fn, inputs, target_s=args.target_ms / 1e3, reps=args.reps,
                max_iters=args.max_iters, during=monitor.phase(phase) if monitor else None)
            report(f"{label} ours sustained", row["ours_sustained_ms"], floor_ms, phase)

            def ours_loop(n):
                start = time.perf_counter()
                for i in range(n):
                    out = fn(*inputs[i % len(inputs)])
                jax.block_until_ready(out)
                return (time.perf_counter() - start) / n * 1e3
            phase = f"{label} ours rested"
            row["ours_rested_ms"], n = rested(ours_loop, row["ours_sustained_ms"], phase)
            report(f"{label} ours rested", row["ours_rested_ms"], floor_ms, phase, f", {n} calls a loop")

            if fla_fwd_o is not None:
                tsets = [tuple(to_torch(torch, a) for a in s) for s in inputs]
                scale = shp["K"] ** -0.5

                def fla_call(q, k, v, h, g):
                    return fla_fwd_o(q, k, v, h, g, scale=scale, cu_seqlens=None,
                                     chunk_size=args.chunk, num_householder=M)
                phase = f"{label} fla sustained"
                row["fla_sustained_ms"], _ = time_torch(
                    fla_call, tsets, target_s=args.target_ms / 1e3, reps=args.reps,
                    max_iters=args.max_iters, during=monitor.phase(phase) if monitor else None)
                report(f"{label} fla sustained", row["fla_sustained_ms"], floor_ms, phase)
                start_event = torch.cuda.Event(enable_timing=True)
                end_event = torch.cuda.Event(enable_timing=True)

                def fla_loop(n):
                    torch.cuda.synchronize()
                    start_event.record()
                    for i in range(n):
                        fla_call(*tsets[i % len(tsets)])
                    end_event.record()
                    end_event.synchronize()
                    return start_event.elapsed_time(end_event) / n
                phase = f"{label} fla rested"
                row["fla_rested_ms"], n = rested(fla_loop, row["fla_sustained_ms"], phase)
                report(f"{label} fla rested", row["fla_rested_ms"], floor_ms, phase, f", {n} calls a loop")
            rows.append(row)
    finally:
        if monitor:
            monitor.close()

    nan = float("nan")
    print(f"\n{'shape':26s} {'floor':>7s} {'ours sust.':>10s} {'%':>6s} {'ours rested':>11s} {'%':>6s} "
          f"{'fla sust.':>9s} {'fla rested':>10s} {'fla/ours sust.':>14s} {'rested':>6s}")
    for r in rows:
        fla_s, fla_r = r.get("fla_sustained_ms", nan), r.get("fla_rested_ms", nan)
        print(f"{r['shape']:26s} {r['floor_ms']:7.4f} {r['ours_sustained_ms']:10.4f} "
              f"{r['floor_ms'] / r['ours_sustained_ms']:6.1%} {r['ours_rested_ms']:11.4f} "
              f"{r['floor_ms'] / r['ours_rested_ms']:6.1%} {fla_s:9.4f} {fla_r:10.4f} "
              f"{fla_s / r['ours_sustained_ms']:14.3f} {fla_r / r['ours_rested_ms']:6.3f}")
    return rows


if __name__ == "__main__":
    main()
