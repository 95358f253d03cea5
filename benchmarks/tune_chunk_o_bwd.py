#!/usr/bin/env python3
"""Sweep the chunk_o backward's structures (BwdKernelConfig.variant / roles) x warps x stages on a GPU.

One command, bounded time (issue 3). Run on the GPU box from the repo root:

    PYTHONPATH=. python3 benchmarks/tune_chunk_o_bwd.py --out $OUT/tune_bwd.json          # ~5 min
    PYTHONPATH=. python3 benchmarks/tune_chunk_o_bwd.py --shapes tiny --interpret \\
        --budget-s 240 --target-ms 1 --reps 1 --max-configs 5 --top 2                   # CPU logic check

Plan. Shapes are bench_chunk_o_bwd's (default: B8 T4096 H16 K=V=128 M=2 first, then B4 T8192 H32
K=V=64 M=2, then M=3 and M=1 at K=V=128). The first shape gets the whole candidate list (``candidates``: every variant, warps 4/8,
stages 1-3, a few block and role choices, in order of expected value); every later shape gets the
current default (``bwd_kernel_config``) plus the ``--top`` fastest correct configs of the first
(``--full``: the whole list everywhere). Per shape, once: input sets (as bench_chunk_o_bwd), the
Pallas forward's time (for "x fwd") and the jnp VJP on set 0 (the error reference). Per config: jit,
compile and run on set 0 (max relative error of the five cotangents against the jnp VJP; over
``--max-err`` or non-finite marks it BAD, never promoted), then time it (rotated sets, median of
``--reps`` loops of ~``--target-ms``). Any exception (a compile failure such as shared memory
overflow included) is caught, printed and recorded; the sweep goes on.

Time. ``--budget-s`` (default 300) bounds the whole run from the start of main: a config is started
only if the time left exceeds the slowest config so far (at least ``--min-config-s``), a shape's setup
only if some config could follow. What did not fit is listed as skipped. Each config costs about
5-15 s on an H200 (mostly compilation); setup ~15 s per shape.

Output: a table (shape, variant, config, ms, x forward, % of floor, max rel err) sorted by shape then
time, and JSON at --out with every row, the plan, the copy bandwidth and what was skipped.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import sys
import time
import traceback

from bench_common import (add_dtype_arg, add_timing_args, jnp_dtype, copy_bandwidth, fmt as _fmt,
                          log, parse_shapes as _parse_shapes, relative_error_fn, shape_label,
                          short_exc, time_jax, print_table)
from bench_chunk_o_bwd import SHAPE_SETS as _BENCH_SHAPES, backward_bytes, make_set, xla_vjp_fn

SHAPE_SETS = dict(_BENCH_SHAPES)
# The headline shape first: it gets the whole candidate list; then the worst ratio (K = V = 64).
SHAPE_SETS["default"] = [
    dict(B=8, T=4096, H=16, K=128, V=128, M=2),
    dict(B=4, T=8192, H=32, K=64, V=64, M=2),
    dict(B=8, T=4096, H=16, K=128, V=128, M=3),
    dict(B=8, T=4096, H=16, K=128, V=128, M=1),
]


def candidates():
    """Overrides of bwd_kernel_config's choice, most promising first (see chunk_o_bwd_pallas_split)."""
    c = []
    add = lambda **kw: c.append(kw)
    # roles, one program per copy for dk/dv: no spill at 4 warps offline, 2 programs per SM.
    for stages in (1, 2, 3):
        add(variant="roles", roles="dh|dq|dkv/m", num_warps=4, num_stages=stages)
    add(variant="roles", roles="dh+dq|dkv/m", num_warps=4, num_stages=1)
    add(variant="split", roles="dq|dkv/m", num_warps=4, num_stages=1)
    add(variant="fused", num_warps=8, num_stages=1)                  # the current default
    add(variant="roles", roles="dh|dq|dkv/m", num_warps=8, num_stages=1)
    add(variant="roles", roles="dh|dq|dkv/m", num_warps=4, num_stages=1, block_v=64)
    add(variant="split", roles="dq|dkv/m", num_warps=4, num_stages=2)
    add(variant="split", roles="dq|dkv/m", num_warps=4, num_stages=1, dh_block_v=64, dh_num_warps=4)
    add(variant="roles", roles="dh+dq|dkv", num_warps=4, num_stages=2)
    add(variant="roles", roles="dh|dq|dkv", num_warps=4, num_stages=1)
    add(variant="split_state", roles="dq|dkv/m", num_warps=4, num_stages=1)
    add(variant="split", roles="dq+dkv", num_warps=8, num_stages=1)
    add(variant="fused", num_warps=4, num_stages=1)
    add(variant="roles", roles="dh+dq|dkv", num_warps=8, num_stages=1)
    add(variant="roles", roles="dh|dq|dkv/m", num_warps=8, num_stages=2)
    add(variant="fused", num_warps=8, num_stages=2)
    add(variant="roles", roles="dh|dq|dkv/m", num_warps=4, num_stages=1, block_k=64, block_v=64)
    add(variant="split_state", roles="dq|dkv/m", num_warps=4, num_stages=2)
    return c


