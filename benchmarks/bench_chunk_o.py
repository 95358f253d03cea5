#!/usr/bin/env python3
"""Benchmark gdp_jax.chunk_gdp_fwd_o (Pallas and jnp paths) against fla and the bandwidth floor.

Run on a GPU box from the repo root:

    PYTHONPATH=. python benchmarks/bench_chunk_o.py --out $OUT/fwd.json       # headline shapes, bf16
    PYTHONPATH=. python benchmarks/bench_chunk_o.py --bwd --out $OUT/bwd.json # backward
    PYTHONPATH=. python benchmarks/bench_chunk_o.py --rested --shapes "B=2,T=16384,H=16,K=256,V=256,M=2"
    PYTHONPATH=. python benchmarks/bench_chunk_o.py --baseline /tmp/old       # old against new
    PYTHONPATH=. python benchmarks/bench_chunk_o.py --impls pallas,mosaic,xla,fla   # Mosaic beside Triton
    PYTHONPATH=. python benchmarks/bench_chunk_o.py --shapes tiny --impls xla,interpret   # CPU logic check

Modes (inputs: common.make_problems, --sets independent sets rotated through every timed loop so
the L2 never holds a working set; ours jitted and timed by wall clock, fla by CUDA events on the
same buffers through dlpack; common.measure has the method):

* forward (default): chunk_gdp_fwd_o per --impls (pallas, mosaic, xla = the jnp path, interpret,
  mosaic_interpret; "mosaic" gets its own columns, with mosaic/ours < 1 where it is faster), fla's
  chunk_gated_delta_product_fwd_o (also triton.testing.do_bench, JSON only), the bandwidth floor
  (q, k, v, h, g, segment ids read once, o written once, over the copy bandwidth measured here);
  "% floor" = floor / ours, fla/ours > 1 means ours is faster. Relative error of ours against the
  jnp path, and of fla's (unpacked shapes: fla restarts its chunk grid per sequence, so packed
  rows get their own h and g and are timed only). A PNG bar chart beside --out.
* --bwd: forward + backward through jax.vjp of the public op (o and the cotangents of q, k, v, h,
  g for cotangent do) per --impls (mosaic in its own columns), against its floor (the forward's bytes plus the backward's:
  q, k, v, h, g, do read once, dq, dk, dv, dh, dg written once), and the jnp path's VJP; the
  backward kernel alone (ops.chunk_o.pallas_bwd.chunk_o_bwd_pallas; with mosaic in --impls also
  ops.chunk_o.mosaic_bwd.chunk_o_bwd_mosaic) against the backward's floor, and the forward, for
  bwd / fwd. Max relative error of the cotangents against the jnp VJP.
* --rested: ours (and the baseline, and fla) back to back (the forward mode's loops) against
  rested: --bursts loops of about --burst-ms each after --rest idle seconds, so the card starts
  each at full clock; the SM clock and power-cap share of each (nvidia-smi).

--baseline DIR (any mode): DIR holds another version's gdp_jax/ package (common.load_baseline),
timed through its public chunk_gdp_fwd_o in this process, alternated with ours (--rounds rounds,
same inputs); the table gets its time and new/old. Nothing is asserted: a failure is printed and
the run goes on. The table is printed last.
"""
from __future__ import annotations

import argparse
import os
import traceback


from common import (SHAPE_SETS, HEADLINE, GpuMonitor, JaxRunner, Phases, TorchRunner, add_ratios,
                    run_shapes,
                    add_dtype_arg, add_timing_args, chunk_o_bytes, copy_bandwidth, fla_chunk_o_args,
                    floor_ms, fmt, load_baseline, log, make_problems, max_relative_error, measure,
                    ms_cell, on_cpu, parse_shapes, print_table, relative_errors, rested,
                    run_meta, shape_label, shape_sets_epilog, short_exc, time_into_row,
                    timing_kwargs, to_torch, try_load_fla, write_json)

