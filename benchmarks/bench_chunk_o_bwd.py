#!/usr/bin/env python3
"""Benchmark the fused Pallas backward of chunk_gdp_fwd_o against the Pallas forward and the jnp VJP.

Run on a GPU box from the repo root:

    PYTHONPATH=. python3 benchmarks/bench_chunk_o_bwd.py --out $OUT/bwd.json        # default shapes, bf16
    PYTHONPATH=. python3 benchmarks/bench_chunk_o_bwd.py --shapes tiny --interpret  # CPU logic check

What it times, per shape (each jitted; all take the same rotated input sets):
  * pallas_bwd: gdp_jax.chunk_o_bwd_pallas.chunk_o_bwd_pallas -> (dq, dk, dv, dh, dg);
  * pallas_fwd: gdp_jax.chunk_o_pallas.chunk_o_pallas -> o (the forward, for scale);
  * xla_vjp:    jax.vjp(chunk_o_xla, q, k, v, h, g)[1](do), i.e. the backward the op used before the
                kernel (XLA drops forward work the cotangents don't need);
  * op_bwd (with --op): the backward of the public op, jax.vjp(chunk_gdp_fwd_o(implementation="pallas")),
                forward included (whatever chunk_o.py's custom_vjp currently runs).

Method: `--sets` (default 3) independent input sets are rotated through every timed loop so the L2 never
holds a whole working set; each function is compiled and run once per set (warm-up), then timed as the
wall clock of N back-to-back calls ended by block_until_ready, divided by N; the median of `--reps`
such loops is reported. N is picked so one loop lasts about `--target-ms`.

Bandwidth floor of the backward = bytes of (q, k, v, h, g, do [, runs]) read once + (dq, dk, dv, dh, dg)
written once, over the device copy bandwidth measured here (a large elementwise jnp copy, read + write
bytes / time). "% floor" = floor / pallas_bwd time (100 % = running at copy bandwidth). The forward's
floor (inputs read once + o written once) is reported too.

Sanity: relative Frobenius error of each Pallas cotangent against xla_vjp on input set 0 (max over the
five is in the table). Nothing is asserted: failures are printed and the run goes on. The table is last.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import time
import traceback

from bench_common import (LOG2E, add_dtype_arg, add_timing_args, jnp_dtype, copy_bandwidth,
                          fmt as _fmt, log, nbytes, parse_shapes as _parse_shapes, relative_error_fn,
                          short_exc, shape_label, time_jax, print_table)

SHAPE_SETS = {
    "default": [
        dict(B=8, T=4096, H=16, K=128, V=128, M=1),
        dict(B=8, T=4096, H=16, K=128, V=128, M=2),
        dict(B=8, T=4096, H=16, K=128, V=128, M=3),
        dict(B=4, T=8192, H=32, K=64, V=64, M=2),
    ],
    "quick": [dict(B=8, T=4096, H=16, K=128, V=128, M=2)],
    # Checks the script's logic on a CPU (with --interpret); the numbers mean nothing.
    "tiny": [dict(B=1, T=100, H=2, K=32, V=32, M=2), dict(B=1, T=64, H=2, K=16, V=32, M=1, segs=3)],
}
IMPLS = ("pallas_bwd", "pallas_fwd", "xla_vjp", "op_bwd")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="shape sets: " + "; ".join(f"{k}: " + ", ".join(map(shape_label, v))
                                           for k, v in SHAPE_SETS.items())
        + '.\nCustom: --shapes "B=8,T=4096,H=16,K=128,V=128,M=2,segs=8;B=1,T=512,H=4,K=64,M=1"')
    p.add_argument("--shapes", default="default",
                   help="a named set (default, quick, tiny) or "
                        "'B=..,T=..,H=..,K=..[,V=..],M=..[,segs=..];...'")
    add_dtype_arg(p)
    p.add_argument("--chunk", type=int, default=64, help="chunk size BT (default 64)")
    p.add_argument("--no-g", action="store_true", help="time without the decay g (dg is then not produced)")
    p.add_argument("--op", action="store_true", help="also time the public op's backward (op_bwd)")
    p.add_argument("--config", default="",
                   help="override the backward's launch config, e.g. 'block_k=64,block_v=64,num_warps=4' "
                        "or 'variant=roles,roles=dh|dq|dkv/m,num_warps=4' (fields of "
                        "gdp_jax.chunk_o_bwd_pallas.BwdKernelConfig; benchmarks/tune_chunk_o_bwd.py sweeps them)")
    p.add_argument("--interpret", action="store_true",
                   help="run the Pallas kernels in Pallas' interpreter (CPU logic check only)")
    add_timing_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write JSON results here")
    args = p.parse_args(argv)
    args.sets = max(3, args.sets)
    return args


def _config_value(text):
    """An int field of BwdKernelConfig, or a string one (variant, roles)."""
    try:
        return int(text)
    except ValueError:
        return text


def backward_bytes(q, k, v, h, g, runs, do):
    """Bytes the backward must move: its inputs read once, dq, dk, dv, dh (primal dtypes) and dg
    (float32) written once."""
    return nbytes(q, k, v, h, g, runs, do) + nbytes(q, k, v, h) + (0 if g is None else g.size * 4)


def xla_vjp_fn(**kw):
    """(q, k, v, h, g, runs, do) -> (dq, dk, dv, dh, dg or None): the VJP of the jnp path, chunk_o_xla
    with keyword arguments ``kw`` (what implementation="xla" differentiates)."""
    import jax
    from gdp_jax.chunk_o import chunk_o_xla

    def xla_vjp(q, k, v, h, g, runs, do):
        if g is None:
            _, vjp = jax.vjp(lambda q, k, v, h: chunk_o_xla(q, k, v, h, None, runs, **kw), q, k, v, h)
            return tuple(vjp(do)) + (None,)
        _, vjp = jax.vjp(lambda *a: chunk_o_xla(*a, runs, **kw), q, k, v, h, g)
        return vjp(do)
    return xla_vjp


def make_set(key, shp, dtype, bt, gated, segs, rng):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from gdp_jax.segments import segment_runs

    B, T, H, K, V, M = (shp[c] for c in "BTHKVM")
    NT = -(-T // bt)

    @jax.jit
    def gen(key):
        kq, kk, kv, kh, kg, kd = jax.random.split(key, 6)
        q = jax.random.normal(kq, (B, T, H, K), jnp.float32).astype(dtype)
        k = jax.random.normal(kk, (B, T * M, H, K), jnp.float32)
        k = (k * jax.lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True) + 1e-6)).astype(dtype)
        v = (0.1 * jax.random.normal(kv, (B, T * M, H, V), jnp.float32)).astype(dtype)
        h = (0.1 * jax.random.normal(kh, (B, NT, H, K, V), jnp.float32)).astype(dtype)
        g_raw = -jax.nn.softplus(jax.random.normal(kg, (B, T, H), jnp.float32) - 2.0)
        x = jnp.pad(g_raw * LOG2E, ((0, 0), (0, NT * bt - T), (0, 0)))
        g = jnp.cumsum(x.reshape(B, NT, bt, H), axis=2).reshape(B, NT * bt, H)[:, :T]
        do = jax.random.normal(kd, (B, T, H, V), jnp.float32).astype(dtype)
        return q, k, v, h, g, do

    q, k, v, h, g, do = jax.block_until_ready(gen(key))
    runs = None
    if segs:
        ids = np.zeros((B, T), np.int32)
        for b in range(B):
            cuts = np.sort(rng.choice(np.arange(1, T), size=min(segs, T) - 1, replace=False))
            ids[b] = np.searchsorted(cuts, np.arange(T), side="right")
        runs = segment_runs(jnp.asarray(ids))
    return q, k, v, h, (g if gated else None), runs, do


def main(argv=None):
    args = parse_args(argv)
    shapes = _parse_shapes(args.shapes, SHAPE_SETS)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from gdp_jax.chunk_o_bwd_pallas import bwd_kernel_config, chunk_o_bwd_pallas
    from gdp_jax.chunk_o_pallas import chunk_o_pallas

    dtype = jnp_dtype(args.dtype)
    dev = jax.devices()[0]
    on_cpu = dev.platform == "cpu"
    bt = args.chunk
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                jax=jax.__version__, device=str(getattr(dev, "device_kind", dev)), platform=dev.platform,
                python=platform.python_version(), host=platform.node(), args=vars(args))
    log(f"jax {meta['jax']} on {meta['device']} ({dev.platform}); dtype {args.dtype}; chunk {bt}; "
        f"g {'off' if args.no_g else 'on'}; sets {args.sets}; interpret {args.interpret}")
    if on_cpu and not args.interpret:
        log("note: no GPU; the Pallas kernels need --interpret here")

    bw = copy_bandwidth(args, on_cpu)
    log(f"copy bandwidth: {bw['GBps']:.0f} GB/s ({bw['bytes'] / 1e6:.0f} MB moved in {bw['jax_ms']:.3f} ms)")
    bw_Bps = bw["GBps"] * 1e9

    relerr = relative_error_fn()
    rng = np.random.default_rng(args.seed)
    rows = []
    for si, shp in enumerate(shapes):
        B, T, H, K, V, M = (shp[c] for c in "BTHKVM")
        label = shape_label(shp)
        kw = dict(scale=K ** -0.5, chunk_size=bt, num_householder=M)
        cfg = bwd_kernel_config(K, V, bt, M, jnp.dtype(dtype).itemsize)
        if args.config:
            cfg = dataclasses.replace(cfg, **{key.strip(): _config_value(val.strip()) for key, val in
                                              (item.split("=", 1) for item in args.config.split(","))})
        row = dict(shape=label, dtype=args.dtype, chunk=bt, gated=not args.no_g, **shp,
                   bwd_config=dataclasses.asdict(cfg))
        log(f"\n=== [{si + 1}/{len(shapes)}] {label} {args.dtype} === bwd config {row['bwd_config']}")
        t_shape = time.perf_counter()
        try:
            keys = jax.random.split(jax.random.PRNGKey(args.seed * 1000 + si), args.sets)
            sets = [make_set(keys[i], shp, dtype, bt, not args.no_g, shp["segs"], rng)
                    for i in range(args.sets)]
        except Exception as e:  # noqa: BLE001
            log("input generation failed:", short_exc(e))
            rows.append(dict(row, error=short_exc(e)))
            continue

        q, k, v, h, g, runs, do = sets[0]
        row["bwd_bytes"] = backward_bytes(q, k, v, h, g, runs, do)
        row["fwd_bytes"] = nbytes(q, k, v, h, g, runs) + nbytes(do)        # o has do's size and dtype
        row["bwd_floor_ms"] = row["bwd_bytes"] / bw_Bps * 1e3
        row["fwd_floor_ms"] = row["fwd_bytes"] / bw_Bps * 1e3
        log(f"backward moves {row['bwd_bytes'] / 1e6:.1f} MB at best -> floor {row['bwd_floor_ms']:.4g} ms; "
            f"forward {row['fwd_bytes'] / 1e6:.1f} MB -> {row['fwd_floor_ms']:.4g} ms")

        def op_bwd(q, k, v, h, g, runs, do):
            from gdp_jax import chunk_gdp_fwd_o
            # runs (non-decreasing run numbers) are valid segment ids themselves.
            impl = "interpret" if args.interpret else "pallas"
            f = lambda *a: chunk_gdp_fwd_o(*a, segment_ids=runs, implementation=impl, **kw)
            primals = (q, k, v, h) if g is None else (q, k, v, h, g)
            if g is None:
                f = lambda q, k, v, h, _f=f: _f(q, k, v, h, None)
            _, vjp = jax.vjp(f, *primals)
            return vjp(do)

        fns = dict(
            pallas_bwd=jax.jit(lambda q, k, v, h, g, runs, do: chunk_o_bwd_pallas(
                q, k, v, h, g, runs, do, interpret=args.interpret, config=cfg, **kw)),
            pallas_fwd=jax.jit(lambda q, k, v, h, g, runs, do: chunk_o_pallas(
                q, k, v, h, g, runs, interpret=args.interpret, **kw)),
            xla_vjp=jax.jit(xla_vjp_fn(**kw)),
        )
        if args.op:
            fns["op_bwd"] = jax.jit(op_bwd)
        outs = {}
        for name, fn in fns.items():
            try:
                ms, info = time_jax(fn, sets, target_s=args.target_ms / 1e3, reps=args.reps,
                                    max_iters=args.max_iters)
                row[f"{name}_ms"], row[f"{name}_timing"] = ms, info
                floor = row["fwd_floor_ms"] if name == "pallas_fwd" else row["bwd_floor_ms"]
                row[f"{name}_pct_floor"] = 100.0 * floor / ms
                log(f"{name:>10}: {ms:.4g} ms  ({row[f'{name}_pct_floor']:.0f} % of floor, N={info['n']})")
                if name in ("pallas_bwd", "xla_vjp"):
                    outs[name] = jax.block_until_ready(fn(*sets[0]))
            except Exception as e:  # noqa: BLE001
                row[f"{name}_error"] = short_exc(e)
                log(f"{name:>10}: FAILED {short_exc(e)}")
                traceback.print_exc(limit=4)
        if "pallas_bwd_ms" in row and "pallas_fwd_ms" in row:
            row["bwd_over_fwd"] = row["pallas_bwd_ms"] / row["pallas_fwd_ms"]
        if "pallas_bwd_ms" in row and "xla_vjp_ms" in row:
            row["xla_over_pallas"] = row["xla_vjp_ms"] / row["pallas_bwd_ms"]
        if len(outs) == 2:
            try:
                errs = {n: float(relerr(a, b)) for n, a, b in
                        zip(("dq", "dk", "dv", "dh", "dg"), outs["pallas_bwd"], outs["xla_vjp"])
                        if a is not None}
                row["relerr_vs_xla"] = errs
                row["relerr_max"] = max(errs.values())
                row["finite"] = all(bool(jnp.all(jnp.isfinite(a)))
                                    for a in outs["pallas_bwd"] if a is not None)
                log("relerr pallas_bwd vs xla_vjp: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items())
                    + f"; finite {row['finite']}")
            except Exception as e:  # noqa: BLE001
                log("relerr failed:", short_exc(e))
        row["wall_s"] = time.perf_counter() - t_shape
        rows.append(row)
        del sets, outs, fns
        gc.collect()

    result = dict(meta=meta, copy_bandwidth=bw, rows=rows)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
        log(f"\nwrote {args.out}")
    print_results(rows, meta, bw)
    return result


def print_results(rows, meta, bw):
    hdr = ["shape", "dtype", "bwd ms", "% floor", "floor ms", "fwd ms", "bwd/fwd", "xla vjp ms",
           "xla/bwd", "op bwd ms", "relerr max"]
    lines = []
    for r in rows:
        ms = lambda n: _fmt(r.get(f"{n}_ms")) if f"{n}_ms" in r else ("ERR" if f"{n}_error" in r else "-")
        lines.append([r["shape"], r["dtype"], ms("pallas_bwd"), _fmt(r.get("pallas_bwd_pct_floor"), ".0f"),
                      _fmt(r.get("bwd_floor_ms")), ms("pallas_fwd"), _fmt(r.get("bwd_over_fwd"), ".2f"),
                      ms("xla_vjp"), _fmt(r.get("xla_over_pallas"), ".2f"), ms("op_bwd"),
                      _fmt(r.get("relerr_max"), ".2e")])
    print_table(hdr, lines,
                f"device {meta['device']} | jax {meta['jax']} | copy bandwidth {bw['GBps']:.0f} GB/s | "
                "% floor = floor / bwd (floor: inputs + do read once, cotangents written once); "
                "xla/bwd > 1 means the kernel is faster")


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    main()