def make_config(base, over):
    cfg = dataclasses.replace(base, **over)
    if cfg.variant == "fused":                                       # fields the fused kernel ignores
        cfg = dataclasses.replace(cfg, roles="", dh_block_k=0, dh_block_v=0, dh_num_warps=0,
                                  dh_num_stages=0)
    return cfg


def label(cfg, base):
    """Compact text for a config: variant[roles] w s, then fields that differ from the default."""
    text = cfg.variant + (f"[{cfg.resolved_roles()}]" if cfg.variant != "fused" else "")
    text += f" w{cfg.num_warps} s{cfg.num_stages}"
    if (cfg.block_k, cfg.block_v) != (base.block_k, base.block_v):
        text += f" bk{cfg.block_k} bv{cfg.block_v}"
    if cfg.dh_block_k or cfg.dh_block_v:
        text += f" dh{cfg.dh_block_k or cfg.block_k}x{cfg.dh_block_v or cfg.block_v}"
    if cfg.dh_num_warps or cfg.dh_num_stages:
        text += f" dh:w{cfg.dh_num_warps or cfg.num_warps}s{cfg.dh_num_stages or cfg.num_stages}"
    return text


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="default",
                   help="a named set (default, quick, tiny) or 'B=..,T=..,H=..,K=..[,V=..],M=..[,segs=..];...'")
    add_dtype_arg(p)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--no-g", action="store_true", help="without the decay g")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="wall-clock bound on the whole run, seconds (default 300)")
    p.add_argument("--min-config-s", type=float, default=8.0,
                   help="assumed cost of a config before one has been measured")
    p.add_argument("--top", type=int, default=4, help="configs of the first shape tried on later shapes")
    p.add_argument("--full", action="store_true", help="every candidate on every shape (budget permitting)")
    p.add_argument("--max-configs", type=int, default=0, help="cap on candidates per shape (0: none)")
    p.add_argument("--variants", default="", help="comma-separated variants to keep (default all)")
    p.add_argument("--max-err", type=float, default=2e-2, help="max relative error for a config to count")
    p.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU logic check only)")
    add_timing_args(p, reps=3, target_ms=40.0, max_iters=200, copy_mb=1024.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="print the candidate list and exit")
    p.add_argument("--out", default=None, help="write JSON results here")
    args = p.parse_args(argv)
    args.sets = max(3, args.sets)
    return args


