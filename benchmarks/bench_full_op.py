#!/usr/bin/env python3
"""Benchmark the full op, gdp_jax.chunk_gated_delta_product, against fla 0.6.0's chunk_gated_delta_product.

Run on a GPU box from the repo root (fla and torch importable for the fla columns):

    PYTHONPATH=. python benchmarks/bench_full_op.py --out $OUT/full.json
    PYTHONPATH=. python benchmarks/bench_full_op.py --shapes quick --only ours_fwd,fla_fwd
    PYTHONPATH=. python benchmarks/bench_full_op.py --shapes quick --baseline /tmp/old --no-fla
    PYTHONPATH=. python benchmarks/bench_full_op.py --shapes tiny --impl interpret   # CPU logic check

Columns, per shape (inputs: common.make_problems(op="full"), --sets rotated; every JAX function
jitted; fla with CUDA events on torch views of the same buffers):
  * ours_fwd:        o, final_state of chunk_gated_delta_product(implementation=--impl), gated;
  * ours_fwdbwd:     o and its VJP for the cotangent do (jax.vjp, as fla's o.backward(do)):
                     the cotangents of q, k, v, g, beta (gated);
  * ours_fwdbwd_ng:  the same without g (to compare with fla's ungated backward);
  * xla_fwd:         the jnp path (implementation="xla"), for scale;
  * stage_states, stage_o: the forward's stages alone (stages 2-3 through the documented stage
                     API ops.gated_delta_product.states_pallas, or states_jnp for --impl xla; the
                     output stage chunk_gdp_fwd_o on a stand-in h), to show where the time goes;
  * baseline_fwd, baseline_fwdbwd, baseline_fwdbwd_ng (--baseline DIR): the same through another
                     version's public op (common.load_baseline), alternated with ours over --rounds;
  * fla_fwd, fla_fwdbwd_ng, fla_fwdbwd: fla's forward (gated) and forward + backward. fla refuses
                     float32 inputs, and on Triton 3.6 / Hopper its gated backward: the attempt is
                     made and the error kept.
The first call of each (compilation included; fla: its autotuning, 100-170 s for forward +
backward per shape) is in the JSON and, for ours, in the table. Limit fla's autotuning with
--only (e.g. only fla_fwd), --no-fla or fewer shapes. Packed shapes (segs > 0) give us segment
ids and fla the same packing as cu_seqlens over one flattened row (B = 1). --l2norm passes
use_qk_l2norm (fla: use_qk_l2norm_in_kernel).

Sanity: relative error of our o and final state against the jnp path's, fla's (final state on
unpacked shapes) and the baseline's, on input set 0. Nothing is asserted; a failing column prints
its error and the run goes on. The table is printed last.
"""
from __future__ import annotations

import argparse
import gc


from common import (SHAPE_SETS, Phases, TorchRunner, add_dtype_arg, add_ratios, add_timing_args,
                    run_shapes, full_op_fwdbwd,
                    fla_full_op_args, fmt, load_baseline, log, make_problems, measure, ms_cell,
                    on_cpu, parse_shapes, print_table, relative_errors, run_meta, shape_label,
                    shape_sets_epilog, short_exc, time_into_row, timing_kwargs, try_load_fla,
                    write_json)

SETS = {"default": [dict(B=8, T=4096, H=16, K=128, V=128, M=2),
                    dict(B=8, T=4096, H=16, K=128, V=128, M=2, segs=8),
                    dict(B=8, T=4096, H=16, K=128, V=128, M=1),
                    dict(B=8, T=4096, H=16, K=128, V=128, M=3)],
        # the full-op speed targets' shapes: M = 1..3, K = V = 64 and 256, ~16 segments a row, one long row
        "targets": [dict(B=8, T=4096, H=16, K=128, V=128, M=2),
                    dict(B=8, T=4096, H=16, K=128, V=128, M=1),
                    dict(B=8, T=4096, H=16, K=128, V=128, M=3),
                    dict(B=4, T=8192, H=32, K=64, V=64, M=2),
                    dict(B=2, T=16384, H=16, K=256, V=256, M=2),
                    dict(B=8, T=4096, H=16, K=128, V=128, M=2, segs=16),
                    dict(B=1, T=65536, H=16, K=128, V=128, M=2)],
        **SHAPE_SETS, "quick": [dict(B=8, T=4096, H=16, K=128, V=128, M=2)]}