SETS = {"default": HEADLINE, **SHAPE_SETS}
OURS = ("pallas", "xla", "interpret", "mosaic", "mosaic_interpret")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=shape_sets_epilog(SETS))
    p.add_argument("--shapes", default="default", help="a named set or 'B=..,T=..,H=..,K=..[,V=..],M=..[,segs=..];...'")
    add_dtype_arg(p)
    p.add_argument("--chunk", type=int, default=64, help="chunk size (default 64)")
    p.add_argument("--impls", default="pallas,xla,fla",
                   help="comma list of pallas, mosaic, xla, interpret, mosaic_interpret, fla "
                        "(default pallas,xla,fla); 'ours' is the first of pallas, mosaic, "
                        "interpret, mosaic_interpret, xla given")
    p.add_argument("--no-g", action="store_true", help="without the decay g")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--bwd", action="store_true", help="forward + backward (jax.vjp) instead of the forward")
    mode.add_argument("--rested", action="store_true", help="rested card against back to back")
    p.add_argument("--burst-ms", type=float, default=50.0, help="--rested: GPU time of one rested loop")
    p.add_argument("--rest", type=float, default=2.0, help="--rested: idle seconds before each rested loop")
    p.add_argument("--bursts", type=int, default=5, help="--rested: rested loops per measurement")
    p.add_argument("--baseline", default=None,
                   help="directory holding another version's gdp_jax/ package, timed beside ours")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of alternation between ours and the baseline (default 3 with "
                        "--baseline, else 1)")
    add_timing_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write JSON results here")
    p.add_argument("--png", default=None,
                   help="bar chart path (default: --out with .png, if --out is given; 'none' to skip)")
    p.add_argument("--no-do-bench", action="store_true", help="skip triton.testing.do_bench for fla")
    args = p.parse_args(argv)
    args.impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    bad = [i for i in args.impls if i not in OURS + ("fla",)]
    if bad:
        p.error(f"unknown --impls {bad}")
    if args.rounds is None:
        args.rounds = 3 if args.baseline else 1
    return args


# ------------------------------------------------------------------------------------ functions
def forward_fn(module, impl, shp, chunk):
    """jit of module.chunk_gdp_fwd_o(q, k, v, h, g, segment_ids=s) (ours or the baseline's)."""
    import jax
    kw = dict(scale=shp["K"] ** -0.5, chunk_size=chunk, num_householder=shp["M"], implementation=impl)
    return jax.jit(lambda q, k, v, h, g, s: module.chunk_gdp_fwd_o(q, k, v, h, g, segment_ids=s, **kw))


def fwdbwd_fn(module, impl, shp, chunk):
    """jit of (q, k, v, h, g, s, do) -> (o, (dq, dk, dv, dh[, dg])) through jax.vjp of the op."""
    import jax
    kw = dict(scale=shp["K"] ** -0.5, chunk_size=chunk, num_householder=shp["M"], implementation=impl)

    def fwdbwd(q, k, v, h, g, s, do):
        if g is None:
            o, vjp = jax.vjp(lambda q, k, v, h: module.chunk_gdp_fwd_o(
                q, k, v, h, None, segment_ids=s, **kw), q, k, v, h)
        else:
            o, vjp = jax.vjp(lambda *a: module.chunk_gdp_fwd_o(*a, segment_ids=s, **kw),
                             q, k, v, h, g)
        return o, vjp(do)
    return jax.jit(fwdbwd)


def bwd_kernel_fn(impl, shp, chunk):
    """jit of one backward kernel alone (q, k, v, h, g, runs, do) -> (dq, dk, dv, dh, dg): the
    Triton one (impl pallas, interpret) or the Mosaic GPU one (mosaic, mosaic_interpret)."""
    import jax
    from gdp_jax.ops.chunk_o.mosaic_bwd import chunk_o_bwd_mosaic
    from gdp_jax.ops.chunk_o.pallas_bwd import chunk_o_bwd_pallas
    kernel = chunk_o_bwd_mosaic if impl.startswith("mosaic") else chunk_o_bwd_pallas
    kw = dict(scale=shp["K"] ** -0.5, chunk_size=chunk, num_householder=shp["M"],
              interpret=impl in ("interpret", "mosaic_interpret"))
    return jax.jit(lambda q, k, v, h, g, runs, do: kernel(q, k, v, h, g, runs, do, **kw))


