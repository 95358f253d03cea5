#!/usr/bin/env python3
"""Where the full op's GPU time goes: per kernel from a profiler trace, or its backward stage by stage.

    PYTHONPATH=. python benchmarks/profile_gpu.py --out $OUT/kernels                  # --mode kernels
    PYTHONPATH=. python benchmarks/profile_gpu.py --mode stages --out $OUT/stages.json
    PYTHONPATH=. python benchmarks/profile_gpu.py --mode stages --shape B=1,T=128,H=2,K=32,M=2 --interpret

--mode kernels: runs each jitted function (the op's forward, forward + backward gated and
ungated) --calls times under ``jax.profiler.trace(create_perfetto_trace=True)``, then sums the
duration of every event on the GPU's stream timelines by name (Pallas kernels carry their
``name=``, XLA fusions their HLO names) per call. Device time per kernel: the sum is less than the
wall-clock times of the bench scripts (launch gaps are not counted). Tables largest first, JSON
(kernels.json) and the raw traces under --out (a directory). --l2norm: the op with
use_qk_l2norm=True (the normalisation's XLA passes and their gradients among the kernels).

--mode stages: the stages of the op's Pallas path alone, each jitted and timed like the bench
scripts (common.time_jax), on the operands the op gives them (the sub-chunk grid of the expanded
stream; residuals from ops.gated_delta_product.states_pallas, random cotangents):
  op_fwd, op_fwdbwd: the whole op (forward; o and its VJP in q, k, v, g, beta), for the sum;
  states_fwd / states_fwd_rule: stages 1-3 forward, plain and as the custom_vjp's forward rule
                 (which also keeps the state before every sub-chunk);
  wy_fwd, walk_fwd: the WY kernel and the state walk alone;
  wy_fwd_t, walk_fwd_t: the same where the walk applies the WY kernel's T (the op's 16-bit
                 forward): the WY kernel writes T alone;
  walk_bwd:      ops.chunk_h.pallas_bwd.chunk_h_bwd_pallas (reverse walk + epilogue), and
  walk_kernel:   the reverse walk alone (chunk_h_bwd_walk), both from w or from T as the op's
                 backward runs them (tune.backward_from_inverse);
  wy_bwd_pallas: the WY VJP kernel at the op's dots and cotangents (rhs_cotangents where the
                 backward works from T), adding the other dk shares as the op does;
  wy_bwd_pallas_l2norm: the same with the keys' l2norm VJP inside (key_factor), as
                 use_qk_l2norm's backward runs it where dispatch.keys_l2norm_vjp_in_wy_kernel;
                 wy_bwd_xla (ops.wy.xla.wy_bwd_xla, without the shares) and
  wy_autodiff:   jax.vjp of ops.wy.xla.wy_xla, the jnp alternatives;
  chunk_o_fwd, chunk_o_bwd: the output stage's kernels.
Each row's floor (common.roofline_ms) is the larger of the bytes it must move (its operands read
once, its outputs written once: the first input set and jax.eval_shape of its outputs) over the
measured copy bandwidth, and its matrix FLOPs (stage_dot_flops) over the measured dense matrix rate
in --dtype (common.matmul_rate); "% floor" is floor / time.
Launch-config sweeps of these kernels are tune.py's (--stage wy, walk, walk_bwd, wy_bwd, ...).
Nothing is asserted; a failing row prints its error. The table is printed last.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os

from common import (Phases, add_dtype_arg, copy_bandwidth, fmt, full_op_fwdbwd, log, make_problems,
                    matmul_rate, nbytes, on_cpu, parse_shapes, print_table, roofline_ms, run_meta, short_exc,
                    time_jax, write_json)


def stage_dot_flops(name: str, shp: dict, chunk: int) -> float:
    """Matrix FLOPs of a stage row at shape ``shp`` (B, T, H, K, V, M), chunk ``chunk``: the dots
    of the chunked algorithm over whole tiles, per (row, head) times B * H. With P = T * M
    positions on the expanded stream and sub-chunks of S = min(chunk, 64) positions:
      WY:      K K^T, then A (beta k) and A (beta v) on every sub-chunk: 2 P S (2K + V), and the
               unit-triangular inverse, 2 P S^2 / 3;
      walk:    w h and k^T v_new per sub-chunk: 4 P K V;
      WY writing T alone: K K^T and the inverse, 2 P S K + 2 P S^2 / 3; the walk applying it:
               k h, T x and k^T v_new, 4 P K V + 2 P S V;
      chunk_o: q k^T and A v_new over a token chunk's C * M positions, q h: 2 T (C M (K + V) + K V).
    A backward does twice its forward's dots (every product's VJP is two products of its size),
    and the WY VJP with the keys' l2norm VJP inside (wy_bwd_pallas_l2norm) the gram K K^T more:
    the reverse walk alone (walk_kernel) as many as the forward walk, the walk's whole VJP (with
    its epilogue) twice; the op's forward + backward three times its forward."""
    b, t, h, k, m = (shp[c] for c in "BTHKM")
    v = shp.get("V") or k
    p, s = t * m, min(chunk, 64)
    wy = 2 * p * s * (2 * k + v) + 2 * p * s * s / 3
    walk = 4 * p * k * v
    out = 2 * t * (chunk * m * (k + v) + k * v)
    wy_t, walk_t = 2 * p * s * k + 2 * p * s * s / 3, walk + 2 * p * s * v
    flops = dict(op_fwd=wy + walk + out, op_fwdbwd=3 * (wy + walk + out), states_fwd=wy + walk,
                 states_fwd_rule=wy + walk, wy_fwd=wy, walk_fwd=walk, wy_fwd_t=wy_t,
                 walk_fwd_t=walk_t, walk_kernel=walk,
                 walk_bwd=2 * walk, wy_bwd_pallas=2 * wy, wy_bwd_pallas_l2norm=2 * wy + 2 * p * s * k,
                 wy_bwd_xla=2 * wy, wy_autodiff=2 * wy,
                 chunk_o_fwd=out, chunk_o_bwd=2 * out)
    return float(b * h * flops[name])