def main(argv=None):
    t_start = time.perf_counter()
    args = parse_args(argv)
    cands = candidates()
    if args.variants:
        keep = {v.strip() for v in args.variants.split(",")}
        cands = [c for c in cands if c["variant"] in keep]
    if args.max_configs:
        cands = cands[:args.max_configs]
    if args.list:
        for i, c in enumerate(cands):
            print(i, c)
        return None
    shapes = _parse_shapes(args.shapes, SHAPE_SETS)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from gdp_jax.chunk_o_bwd_pallas import bwd_kernel_config, chunk_o_bwd_pallas
    from gdp_jax.chunk_o_pallas import chunk_o_pallas

    elapsed = lambda: time.perf_counter() - t_start
    dtype = jnp_dtype(args.dtype)
    dev = jax.devices()[0]
    bt = args.chunk
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                jax=jax.__version__, device=str(getattr(dev, "device_kind", dev)), platform=dev.platform,
                python=platform.python_version(), args=vars(args))
    log(f"jax {meta['jax']} on {meta['device']}; dtype {args.dtype}; chunk {bt}; budget {args.budget_s:.0f} s; "
        f"{len(cands)} candidates; interpret {args.interpret}")
    bw = copy_bandwidth(args, dev.platform == "cpu")
    log(f"copy bandwidth {bw['GBps']:.0f} GB/s")
    bw_Bps = bw["GBps"] * 1e9
    relerr = relative_error_fn()
    rng = np.random.default_rng(args.seed)
    timing = dict(target_s=args.target_ms / 1e3, reps=args.reps, max_iters=args.max_iters)

    rows, skipped, slowest = [], [], args.min_config_s
    headline_ranked = []                                             # overrides, fastest first
    for si, shp in enumerate(shapes):
        B, T, H, K, V, M = (shp[c] for c in "BTHKVM")
        shape = shape_label(shp)
        base = bwd_kernel_config(K, V, bt, M, jnp.dtype(dtype).itemsize)
        if si == 0 or args.full:
            plan = [dict(c) for c in cands]
        else:
            plan = [dict(variant=base.variant, num_warps=base.num_warps, num_stages=base.num_stages)]
            plan += headline_ranked[:args.top]
        plan = [o for o in _dedupe(plan, base, make_config) if _fits(make_config(base, o), K, V)]
        if elapsed() + 15.0 + slowest > args.budget_s:
            skipped += [dict(shape=shape, config=label(make_config(base, o), base)) for o in plan]
            log(f"\n=== {shape}: skipped (budget)")
            continue
        log(f"\n=== [{si + 1}/{len(shapes)}] {shape} {args.dtype}: {len(plan)} configs, "
            f"{elapsed():.0f} s elapsed")
        kw = dict(scale=K ** -0.5, chunk_size=bt, num_householder=M)
        try:
            keys = jax.random.split(jax.random.PRNGKey(args.seed * 1000 + si), args.sets)
            sets = [make_set(keys[i], shp, dtype, bt, not args.no_g, shp["segs"], rng)
                    for i in range(args.sets)]
            q, k, v, h, g, runs, do = sets[0]
            bytes_bwd = backward_bytes(q, k, v, h, g, runs, do)
            floor_ms = bytes_bwd / bw_Bps * 1e3
            fwd = jax.jit(lambda q, k, v, h, g, runs, do: chunk_o_pallas(
                q, k, v, h, g, runs, interpret=args.interpret, **kw))
            fwd_ms, _ = time_jax(fwd, sets, **timing)

            ref = jax.block_until_ready(jax.jit(xla_vjp_fn(**kw))(*sets[0]))
        except Exception as e:  # noqa: BLE001
            log(f"setup failed: {short_exc(e)}")
            traceback.print_exc(limit=4)
            rows.append(dict(shape=shape, error=f"setup: {short_exc(e)}"))
            continue
        log(f"floor {floor_ms:.4g} ms ({bytes_bwd / 1e6:.0f} MB); forward {fwd_ms:.4g} ms")

        shape_rows = []
        for i, over in enumerate(plan):
            cfg = make_config(base, over)
            name = label(cfg, base)
            if elapsed() + slowest > args.budget_s:
                skipped += [dict(shape=shape, config=label(make_config(base, o), base)) for o in plan[i:]]
                log(f"  budget: {len(plan) - i} configs skipped")
                break
            row = dict(shape=shape, **shp, dtype=args.dtype, chunk=bt, variant=cfg.variant,
                       roles=cfg.resolved_roles() if cfg.variant != "fused" else "", config=name,
                       overrides=over, full_config=dataclasses.asdict(cfg), fwd_ms=fwd_ms,
                       floor_ms=floor_ms, default=cfg == base)
            t0 = time.perf_counter()
            try:
                fn = jax.jit(lambda q, k, v, h, g, runs, do, cfg=cfg: chunk_o_bwd_pallas(
                    q, k, v, h, g, runs, do, interpret=args.interpret, config=cfg, **kw))
                out = jax.block_until_ready(fn(*sets[0]))
                errs = {n: float(relerr(a, b)) for n, a, b in zip(("dq", "dk", "dv", "dh", "dg"), out, ref)
                        if a is not None}
                finite = all(bool(jnp.all(jnp.isfinite(a))) for a in out if a is not None)
                del out
                row.update(relerr=errs, relerr_max=max(errs.values()), finite=finite)
                row["ok"] = finite and row["relerr_max"] <= args.max_err
                ms, info = time_jax(fn, sets, **timing)
                row.update(ms=ms, timing=info, x_fwd=ms / fwd_ms, pct_floor=100.0 * floor_ms / ms)
                log(f"  {name:55s} {ms:8.4g} ms  x{ms / fwd_ms:5.2f} fwd  {row['pct_floor']:5.1f} % floor  "
                    f"err {row['relerr_max']:.1e}{'' if row['ok'] else '  BAD'}")
            except Exception as e:  # noqa: BLE001
                row["error"] = short_exc(e)
                log(f"  {name:55s} FAILED {short_exc(e, 300)}")
            row["wall_s"] = time.perf_counter() - t0
            slowest = max(slowest, row["wall_s"])
            shape_rows.append(row)
            rows.append(row)
            gc.collect()
        if si == 0:
            good = sorted((r for r in shape_rows if r.get("ok")), key=lambda r: r["ms"])
            headline_ranked = [r["overrides"] for r in good]
        del sets, ref
        gc.collect()

    result = dict(meta=meta, copy_bandwidth=bw, candidates=cands, rows=rows, skipped=skipped,
                  total_s=elapsed())
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
        log(f"\nwrote {args.out}")
    print_results(rows, meta, bw, skipped, elapsed())
    return result