def fla_fwd_o_fn(fla, shp, chunk):
    scale, m = shp["K"] ** -0.5, shp["M"]

    def call(q, k, v, h, g, cu, ci):
        return fla.fwd_o(q, k, v, h, g, scale=scale, cu_seqlens=cu, chunk_size=chunk,
                         num_householder=m, chunk_indices=ci)
    return call


def do_bench_rotated(fn, sets):
    import triton
    counter = [0]

    def call():
        fn(*sets[counter[0] % len(sets)])
        counter[0] += 1
    try:
        return float(triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median"))
    except TypeError:  # older triton without return_mode
        return float(triton.testing.do_bench(call, warmup=25, rep=200))


# ----------------------------------------------------------------------------------------- modes
def forward_shape(row, problems, shp, args, ctx):
    import jax
    ours, phases = ctx["ours"], ctx["phases"]
    p0 = problems[0]
    row["bytes"] = chunk_o_bytes(p0)
    row["floor_ms"] = floor_ms(row["bytes"], ctx["bandwidth"])
    log(f"bytes moved (ideal) {row['bytes'] / 1e6:.1f} MB -> floor {row['floor_ms']:.4g} ms")
    sets = [p.chunk_o_args() for p in problems]
    fns = {impl: forward_fn(ctx["gdp_jax"], impl, shp, args.chunk)
           for impl in args.impls if impl in OURS}
    if ctx["baseline"] is not None:
        fns["baseline"] = forward_fn(ctx["baseline"], ours or "xla", shp, args.chunk)
    time_into_row(row, fns, sets, args, phases, floor=row["floor_ms"])
    outs = {}
    for name, fn in fns.items():
        if f"{name}_ms" in row:
            outs[name] = jax.block_until_ready(fn(*sets[0]))
    for name in outs:
        if name != "xla" and "xla" in outs:
            row[f"{name}_relerr_vs_xla"] = max_relative_error(outs[name], outs["xla"])
            log(f"relerr {name} vs xla: {row[f'{name}_relerr_vs_xla']:.3g}")
    if "baseline" in outs and ours in outs:
        row["baseline_relerr"] = max_relative_error(outs[ours], outs["baseline"])
        row["new_over_old"] = row[f"{ours}_ms"] / row["baseline_ms"]
        log(f"new / old {row['new_over_old']:.3f}; relerr new vs old {row['baseline_relerr']:.3g}")
    fla = ctx["fla"]
    if fla is not None:
        try:
            tsets = [fla_chunk_o_args(fla, p, seed=args.seed * 1000 + i)
                     for i, p in enumerate(problems)]
            call = fla_fwd_o_fn(fla, shp, args.chunk)
            name = f"{row['shape']}/fla"
            ms, info = measure(TorchRunner(call, tsets), **timing_kwargs(args),
                               during=phases.during(name))
            row["fla_ms"], row["fla_timing"] = ms, info
            row["fla_pct_floor"] = 100.0 * row["floor_ms"] / ms
            log(f"{'fla':>16}: {ms:.4g} ms, {row['fla_pct_floor']:.1f} % of floor (N={info['n']})")
            phases.record(row, "fla_gpu", name)
            if not args.no_do_bench:
                try:
                    row["fla_do_bench_ms"] = do_bench_rotated(call, tsets)
                    log(f"{'fla':>16}: do_bench median {row['fla_do_bench_ms']:.4g} ms")
                except Exception as e:  # noqa: BLE001
                    log("do_bench failed:", short_exc(e))
            reference = "xla" if "xla" in outs else ours
            if reference in outs and not shp["segs"]:
                o_f = call(*tsets[0]).float()
                o_r = to_torch(fla.torch, outs[reference]).float()
                row[f"fla_relerr_vs_{reference}"] = float((o_f - o_r).norm() / o_r.norm())
                log(f"relerr fla vs {reference}: {row[f'fla_relerr_vs_{reference}']:.3g}")
            del tsets
        except Exception as e:  # noqa: BLE001
            row["fla_error"] = short_exc(e)
            log(f"{'fla':>16}: FAILED {short_exc(e)}")
            traceback.print_exc(limit=4)
        if "fla_ms" in row and f"{ours}_ms" in row:
            row["fla_over_ours"] = row["fla_ms"] / row[f"{ours}_ms"]


def backward_shape(row, problems, shp, args, ctx):
    import jax
    ours, phases = ctx["ours"], ctx["phases"]
    p0 = problems[0]
    fwd_bytes, bwd_bytes = chunk_o_bytes(p0), chunk_o_bytes(p0, backward=True)
    bw = ctx["bandwidth"]
    row.update(fwd_bytes=fwd_bytes, bwd_bytes=bwd_bytes, fwd_floor_ms=floor_ms(fwd_bytes, bw),
               bwd_floor_ms=floor_ms(bwd_bytes, bw), fwdbwd_floor_ms=floor_ms(fwd_bytes + bwd_bytes, bw))
    log(f"floors: forward {row['fwd_floor_ms']:.4g} ms, backward {row['bwd_floor_ms']:.4g} ms, "
        f"both {row['fwdbwd_floor_ms']:.4g} ms")
    sets = [p.chunk_o_args() + (p.do,) for p in problems]
    fns = {impl: fwdbwd_fn(ctx["gdp_jax"], impl, shp, args.chunk)
           for impl in args.impls if impl in OURS}
    if ctx["baseline"] is not None:
        fns["baseline"] = fwdbwd_fn(ctx["baseline"], ours or "xla", shp, args.chunk)
    time_into_row(row, fns, sets, args, phases, suffix="_fwdbwd", floor=row["fwdbwd_floor_ms"])
    if ours is not None:   # the forward alone and the backward kernel alone
        time_into_row(row, {ours: forward_fn(ctx["gdp_jax"], ours, shp, args.chunk)},
                      [p.chunk_o_args() for p in problems], args, phases, suffix="_fwd",
                      floor=row["fwd_floor_ms"])
        tile_widths = all(n >= 16 and not n & (n - 1) for n in (shp["K"], shp["V"]))
        kernel_args = [(p.q, p.k, p.v, p.h, p.g, p.runs, p.do) for p in problems]
        triton = "interpret" if ours in ("interpret", "mosaic_interpret") else "pallas"
        if ours != "xla" and tile_widths:
            time_into_row(row, {"bwd_kernel": bwd_kernel_fn(triton, shp, args.chunk)},
                          kernel_args, args, phases, floor=row["bwd_floor_ms"])
        elif ours != "xla":
            row["bwd_kernel_error"] = "K and V must be powers of two >= 16 for the kernel alone"
        mosaic = next((i for i in ("mosaic", "mosaic_interpret") if i in args.impls), None)
        mosaic_widths = all(n % 64 == 0 and n <= 256 for n in (shp["K"], shp["V"]))
        if mosaic and mosaic_widths and args.chunk == 64 and p0.q.dtype.itemsize == 2:
            time_into_row(row, {"mosaic_bwd_kernel": bwd_kernel_fn(mosaic, shp, args.chunk)},
                          kernel_args, args, phases, floor=row["bwd_floor_ms"])
        if "bwd_kernel_ms" in row and f"{ours}_fwd_ms" in row:
            row["bwd_over_fwd"] = row["bwd_kernel_ms"] / row[f"{ours}_fwd_ms"]
    grads = {name: jax.block_until_ready(fn(*sets[0])[1]) for name, fn in fns.items()
             if f"{name}_fwdbwd_ms" in row}
    if ours in grads and "xla" in grads and ours != "xla":
        errors = relative_errors(grads[ours], grads["xla"])
        row["relerr_vs_xla"] = dict(zip(("dq", "dk", "dv", "dh", "dg"), errors))
        row["relerr_max"] = max(errors)
        log("relerr vs the jnp VJP: " + ", ".join(f"{n} {e:.2e}" for n, e in row["relerr_vs_xla"].items()))
    for name in grads:      # the other kernels (mosaic beside pallas), against the jnp VJP too
        if name not in (ours, "xla", "baseline") and "xla" in grads:
            row[f"{name}_relerr_max"] = max(relative_errors(grads[name], grads["xla"]))
            log(f"{name}: max relerr vs the jnp VJP {row[f'{name}_relerr_max']:.2e}")
    if ours in grads and "xla_fwdbwd_ms" in row and f"{ours}_fwdbwd_ms" in row:
        row["xla_over_ours"] = row["xla_fwdbwd_ms"] / row[f"{ours}_fwdbwd_ms"]
    if ours in grads and "baseline" in grads:
        row["baseline_relerr"] = max_relative_error(grads[ours], grads["baseline"])
        row["new_over_old"] = row[f"{ours}_fwdbwd_ms"] / row["baseline_fwdbwd_ms"]
        log(f"new / old {row['new_over_old']:.3f}; relerr new vs old {row['baseline_relerr']:.3g}")


def rested_shape(row, problems, shp, args, ctx):
    phases = ctx["phases"]
    row["bytes"] = chunk_o_bytes(problems[0])
    row["floor_ms"] = floor_ms(row["bytes"], ctx["bandwidth"])
    sets = [p.chunk_o_args() for p in problems]
    runners = {}
    if ctx["ours"] is not None:
        runners["ours"] = JaxRunner(forward_fn(ctx["gdp_jax"], ctx["ours"], shp, args.chunk), sets)
    if ctx["baseline"] is not None:
        runners["baseline"] = JaxRunner(forward_fn(ctx["baseline"], ctx["ours"] or "xla", shp,
                                                   args.chunk), sets)
    if ctx["fla"] is not None:
        try:
            tsets = [fla_chunk_o_args(ctx["fla"], p, seed=args.seed * 1000 + i)
                     for i, p in enumerate(problems)]
            runners["fla"] = TorchRunner(fla_fwd_o_fn(ctx["fla"], shp, args.chunk), tsets)
        except Exception as e:  # noqa: BLE001
            row["fla_error"] = short_exc(e)
            log(f"fla: FAILED {short_exc(e)}")
    for name, runner in runners.items():
        try:
            phase = f"{row['shape']}/{name}"
            ms, info = measure(runner, **timing_kwargs(args), during=phases.during(f"{phase}/sustained"))
            row[f"{name}_sustained_ms"] = ms
            row[f"{name}_rested_ms"], n = rested(runner, burst_ms=args.burst_ms, bursts=args.bursts,
                                                 rest_s=args.rest, est_ms=ms,
                                                 during=phases.during(f"{phase}/rested"))
            for kind in ("sustained", "rested"):
                key = f"{name}_{kind}"
                row[f"{key}_pct_floor"] = 100.0 * row["floor_ms"] / row[f"{key}_ms"]
                summary = phases.summary(f"{phase}/{kind}")
                if summary:
                    row[f"{key}_gpu"] = summary
                log(f"{name:>9} {kind:>9}: {row[f'{key}_ms']:.4f} ms "
                    f"({row[f'{key}_pct_floor']:.1f} % of floor)"
                    f"{f', {n} calls a loop' if kind == 'rested' else ''}  {GpuMonitor.describe(summary)}")
        except Exception as e:  # noqa: BLE001
            row[f"{name}_error"] = short_exc(e)
            log(f"{name}: FAILED {short_exc(e)}")
            traceback.print_exc(limit=4)
    add_ratios(row, ("sustained", "rested"), "fla_over_ours", "fla", "ours")
    add_ratios(row, ("sustained", "rested"), "new_over_old", "ours", "baseline")


# ------------------------------------------------------------------------------------------ main
def main(argv=None):
    args = parse_args(argv)
    shapes = parse_shapes(args.shapes, SETS)

    import gdp_jax

    cpu = on_cpu()
    mode = "bwd" if args.bwd else "rested" if args.rested else "fwd"
    meta = run_meta(args, mode=mode)
    ours = next((i for i in ("pallas", "mosaic", "interpret", "mosaic_interpret", "xla")
                 if i in args.impls), None)
    log(f"jax {meta['jax']} on {meta['device']} ({meta['platform']}); mode {mode}; dtype {args.dtype}; "
        f"chunk {args.chunk}; impls {args.impls}; ours {ours}; sets {args.sets}; rounds {args.rounds}")
    if cpu and "pallas" in args.impls:
        log("note: no GPU; the Pallas kernels run here only with --impls ...,interpret")
    fla = try_load_fla("fla" in args.impls and not args.bwd, cpu, meta)
    if args.bwd and "fla" in args.impls:
        log("fla: no standalone chunk_o backward to time (bench_full_op.py times fla's backward)")
    torch_mod = fla.torch if fla else None
    if torch_mod is None and not cpu:
        try:
            import torch as torch_mod
            meta.setdefault("torch", torch_mod.__version__)
        except Exception:  # noqa: BLE001
            torch_mod = None
    baseline = load_baseline(args.baseline) if args.baseline else None
    if baseline is not None:
        meta["baseline"] = baseline.baseline_source
    bandwidth = copy_bandwidth(args, cpu, torch_mod)
    log("copy bandwidth: " + ", ".join(f"{k}={v:.4g}" for k, v in bandwidth.items()))
    phases = Phases(cpu)
    ctx = dict(gdp_jax=gdp_jax, baseline=baseline, fla=fla, ours=ours, phases=phases,
               bandwidth=bandwidth)
    run_shape = dict(fwd=forward_shape, bwd=backward_shape, rested=rested_shape)[mode]
    try:
        rows = run_shapes(
            shapes,
            lambda shp: dict(shape=shape_label(shp), dtype=args.dtype, chunk=args.chunk,
                             gated=not args.no_g, **shp),
            lambda shp, si: make_problems(shp, op="chunk_o", dtype=args.dtype, sets=args.sets,
                                          chunk_size=args.chunk, gated=not args.no_g,
                                          seed=args.seed * 1000 + si),
            lambda row, problems, shp: run_shape(row, problems, shp, args, ctx),
            title=f"{args.dtype} ({mode})",
            after=None if torch_mod is None else torch_mod.cuda.empty_cache)
    finally:
        phases.close()
    result = dict(meta=meta, copy_bandwidth=bandwidth, rows=rows)
    write_json(args.out, result)
    png = args.png or (os.path.splitext(args.out)[0] + ".png" if args.out else None)
    if png and png.lower() != "none" and mode != "rested":
        draw_png(rows, meta, bandwidth, png, mode, ours)
    dict(fwd=print_forward, bwd=print_backward, rested=print_rested)[mode](rows, meta, bandwidth, ours)
    return result


def _caption(meta, bandwidth, text):
    return (f"device {meta['device']} | jax {meta['jax']} | copy bandwidth "
            f"{bandwidth.get('GBps', float('nan')):.0f} GB/s | {text}")


def print_forward(rows, meta, bandwidth, ours):
    baseline = any("baseline_ms" in r or "baseline_error" in r for r in rows)
    hdr = ["shape", "dtype", "ours ms", "% floor", "xla ms", "fla ms", "fla/ours", "floor ms"]
    hdr += ["old ms", "new/old"] if baseline else []
    mosaic = next((n for n in ("mosaic", "mosaic_interpret") if n != ours and any(
        f"{n}_ms" in r or f"{n}_error" in r for r in rows)), None)
    hdr += ["mosaic ms", "mosaic % floor", "mosaic/ours"] if mosaic else []
    hdr += ["relerr ours/xla", "relerr fla", "SM MHz, power cap"]
    lines = []
    for r in rows:
        gpu = r.get(f"{ours}_gpu")
        fla_rel = r.get("fla_relerr_vs_xla", r.get(f"fla_relerr_vs_{ours}"))
        line = [r["shape"], r["dtype"], ms_cell(r, ours), fmt(r.get(f"{ours}_pct_floor"), ".1f"),
                ms_cell(r, "xla"), ms_cell(r, "fla"), fmt(r.get("fla_over_ours"), ".2f"),
                fmt(r.get("floor_ms"))]
        line += [ms_cell(r, "baseline"), fmt(r.get("new_over_old"), ".3f")] if baseline else []
        if mosaic:
            ratio = (r[f"{mosaic}_ms"] / r[f"{ours}_ms"]
                     if f"{mosaic}_ms" in r and f"{ours}_ms" in r else None)
            line += [ms_cell(r, mosaic), fmt(r.get(f"{mosaic}_pct_floor"), ".1f"),
                     fmt(ratio, ".3f")]
        line += [fmt(r.get(f"{ours}_relerr_vs_xla"), ".2e"),
                 fmt(fla_rel, ".2e") if not r.get("segs") else ("n/a" if "fla_ms" in r else "-"),
                 f"{gpu['sm_mhz_median']:.0f}, {gpu['power_capped']:.0%}" if gpu else "-"]
        lines.append(line)
    print_table(hdr, lines, _caption(meta, bandwidth, f"ours = {ours}; % floor = floor / ours; "
                                     "fla/ours > 1: ours faster; packed fla: own chunk grid, timing only"))


def print_backward(rows, meta, bandwidth, ours):
    baseline = any("baseline_fwdbwd_ms" in r or "baseline_fwdbwd_error" in r for r in rows)
    hdr = ["shape", "dtype", "fwd+bwd ms", "% floor", "floor ms", "bwd kernel ms", "bwd % floor",
           "fwd ms", "bwd/fwd", "xla fwd+bwd ms", "xla/ours"]
    hdr += ["old ms", "new/old"] if baseline else []
    mosaic = next((n for n in ("mosaic", "mosaic_interpret") if n != ours and any(
        f"{n}_fwdbwd_ms" in r or f"{n}_fwdbwd_error" in r for r in rows)), None)
    hdr += ["mosaic fwd+bwd ms", "mosaic % floor", "mosaic/ours"] if mosaic else []
    mosaic_kernel = any("mosaic_bwd_kernel_ms" in r for r in rows)
    hdr += ["mosaic bwd kernel ms", "% floor", "triton/mosaic"] if mosaic_kernel else []
    hdr += ["relerr max"]
    lines = []
    for r in rows:
        line = [r["shape"], r["dtype"], ms_cell(r, f"{ours}_fwdbwd"),
                fmt(r.get(f"{ours}_fwdbwd_pct_floor"), ".1f"), fmt(r.get("fwdbwd_floor_ms")),
                ms_cell(r, "bwd_kernel"), fmt(r.get("bwd_kernel_pct_floor"), ".1f"),
                ms_cell(r, f"{ours}_fwd"), fmt(r.get("bwd_over_fwd"), ".2f"),
                ms_cell(r, "xla_fwdbwd"), fmt(r.get("xla_over_ours"), ".2f")]
        line += [ms_cell(r, "baseline_fwdbwd"), fmt(r.get("new_over_old"), ".3f")] if baseline else []
        if mosaic:
            ratio = (r[f"{mosaic}_fwdbwd_ms"] / r[f"{ours}_fwdbwd_ms"]
                     if f"{mosaic}_fwdbwd_ms" in r and f"{ours}_fwdbwd_ms" in r else None)
            line += [ms_cell(r, f"{mosaic}_fwdbwd"), fmt(r.get(f"{mosaic}_fwdbwd_pct_floor"), ".1f"),
                     fmt(ratio, ".3f")]
        if mosaic_kernel:
            ratio = (r["bwd_kernel_ms"] / r["mosaic_bwd_kernel_ms"]
                     if "bwd_kernel_ms" in r and "mosaic_bwd_kernel_ms" in r else None)
            line += [ms_cell(r, "mosaic_bwd_kernel"),
                     fmt(r.get("mosaic_bwd_kernel_pct_floor"), ".1f"), fmt(ratio, ".3f")]
        line += [fmt(r.get("relerr_max"), ".2e")]
        lines.append(line)
    print_table(hdr, lines, _caption(meta, bandwidth, f"ours = {ours}; fwd+bwd = jax.vjp of the op, "
                                     "floor = forward's + backward's bytes; bwd kernel against the "
                                     "backward's floor; xla/ours > 1: ours faster"))


def print_rested(rows, meta, bandwidth, ours):
    names = [n for n in ("ours", "baseline", "fla") if any(f"{n}_sustained_ms" in r for r in rows)]
    hdr = ["shape", "floor ms"]
    for n in names:
        hdr += [f"{n} sust.", "%", "MHz", f"{n} rested", "%", "MHz"]
    hdr += [h for h, n in (("fla/ours sust.", "fla"), ("fla/ours rested", "fla"),
                           ("new/old sust.", "baseline"), ("new/old rested", "baseline")) if n in names]
    lines = []
    for r in rows:
        line = [r["shape"], fmt(r.get("floor_ms"), ".4f")]
        for n in names:
            for kind in ("sustained", "rested"):
                gpu = r.get(f"{n}_{kind}_gpu")
                line += [fmt(r.get(f"{n}_{kind}_ms"), ".4f"), fmt(r.get(f"{n}_{kind}_pct_floor"), ".1f"),
                         f"{gpu['sm_mhz_median']:.0f}" if gpu else "-"]
        if "fla" in names:
            line += [fmt(r.get("fla_over_ours_sustained"), ".3f"), fmt(r.get("fla_over_ours_rested"), ".3f")]
        if "baseline" in names:
            line += [fmt(r.get("new_over_old_sustained"), ".3f"), fmt(r.get("new_over_old_rested"), ".3f")]
        lines.append(line)
    print_table(hdr, lines, _caption(meta, bandwidth, f"ours = {ours}; sust. = back to back, rested = "
                                     "loops after idle seconds; MHz = median SM clock"))


def draw_png(rows, meta, bandwidth, path, mode, ours):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except Exception as e:  # noqa: BLE001
        log("no PNG (matplotlib):", short_exc(e))
        return
    suffix = "_fwdbwd" if mode == "bwd" else ""
    floor = "fwdbwd_floor_ms" if mode == "bwd" else "floor_ms"
    series = [(f"{ours}{suffix}_ms", f"ours {ours}"), (f"baseline{suffix}_ms", "baseline"),
              (f"xla{suffix}_ms", "ours xla"), ("fla_ms", "fla (triton)"), (floor, "bandwidth floor")]
    series = [s for s in series if any(r.get(s[0]) is not None for r in rows)]
    if not rows or not series:
        log("no PNG: nothing to draw")
        return
    try:
        x = np.arange(len(rows))
        width = 0.8 / len(series)
        fig, ax = plt.subplots(figsize=(max(7, 1.7 * len(rows)), 4.8))
        for i, (key, name) in enumerate(series):
            vals = [r.get(key) if r.get(key) is not None else np.nan for r in rows]
            bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, vals, width, label=name)
            for bar, v in zip(bars, vals):
                if v == v:
                    ax.annotate(f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=6)
        ax.set_xticks(x)
        ax.set_xticklabels([r["shape"].replace(" M", "\nM") for r in rows], fontsize=7)
        ax.set_ylabel("ms (lower is better)")
        what = "forward + backward" if mode == "bwd" else "forward"
        ax.set_title(f"chunk_gdp_fwd_o {what}, {rows[0]['dtype']}, chunk {rows[0]['chunk']} | "
                     f"{meta['device']} | copy {bandwidth.get('GBps', float('nan')):.0f} GB/s", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=130)
        plt.close(fig)
        log(f"wrote {path}")
    except Exception as e:  # noqa: BLE001
        log("PNG failed:", short_exc(e))


if __name__ == "__main__":
    main()
