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

Inputs: common.make_problems (op "chunk_o": q, k, v, h, g; op "full": q, k, v, g, beta), made on
device 0. For each shape and layout (``data``: B split over N devices; ``model``: H split over N devices):
  * sharded   : the wrapper on the whole problem, inputs already laid out as it wants (jit);
  * local_1gpu: the plain op on ONE device on one device's share (B/N rows, or H/N heads): the ideal
                per-device time. scaling efficiency = local_1gpu / sharded (1.0 = perfect);
  * full_1gpu : the plain op on one device on the whole problem. speedup = full_1gpu / sharded (ideal N);
  * unwrapped : the plain op under jit on the same sharded inputs (what issue 7 reports: XLA gathers
                every operand to every device), with the all-gathers counted in its compiled HLO.
The sharded program's compiled HLO is scanned too: "collectives" should be [] for the forward and
for the backward. Times: common.time_jax (back-to-back calls for about --target-ms after
block_until_ready, median of --reps loops). Nothing is asserted; failures are printed and the run
goes on. The table is printed last, JSON at --out.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import traceback


from common import (add_dtype_arg, add_timing_args, fmt, log, make_problems,
                    parse_shapes, print_table, run_meta, shape_label, short_exc, time_jax,
                    write_json)

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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", default="chunk_o", choices=["chunk_o", "full"],
                    help="chunk_o: sharded_chunk_gdp_fwd_o (default); full: the full op "
                         "sharded_chunk_gated_delta_product")
    ap.add_argument("--shapes", default="default",
                    help=f"one of {sorted(SHAPE_SETS)} or 'B=..,T=..,H=..,K=..[,V=..],M=..;...'")
    ap.add_argument("--devices", type=int, default=2, help="GPUs to shard over (default 2)")
    ap.add_argument("--impl", default=None, help="implementation (default: pallas on GPU, xla on CPU)")
    add_dtype_arg(ap)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--layouts", default="data,model", help="comma list of data, model")
    ap.add_argument("--no-grad", action="store_true", help="forward only")
    add_timing_args(ap, sets=1, reps=5, target_ms=100.0, max_iters=100, copy_mb=None)
    ap.add_argument("--cpu-devices", type=int, default=0,
                    help="fake N CPU devices (XLA_FLAGS) to check the script without GPUs")
    ap.add_argument("--out", default=None, help="write results as JSON here")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.cpu_devices:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.cpu_devices}")
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import gdp_jax
    from gdp_jax import sharded_chunk_gated_delta_product, sharded_chunk_gdp_fwd_o

    n = args.devices
    devices = jax.devices()
    if len(devices) < n:
        sys.exit(f"needs {n} devices, have {len(devices)}: {devices}")
    impl = args.impl or ("pallas" if jax.default_backend() == "gpu" else "xla")
    bt = args.chunk_size
    mesh = Mesh(np.array(devices[:n]), ("x",))
    meta = run_meta(args, op=args.op, backend=jax.default_backend(),
                    devices=[str(d) for d in devices[:n]], impl=impl)
    log(f"jax {meta['jax']} on {n} x {meta['device']}; op {args.op}; impl {impl}; dtype {args.dtype}")
    timing = dict(target_s=args.target_ms / 1e3, reps=args.reps, max_iters=args.max_iters)

    def make_inputs(shape, device):
        """chunk_o: [q, k, v, h, g] (g chunk-local log2 cumsums); full: [q, k, v, g, beta]
        (g the natural-log gate per token); on ``device``."""
        with jax.default_device(device):
            (p,) = make_problems(shape, op="chunk_o" if args.op == "chunk_o" else "full",
                                 dtype=args.dtype, sets=1, chunk_size=bt)
        arrays = [p.q, p.k, p.v, p.h, p.g] if args.op == "chunk_o" else [p.q, p.k, p.v, p.g, p.beta]
        return [jax.device_put(x, device) for x in arrays]

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
        return time_jax(fn, [inputs], **timing)[0]

    def collectives(fn, inputs):
        text = fn.lower(*inputs).compile().as_text()
        return [line.strip()[:160] for line in text.splitlines()
                if any(re.search(rf"\b{c}(-start)?\(", line) for c in COLLECTIVES)]

    op_kw = dict(chunk_size=bt, implementation=impl)
    loss = lambda fn: (lambda *a: jnp.sum(jnp.square(fn(*a).astype(jnp.float32))))
    modes = ["fwd"] if args.no_grad else ["fwd", "fwd+bwd"]
    results = []
    for shape in parse_shapes(args.shapes, SHAPE_SETS):
        for layout in args.layouts.split(","):
            in_specs, b_axis, h_axis = specs(layout)
            split = "B" if layout == "data" else "H"
            if shape[split] % n:
                log(f"skip {shape_label(shape)} {layout}: {split} not divisible by {n}")
                continue
            local_shape = dict(shape, **{split: shape[split] // n})
            for mode in modes:
                row = dict(shape=shape_label(shape), layout=layout, mode=mode, devices=n)
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
                        row["unwrapped_error"] = short_exc(e, 300)
                    ref = np.asarray(jax.jit(plain_o)(*full), np.float32)
                    got = np.asarray(jax.jit(sharded_o)(*sharded_in), np.float32)
                    row["rel_err_vs_1gpu"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                    del full, sharded_in, local_in
                except Exception as e:  # noqa: BLE001
                    row["error"] = short_exc(e, 500)
                    traceback.print_exc()
                results.append(row)
                log(f"{row['shape']} {layout} {mode}: " + ", ".join(
                    f"{k} {fmt(v, '.4g') if isinstance(v, float) else v}" for k, v in row.items()
                    if k not in ("shape", "layout", "mode", "devices", "collectives")))

    write_json(args.out, dict(meta=meta, results=results))
    hdr = ["shape", "layout", "mode", "sharded ms", "local 1 GPU", "full 1 GPU", "efficiency",
           "speedup", "unwrapped ms", "collectives", "rel err"]
    lines = []
    for r in results:
        if "error" in r:
            lines.append([r["shape"], r["layout"], r["mode"], "ERROR " + r["error"][:60]] + [""] * 7)
            continue
        lines.append([r["shape"], r["layout"], r["mode"], fmt(r["sharded_ms"]), fmt(r["local_1gpu_ms"]),
                      fmt(r["full_1gpu_ms"]), fmt(r["scaling_efficiency"], ".2f"),
                      fmt(r["speedup_vs_1gpu"], ".2f"), fmt(r.get("unwrapped_ms")),
                      str(len(r["collectives"])), fmt(r["rel_err_vs_1gpu"], ".1e")])
    print_table(hdr, lines, f"{args.op} over {n} x {meta['device']} | jax {meta['jax']} | {impl} "
                            f"{args.dtype} | efficiency = local 1 GPU / sharded (1.0 perfect); "
                            "collectives should be 0")
    return results


if __name__ == "__main__":
    main()