def _fits(cfg, key_dim, value_dim):
    """Block sizes that divide K and V (the kernel would raise ValueError otherwise)."""
    return all(width % block == 0 and block <= width for block, width in (
        (cfg.block_k, key_dim), (cfg.block_v, value_dim), (cfg.dh_block_k or cfg.block_k, key_dim),
        (cfg.dh_block_v or cfg.block_v, value_dim)))


def _dedupe(plan, base, make):
    seen, out = set(), []
    for over in plan:
        key = make(base, over)
        if key not in seen:
            seen.add(key)
            out.append(over)
    return out


def print_results(rows, meta, bw, skipped, total_s):
    hdr = ["shape", "variant", "config", "ms", "x fwd", "% floor", "max rel err", ""]
    lines = []
    order = {s: i for i, s in enumerate(dict.fromkeys(r["shape"] for r in rows))}
    for r in sorted(rows, key=lambda r: (order[r["shape"]], r.get("ms", float("inf")))):
        if "config" not in r:
            lines.append([r["shape"], "-", "-", "-", "-", "-", "-", r.get("error", "")[:60]])
            continue
        note = ("default " if r.get("default") else "") + (
            "FAILED " + r["error"][:60] if "error" in r else ("" if r.get("ok") else "BAD"))
        lines.append([r["shape"], r["variant"], r["config"], _fmt(r.get("ms"), ".4g"),
                      _fmt(r.get("x_fwd"), ".2f"), _fmt(r.get("pct_floor"), ".0f"),
                      _fmt(r.get("relerr_max"), ".1e"), note.strip()])
    print_table(hdr, lines,
                f"device {meta['device']} | jax {meta['jax']} | copy bandwidth {bw['GBps']:.0f} GB/s | "
                f"{total_s:.0f} s | x fwd = backward / Pallas forward; % floor = bandwidth floor / backward")
    if skipped:
        print(f"skipped for the time budget: {len(skipped)} configs "
              f"({', '.join(sorted({s['shape'] for s in skipped}))})")
    sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    main()
