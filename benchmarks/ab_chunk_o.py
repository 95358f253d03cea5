#!/usr/bin/env python3
"""Compare kernel_config overrides of the chunk_o forward kernel, taking turns in one process.

At K = V = 256 the same kernel times 2-4 % apart from one process (or card) to the next, which is
more than most launch-config differences, and the tenth session saw the ranking of two configs
flip between processes. So configs are compared only inside one process: each round times every
config once, in turn, on the same rotated inputs as bench_chunk_o.py, through the public op.

    PYTHONPATH=. python3 benchmarks/ab_chunk_o.py --shape "B=2,T=16384,H=16,K=256,V=256,M=2" \\
        --configs "s4:num_stages=4;s5:num_stages=5" --rounds 4

The first config is always the default ("default"); --configs adds named kernel_config keyword
overrides ("name:key=value,key=value;..."; ints and True/False are converted). Prints each
round, then per config the median, min and max over rounds, the % of the copy-bandwidth floor, and
the config's largest output difference from the default's, relative to the output's largest entry.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (GpuMonitor, add_dtype_arg, add_timing_args, jnp_dtype, copy_bandwidth,
                          nbytes, parse_shapes, shape_label, time_jax)


def parse_named_configs(text: str) -> dict:
    """'a:x=1,y=True;b:z=2' -> {'default': {}, 'a': {'x': 1, 'y': True}, 'b': {'z': 2}}."""
    from tune_chunk_o import parse_configs    # the tuner's 'key=value,...' syntax

    configs = {"default": {}}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, body = part.partition(":")
        if not body:
            raise SystemExit(f"config {part!r} needs a name: 'name:key=value,...'")
        (configs[name],) = parse_configs(body)
    return configs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="B=2,T=16384,H=16,K=256,V=256,M=2",
                   help="one shape, 'B=..,T=..,H=..,K=..,V=..,M=..[,segs=..]'")
    p.add_argument("--configs", default="", help="'name:key=value,...;...' kernel_config overrides")
    p.add_argument("--rounds", type=int, default=3)
    add_dtype_arg(p)
    p.add_argument("--chunk", type=int, default=64)
    add_timing_args(p)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import gdp_jax
    import gdp_jax.chunk_o_pallas as chunk_o_pallas
    from bench_chunk_o import make_segments, make_set

    (shp,) = parse_shapes(args.shape, {})
    configs = parse_named_configs(args.configs)
    dtype = jnp_dtype(args.dtype)
    B, T, H, K, V, M = (shp[c] for c in "BTHKVM")
    on_cpu = jax.devices()[0].platform == "cpu"

    keys = jax.random.split(jax.random.PRNGKey(0), args.sets)
    sets = [make_set(key, shp, dtype, args.chunk) for key in keys]
    segment_ids = None
    if shp["segs"]:
        segment_ids = jnp.asarray(make_segments(np.random.default_rng(0), B, T, shp["segs"])[0])
    inputs = [(q, k, v, h, g, segment_ids) for q, k, v, h, _, g in sets]
    q, k, v, h, g, _ = inputs[0]
    bandwidth = copy_bandwidth(args, on_cpu)["GBps"] * 1e9
    floor_ms = (nbytes(q, k, v, h, g, segment_ids) + B * T * H * V * q.dtype.itemsize) / bandwidth * 1e3
    print(f"{shape_label(shp)} {args.dtype} on {jax.devices()[0].device_kind}, jax {jax.__version__}; "
          f"copy bandwidth {bandwidth / 1e12:.3f} TB/s, floor {floor_ms:.4f} ms")

    default_config = chunk_o_pallas.kernel_config
    implementation = "interpret" if on_cpu else "pallas"   # on a CPU only the script's logic is checked
    times = {name: [] for name in configs}
    reference_out = None
    worst_error = {}
    monitor = GpuMonitor() if not on_cpu else None   # SM clock and power cap during each loop
    try:
        for round_ in range(args.rounds):
            for name, overrides in configs.items():
                # chunk_o_pallas looks kernel_config up when it traces, so a fresh jit picks this up.
                chunk_o_pallas.kernel_config = functools.partial(default_config, **overrides)
                fn = jax.jit(lambda q, k, v, h, g, s: gdp_jax.chunk_gdp_fwd_o(
                    q, k, v, h, g, segment_ids=s, chunk_size=args.chunk, num_householder=M,
                    implementation=implementation))
                if round_ == 0:
                    # A fast config is worthless if it is wrong: every config's output must match
                    # the default's (the same math, only tiling and accumulation order differ).
                    out = np.asarray(fn(*inputs[0]), np.float32)
                    if reference_out is None:
                        reference_out = out
                    worst_error[name] = float(np.max(np.abs(out - reference_out))
                                              / (np.max(np.abs(reference_out)) + 1e-30))
                phase = f"{name}/{round_}"
                ms, _ = time_jax(fn, inputs, target_s=args.target_ms / 1e3, reps=args.reps,
                                 max_iters=args.max_iters,
                                 during=monitor.phase(phase) if monitor else None)
                times[name].append(ms)
                print(f"round {round_} {name:>16s} {ms:.4f} ms  {floor_ms / ms:6.1%}  "
                      f"{GpuMonitor.describe(monitor and monitor.summary(phase))}", flush=True)
    finally:
        chunk_o_pallas.kernel_config = default_config
        if monitor:
            monitor.close()
    print(f"\n{'config':>16s} {'median ms':>9s} {'min':>7s} {'max':>7s} {'% floor':>7s} "
          f"{'rel err':>8s}  overrides")
    for name, ms in times.items():
        median = statistics.median(ms)
        print(f"{name:>16s} {median:9.4f} {min(ms):7.4f} {max(ms):7.4f} {floor_ms / median:7.1%} "
              f"{worst_error.get(name, float('nan')):8.1e}  {configs[name] or '-'}")
    return {name: {"median_ms": statistics.median(ms), "rel_err": worst_error.get(name)}
            for name, ms in times.items()}


if __name__ == "__main__":
    main()