def io_bytes(fn, operands) -> int:
    """Bytes of ``operands`` plus those of fn's outputs (from jax.eval_shape: nothing runs)."""
    import jax
    return nbytes(operands, jax.eval_shape(fn, *operands))


def gpu_kernel_times(trace_path: str, calls: int) -> list:
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
        log(f"no GPU stream timelines in {trace_path}; GPU threads: {sorted(set(threads.values()))}")
    return sorted(((n, t / 1e3 / calls, count[n] // calls) for n, t in total.items()),
                  key=lambda r: -r[1])


def traced_kernel_times(fn, fn_args, calls: int, trace_dir: str):
    """gpu_kernel_times of ``calls`` calls of fn(*fn_args) (compiled and warm already) traced under
    trace_dir; None (logged) if the profiler wrote no perfetto trace."""
    import jax
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(calls):
            out = fn(*fn_args)
        jax.block_until_ready(out)
    traces = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not traces:
        log(f"no perfetto trace under {trace_dir}")
        return None
    return gpu_kernel_times(sorted(traces)[-1], calls)


def op_fns(p, impl, l2norm=False):
    """{fwd, fwdbwd, fwdbwd_ng}: (fn, args) of the full op on Problem p (``use_qk_l2norm=l2norm``)."""
    import jax

    from gdp_jax import chunk_gated_delta_product

    op = lambda q, k, v, g, beta, s: chunk_gated_delta_product(
        q, k, v, g, beta, segment_ids=s, chunk_size=p.chunk_size, use_qk_l2norm=l2norm,
        implementation=impl)[0]
    args = (p.q, p.k, p.v, p.g, p.beta, p.segment_ids, p.do)
    return {
        "fwd": (jax.jit(lambda q, k, v, g, beta, s, do: op(q, k, v, g, beta, s)), args),
        "fwdbwd": (full_op_fwdbwd(op, True), args),
        "fwdbwd_ng": (full_op_fwdbwd(op, False), args),
    }


def kernels_mode(args, shp, meta):
    import jax
    (p,) = make_problems(shp, op="full", dtype=args.dtype, sets=1, chunk_size=args.chunk)
    os.makedirs(args.out, exist_ok=True)
    tables = {}
    for name, (fn, fn_args) in op_fns(p, args.impl, args.l2norm).items():
        if args.only and name not in args.only:
            continue
        try:
            jax.block_until_ready(fn(*fn_args))                      # compile and warm up
            rows = traced_kernel_times(fn, fn_args, args.calls, os.path.join(args.out, name))
        except Exception as e:  # noqa: BLE001
            log(f"{name}: FAILED {short_exc(e)}")
            continue
        if rows is None:
            continue
        tables[name] = rows
        log(f"{name}: {sum(r[1] for r in rows):.3f} ms of GPU events per call, {len(rows)} kernels")
    result = dict(meta=meta, shape=shp, chunk=args.chunk, tables=tables)
    write_json(os.path.join(args.out, "kernels.json"), result)
    for name, rows in tables.items():
        print_table(["ms / call", "launches", "kernel"],
                    [[f"{ms:.3f}", str(n), kernel[:100]] for kernel, ms, n in rows[:25]],
                    f"{name} ({args.shape}, {args.dtype}, chunk {args.chunk}, {args.impl}): "
                    f"{sum(r[1] for r in rows):.3f} ms of GPU events per call")
    return result


def stage_functions(args, shp):
    """{name: (fn, operand sets)} of --mode stages."""
    import jax
    import jax.numpy as jnp

    from gdp_jax.ops.chunk_h.pallas_bwd import chunk_h_bwd_walk
    from gdp_jax.ops.gated_delta_product import states_pallas
    from gdp_jax.ops.wy.xla import wy_bwd_xla, wy_xla
    from tune import STAGES

    interpret = args.impl == "interpret"
    full = make_problems(shp, op="full", dtype=args.dtype, sets=args.sets, chunk_size=args.chunk)
    chunk_o = (make_problems(shp, op="chunk_o", dtype=args.dtype, sets=args.sets, chunk_size=args.chunk)
               if not args.only or args.only & {"chunk_o_fwd", "chunk_o_bwd"} else None)
    p = full[0]
    fns = {}
    for name, (fn, _) in op_fns(p, args.impl, args.l2norm).items():
        if name != "fwdbwd_ng":
            fns[f"op_{name}"] = (fn, [(q.q, q.k, q.v, q.g, q.beta, q.segment_ids, q.do) for q in full])
    stage = dict(chunk_size=args.chunk, num_householder=shp["M"], interpret=interpret)
    states_sets = [(q.k, q.v, q.beta, q.g, q.runs) for q in full]
    fns["states_fwd"] = (lambda k, v, beta, g, runs: states_pallas(k, v, beta, g, runs, None, **stage),
                         states_sets)
    fns["states_fwd_rule"] = (lambda k, v, beta, g, runs: states_pallas(
        k, v, beta, g, runs, None, every_sub_chunk=True, **stage), states_sets)
    wanted = lambda *names: not args.only or bool(args.only & set(names))
    for name, key, problems in (("wy_fwd", "wy", full), ("walk_fwd", "walk", full),
                                ("wy_fwd_t", "wy_t", full), ("walk_fwd_t", "walk_t", full),
                                ("walk_bwd", "walk_bwd", full), ("wy_bwd_pallas", "wy_bwd", full),
                                ("chunk_o_fwd", "chunk_o_fwd", chunk_o),
                                ("chunk_o_bwd", "chunk_o_bwd", chunk_o)):
        extra = dict(walk_bwd=("walk_kernel",),
                     wy_bwd=("wy_bwd_pallas_l2norm", "wy_bwd_xla", "wy_autodiff")).get(key, ())
        if not wanted(name, *extra):
            continue
        try:
            st = STAGES[key]()
            st.interpret = interpret
            sets = st.inputs(problems)
            # the plain WY VJP does not read the keys' factors (its operand sets' last)
            fns[name] = (st.call(st.default(shp, problems[0]), {}, shp, problems[0], interpret),
                         [s[:-1] for s in sets] if key == "wy_bwd" else sets)
            if key == "wy_bwd" and wanted("wy_bwd_pallas_l2norm"):
                fns["wy_bwd_pallas_l2norm"] = (st.call(st.default(shp, problems[0]),
                                                       dict(l2norm=True), shp, problems[0],
                                                       interpret), sets)
        except Exception as e:  # noqa: BLE001
            fns[name] = (e, None)
            continue
        if key == "walk_bwd":
            grid = st.grid[0]
            walk = dict(chunk_size=grid["sub"], num_householder=1, with_initial_state=False,
                        subchunks=grid["subchunks"], dot_dtype=grid["walk_bwd_dot_dtype"],
                        interpret=interpret)
            fns["walk_kernel"] = (
                lambda k, w, gamma, runs, h_sub, v_new, dh, dv_new, dfinal, beta, st=st: chunk_h_bwd_walk(
                    k=k, g=gamma, runs=runs, dh=dh, dv_new=dv_new, dfinal=dfinal,
                    **st.walk_operands(w, beta), **walk), sets)
        if key == "wy_bwd":
            sub, f32 = st.grid[0]["sub"], jnp.float32
            # the jnp alternatives take the WY VJP's own operands (the op adds the other dk
            # shares after them, in XLA)
            fns["wy_bwd_xla"] = (lambda k, v, beta, gamma, runs, inverse, dw, du, *shares: wy_bwd_xla(
                k, v, beta, gamma, runs, dw, du, chunk_size=sub), [s[:8] for s in sets])

            def wy_autodiff(k, v, beta, gamma, runs, inverse, dw, du):
                fn = lambda *a: wy_xla(*a, runs, chunk_size=sub, num_householder=1)
                _, vjp = jax.vjp(fn, k.astype(f32), v.astype(f32), beta.astype(f32), gamma)
                return vjp((dw.astype(f32), du.astype(f32)))
            fns["wy_autodiff"] = (wy_autodiff, [s[:8] for s in sets])
    return fns


def stages_mode(args, shp, meta):
    import jax
    phases = Phases(on_cpu())
    rows = {}
    bandwidth = copy_bandwidth(args, on_cpu())
    rate = matmul_rate(args, on_cpu(), args.dtype)
    log(f"copy bandwidth {bandwidth['GBps']:.0f} GB/s, {rate['dtype']} matrix rate "
        f"{rate['TFLOPs']:.1f} TFLOP/s (N = {rate['n']})")
    try:
        for name, (fn, sets) in stage_functions(args, shp).items():
            if args.only and name not in args.only:
                continue
            if sets is None:
                rows[name] = dict(error=short_exc(fn))
                log(f"{name:>16}: setup FAILED {rows[name]['error']}")
                continue
            try:
                ms, info = time_jax(jax.jit(fn), sets, target_s=args.target_ms / 1e3, reps=args.reps,
                                    max_iters=args.max_iters, during=phases.during(name))
                floor = roofline_ms(io_bytes(fn, sets[0]), stage_dot_flops(name, shp, args.chunk),
                                    bandwidth, rate)
                rows[name] = dict(ms=ms, timing=info, **floor,
                                  pct_floor=100.0 * floor["floor_ms"] / ms)
                log(f"{name:>16}: {ms:.4g} ms (N={info['n']}, first call {info['first_call_s']:.1f} s), "
                    f"floor {floor['floor_ms']:.4g} ms ({floor['bound']})")
                phases.record(rows[name], "gpu", name)
            except Exception as e:  # noqa: BLE001
                rows[name] = dict(error=short_exc(e))
                log(f"{name:>16}: FAILED {rows[name]['error']}")
    finally:
        phases.close()
    result = dict(meta=meta, shape=shp, chunk=args.chunk, bandwidth=bandwidth, matmul_rate=rate,
                  rows=rows)
    write_json(args.out, result)
    print_table(["stage", "ms", "floor ms", "% floor", "bound", "MB moved", "GFLOP", "first call s"],
                [[n, fmt(r.get("ms"), ".4f") if "ms" in r else "ERR " + r["error"][:60],
                  fmt(r.get("floor_ms"), ".4f"), fmt(r.get("pct_floor"), ".1f"), r.get("bound", ""),
                  fmt(r["bytes"] / 2**20 if "bytes" in r else None, ".1f"),
                  fmt(r["flops"] / 1e9 if "flops" in r else None, ".2f"),
                  fmt(r.get("timing", {}).get("first_call_s"), ".1f")] for n, r in rows.items()],
                f"{meta['device']} | jax {meta['jax']} | {args.shape} chunk {args.chunk} {args.dtype} "
                f"| {args.impl}")
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="kernels", choices=["kernels", "stages"])
    p.add_argument("--shape", default="B=8,T=4096,H=16,K=128,M=2",
                   help="one shape, 'B=..,T=..,H=..,K=..[,V=..],M=..[,segs=..]'")
    add_dtype_arg(p)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--l2norm", action="store_true",
                   help="the op's rows with use_qk_l2norm=True (the stages' rows are unchanged)")
    p.add_argument("--calls", type=int, default=5, help="--mode kernels: calls traced per function")
    p.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU logic check)")
    p.add_argument("--impl", default=None, choices=["pallas", "interpret", "xla"],
                   help="implementation (default pallas on a GPU, interpret on a CPU)")
    p.add_argument("--sets", type=int, default=2, help="--mode stages: input sets rotated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--target-ms", type=float, default=100.0)
    p.add_argument("--max-iters", type=int, default=50)
    p.add_argument("--copy-mb", type=float, default=2048.0,
                   help="--mode stages: size of the copy-bandwidth buffer in MB")
    p.add_argument("--only", default="",
                   help="comma-separated names: kernels: fwd, fwdbwd, fwdbwd_ng; stages: the rows above")
    p.add_argument("--out", default=None,
                   help="kernels: a directory (default profile_kernels); stages: a JSON file")
    args = p.parse_args(argv)
    args.only = set(filter(None, (n.strip() for n in args.only.split(","))))
    if args.interpret:
        args.impl = "interpret"
    args.impl = args.impl or ("interpret" if on_cpu() else "pallas")
    (shp,) = parse_shapes(args.shape, {})
    meta = run_meta(args)
    log(f"jax {meta['jax']} on {meta['device']}; mode {args.mode}; {args.shape} {args.dtype} "
        f"chunk {args.chunk}; {args.impl}")
    if args.mode == "kernels":
        args.out = args.out or "profile_kernels"
        return kernels_mode(args, shp, meta)
    return stages_mode(args, shp, meta)


if __name__ == "__main__":
    main()