OURS_COLUMNS = ["ours_fwd", "ours_fwdbwd", "ours_fwdbwd_ng", "xla_fwd", "stage_states", "stage_o"]
BASELINE_COLUMNS = ["baseline_fwd", "baseline_fwdbwd", "baseline_fwdbwd_ng"]
FLA_COLUMNS = ["fla_fwd", "fla_fwdbwd_ng", "fla_fwdbwd"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=shape_sets_epilog(SETS))
    p.add_argument("--shapes", default="default", help="a named set or 'B=..,T=..,H=..,K=..[,V=..],M=..[,segs=..];...'")
    add_dtype_arg(p)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--impl", default=None, choices=["pallas", "mosaic", "interpret", "xla"],
                   help="our implementation (default pallas on a GPU, interpret on a CPU)")
    p.add_argument("--interpret", action="store_true", help="same as --impl interpret")
    p.add_argument("--l2norm", action="store_true", help="use_qk_l2norm=True (fla: use_qk_l2norm_in_kernel)")
    p.add_argument("--only", default="",
                   help="comma-separated subset of columns: " + ", ".join(OURS_COLUMNS + BASELINE_COLUMNS
                                                                        + FLA_COLUMNS))
    p.add_argument("--no-fla", action="store_true", help="skip fla even if importable")
    p.add_argument("--baseline", default=None,
                   help="directory holding another version's gdp_jax/ package, timed beside ours")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of alternation between ours and the baseline (default 3 with "
                        "--baseline, else 1)")
    add_timing_args(p, max_iters=200, copy_mb=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write JSON results here")
    args = p.parse_args(argv)
    args.sets = max(3, args.sets)
    if args.interpret:
        args.impl = "interpret"
    args.only = set(filter(None, (c.strip() for c in args.only.split(","))))
    unknown = args.only - set(OURS_COLUMNS + BASELINE_COLUMNS + FLA_COLUMNS)
    if unknown:
        p.error(f"unknown --only columns {sorted(unknown)}")
    if args.rounds is None:
        args.rounds = 3 if args.baseline else 1
    return args


def our_fns(module, impl, shp, args, prefix):
    """{prefix_fwd, prefix_fwdbwd, prefix_fwdbwd_ng}: module.chunk_gated_delta_product (ours or the
    baseline's) on (q, k, v, g, beta, segment_ids, do), jitted."""
    import jax
    kw = dict(num_householder=shp["M"], chunk_size=args.chunk, output_final_state=True,
              implementation=impl)
    if args.l2norm:
        kw["use_qk_l2norm"] = True

    op = lambda q, k, v, g, beta, s: module.chunk_gated_delta_product(
        q, k, v, g, beta, segment_ids=s, **kw)[0]
    return {f"{prefix}_fwd": jax.jit(lambda q, k, v, g, beta, s, do: module.chunk_gated_delta_product(
                q, k, v, g, beta, segment_ids=s, **kw)),
            f"{prefix}_fwdbwd": full_op_fwdbwd(op, True),
            f"{prefix}_fwdbwd_ng": full_op_fwdbwd(op, False)}


def stage_fns(impl, shp, args):
    """The forward's stages alone: stage_states (stages 2-3) and stage_o (the output stage)."""
    import jax
    import jax.numpy as jnp

    from gdp_jax import chunk_gdp_fwd_o, segment_runs
    from gdp_jax.ops.cumsum import chunk_local_log2_cumsum
    from gdp_jax.ops.gated_delta_product import states_jnp, states_pallas

    B, T, H, K, V, M = (shp[c] for c in "BTHKVM")
    bt = args.chunk
    stage = dict(chunk_size=bt, num_householder=M)

    def states(q, k, v, g, beta, s, do):
        runs = None if s is None else segment_runs(s)
        if impl == "xla":
            g_log2 = None if g is None else chunk_local_log2_cumsum(g, bt)
            return states_jnp(k, v, beta, g_log2, runs, None, **stage)
        return states_pallas(k, v, beta, g, runs, None, interpret=impl == "interpret", **stage)

    def output(q, k, v, g, beta, s, do):   # values of h do not matter for the time
        h = jnp.zeros((B, -(-T // bt), H, K, V), q.dtype)
        g_log2 = None if g is None else chunk_local_log2_cumsum(g, bt)
        return chunk_gdp_fwd_o(q, k, v, h, g_log2, segment_ids=s, implementation=impl, **stage)

    return {"stage_states": jax.jit(states), "stage_o": jax.jit(output)}


def fla_fns(fla, shp, args):
    m = shp["M"]
    extra = dict(use_qk_l2norm_in_kernel=True) if args.l2norm else {}

    def forward(q, k, v, g, b, do, cu):
        return fla.op(q, k, v, g, b, num_householder=m, output_final_state=True, cu_seqlens=cu, **extra)

    def fwdbwd(gated):
        def run(q, k, v, g, b, do, cu):
            leaves = [x.detach().requires_grad_(True) for x in (q, k, v, b)]
            gg = g.detach().requires_grad_(True) if gated else None
            o, _ = fla.op(leaves[0], leaves[1], leaves[2], gg, leaves[3], num_householder=m,
                          output_final_state=True, cu_seqlens=cu, **extra)
            o.backward(do)
        return run
    return {"fla_fwd": forward, "fla_fwdbwd_ng": fwdbwd(False), "fla_fwdbwd": fwdbwd(True)}


def run_shape(row, problems, shp, args, ctx):
    import jax
    import jax.numpy as jnp
    only = args.only
    wanted = lambda name: not only or name in only
    sets = [p.full_args() + (p.do,) for p in problems]
    impl, phases = ctx["impl"], ctx["phases"]
    ours = our_fns(ctx["gdp_jax"], impl, shp, args, "ours")
    old = our_fns(ctx["baseline"], impl, shp, args, "baseline") if ctx["baseline"] else {}
    for kind in ("fwd", "fwdbwd", "fwdbwd_ng"):        # ours and the baseline's, alternated
        pair = {n: f for n, f in ((f"ours_{kind}", ours[f"ours_{kind}"]),
                                  (f"baseline_{kind}", old.get(f"baseline_{kind}"))) if f and wanted(n)}
        if pair:
            time_into_row(row, pair, sets, args, phases)
            gc.collect()
    others = dict(xla_fwd=our_fns(ctx["gdp_jax"], "xla", shp, args, "xla")["xla_fwd"],
                  **stage_fns(impl, shp, args))
    for name, fn in others.items():
        if wanted(name):
            time_into_row(row, {name: fn}, sets, args, phases)
            gc.collect()
    outs = {}
    for name, fn in (("ours", ours["ours_fwd"]), ("xla", others["xla_fwd"]),
                     ("baseline", old.get("baseline_fwd"))):
        if fn is not None and f"{name}_fwd_ms" in row:
            outs[name] = jax.block_until_ready(fn(*sets[0]))
    for name in ("xla", "baseline"):
        if name in outs and "ours" in outs:
            row[f"relerr_o_{name}"], row[f"relerr_state_{name}"] = relative_errors(outs[name], outs["ours"])
            log(f"relerr vs {name}: o {row[f'relerr_o_{name}']:.2e}, final state "
                f"{row[f'relerr_state_{name}']:.2e}")

    fla = ctx["fla"]
    if fla is not None and (not only or only & set(FLA_COLUMNS)):
        B, T, H, V = (shp[c] for c in "BTHV")
        fla_sets = [fla_full_op_args(fla, p) for p in problems]
        fns = fla_fns(fla, shp, args)
        for name, fn in fns.items():
            if not wanted(name):
                continue
            try:
                ms, info = measure(TorchRunner(fn, fla_sets), **timing_kwargs(args),
                                   during=phases.during(f"{row['shape']}/{name}"))
                row[f"{name}_ms"], row[f"{name}_timing"] = ms, info
                log(f"{name:>16}: {ms:.4g} ms (N={info['n']}, first call {info['first_call_s']:.1f} s)")
                phases.record(row, f"{name}_gpu", f"{row['shape']}/{name}")
            except Exception as e:  # noqa: BLE001
                row[f"{name}_error"] = short_exc(e)
                log(f"{name:>16}: FAILED {short_exc(e)}")
        if "ours" in outs:
            try:
                o_fla, s_fla = fns["fla_fwd"](*fla_sets[0])
                o_fla = jnp.asarray(o_fla.float().cpu().numpy()).reshape(B, T, H, V)
                row["relerr_o_fla"] = relative_errors(o_fla, outs["ours"][0])[0]
                if not shp["segs"]:
                    s_fla = jnp.asarray(s_fla.float().cpu().numpy())
                    row["relerr_state_fla"] = relative_errors(s_fla, outs["ours"][1])[0]
                log(f"relerr vs fla: o {row['relerr_o_fla']:.2e}"
                    + (f", final state {row['relerr_state_fla']:.2e}" if "relerr_state_fla" in row else ""))
            except Exception as e:  # noqa: BLE001
                log("relerr vs fla failed:", short_exc(e))
        del fla_sets
        fla.torch.cuda.empty_cache()
    add_ratios(row, ("fwd", "fwdbwd", "fwdbwd_ng"), "ours_over_fla", "ours", "fla")
    add_ratios(row, ("fwd", "fwdbwd", "fwdbwd_ng"), "new_over_old", "ours", "baseline")


def main(argv=None):
    args = parse_args(argv)
    shapes = parse_shapes(args.shapes, SETS)

    import gdp_jax

    cpu = on_cpu()
    impl = args.impl or ("interpret" if cpu else "pallas")
    meta = run_meta(args, impl=impl)
    fla = try_load_fla(not args.no_fla, cpu, meta)
    baseline = load_baseline(args.baseline) if args.baseline else None
    if baseline is not None:
        meta["baseline"] = baseline.baseline_source
    log(f"jax {meta['jax']} on {meta['device']}; dtype {args.dtype}; chunk {args.chunk}; impl {impl}; "
        f"fla {'yes' if fla else 'no'}; baseline {'yes' if baseline else 'no'}; rounds {args.rounds}")
    phases = Phases(cpu)
    ctx = dict(gdp_jax=gdp_jax, baseline=baseline, fla=fla, impl=impl, phases=phases)
    try:
        rows = run_shapes(
            shapes,
            lambda shp: dict(shape=shape_label(shp), dtype=args.dtype, l2norm=args.l2norm, **shp),
            lambda shp, si: make_problems(shp, op="full", dtype=args.dtype, sets=args.sets,
                                          chunk_size=args.chunk, seed=args.seed * 1000 + si),
            lambda row, problems, shp: run_shape(row, problems, shp, args, ctx),
            title=args.dtype)
    finally:
        phases.close()
    result = dict(meta=meta, rows=rows)
    write_json(args.out, result)
    print_results(rows, meta, impl)
    return result


def print_results(rows, meta, impl):
    present = lambda c: any(f"{c}_ms" in r or f"{c}_error" in r for r in rows)
    columns = [c for c in OURS_COLUMNS[:3] + BASELINE_COLUMNS + FLA_COLUMNS + OURS_COLUMNS[3:]
               if present(c)]
    ratios = [(f"{a}/{b} {k}", f"{'ours_over_fla' if b == 'fla' else 'new_over_old'}_{k}")
              for b in ("fla", "old") for k in ("fwd", "fwdbwd", "fwdbwd_ng")
              if any(f"{'ours_over_fla' if b == 'fla' else 'new_over_old'}_{k}" in r for r in rows)
              for a in ["ours" if b == "fla" else "new"]]
    hdr = ["shape"] + columns + [name for name, _ in ratios] + ["err vs fla", "first call s (fwd, fb)"]
    lines = []
    for r in rows:
        first = [r.get(f"ours_{k}_timing", {}).get("first_call_s") for k in ("fwd", "fwdbwd")]
        lines.append([r["shape"]] + [ms_cell(r, c) for c in columns]
                     + [fmt(r.get(key), ".2f") for _, key in ratios]
                     + [fmt(r.get("relerr_o_fla"), ".1e"),
                        ", ".join(fmt(x, ".1f") for x in first)])
    print_table(hdr, lines, f"device {meta['device']} | jax {meta['jax']} | impl {impl} | ms per call; "
                            "fb = forward + backward; ng = ungated (g None); ours/fla < 1: ours faster")


if __name__ == "__main__":
    main()
