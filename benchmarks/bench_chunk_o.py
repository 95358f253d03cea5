#!/usr/bin/env python3
"""Benchmark gdp_jax.chunk_gdp_fwd_o (Pallas and XLA) against fla's chunk_gated_delta_product_fwd_o.

Run on a GPU box from the repo root:

    PYTHONPATH=. python3 benchmarks/bench_chunk_o.py --out $OUT/bench.json            # default shapes, bf16
    PYTHONPATH=. python3 benchmarks/bench_chunk_o.py --shapes quick --out $OUT/q.json  # two shapes
    PYTHONPATH=. python3 benchmarks/bench_chunk_o.py --shapes tiny --impls xla         # CPU logic check

What it does:
  * device copy bandwidth: a ~2 GB elementwise copy in JAX (and torch.Tensor.copy_ if torch is there);
    bandwidth = bytes read + written / time. The larger of the two is the roofline used below.
  * per shape: random inputs (q normal, k L2-normalised, v and h normal*0.1, g = chunk-local cumsum of
    log2(e) * -softplus(noise) restarting every chunk), `--sets` independent input sets (default 3) that the
    timing loops rotate through so the 60 MB L2 never holds a whole working set;
  * times ours (implementation="pallas" and "xla", each jitted) by wall clock over N back-to-back calls after
    block_until_ready, divided by N (median of --reps such loops); fla's kernel with torch.cuda.Event around the
    same kind of rotated loop (and triton.testing.do_bench as a second opinion, JSON only);
  * bandwidth floor = bytes(q, k, v, h, g, segment_ids read once + o written once) / copy bandwidth;
    "% floor" = floor_ms / ours_ms * 100 (100 % = running at copy bandwidth);
  * sanity: relative Frobenius error (float32) of pallas vs xla, and of fla vs xla on unpacked shapes.

Nothing is asserted: any failure (no fla, a Pallas exception, ...) is printed and the run goes on.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import time
import traceback

# JAX and torch share the GPU in this process: JAX must not grab 75 % of memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from bench_common import (LOG2E, add_dtype_arg, add_timing_args, jnp_dtype, copy_bandwidth,
                          fmt as _fmt, log, nbytes, parse_shapes as _parse_shapes, relative_error_fn,
                          short_exc, shape_label, time_jax, time_torch, print_table, GpuMonitor)
from gdp_jax.reference import chunk_local_log2_cumsum as chunk_cumsum_log2

FLA_DEVICE = "cuda"  # where fla's extra tensors (cu_seqlens) go

# Named shape sets. segs = segments per row (random lengths) passed as segment_ids; 0 = unpacked.
SHAPE_SETS = {
    "default": [
        dict(B=8, T=4096, H=16, K=128, V=128, M=1),
        dict(B=8, T=4096, H=16, K=128, V=128, M=2),
        dict(B=8, T=4096, H=16, K=128, V=128, M=3),
        dict(B=4, T=8192, H=32, K=64, V=64, M=2),
        dict(B=2, T=16384, H=16, K=256, V=256, M=2),
        dict(B=8, T=4096, H=16, K=128, V=128, M=2, segs=8),
    ],
    "quick": [
        dict(B=8, T=4096, H=16, K=128, V=128, M=2),
        dict(B=8, T=4096, H=16, K=128, V=128, M=2, segs=8),
    ],
    # For checking the script's logic on a CPU; the numbers mean nothing.
    "tiny": [
        dict(B=2, T=200, H=2, K=32, V=32, M=2),
        dict(B=2, T=256, H=2, K=32, V=16, M=1, segs=3),
    ],
}

IMPLS_OURS = ("pallas", "xla", "interpret")


# ----------------------------------------------------------------------------------------------- args
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="shape sets: " + "; ".join(
            f"{k}: " + ", ".join(shape_label(s) for s in v) for k, v in SHAPE_SETS.items())
        + '.\nCustom: --shapes "B=8,T=4096,H=16,K=128,V=128,M=2,segs=8;B=1,T=512,H=4,K=64,M=1"',
    )
    p.add_argument("--shapes", default="default",
                   help="a named set (default, quick, tiny) or custom 'B=..,T=..,H=..,K=..,V=..,M=..[,segs=..];...'")
    add_dtype_arg(p)
    p.add_argument("--chunk", type=int, default=64, help="chunk size BT (default 64)")
    p.add_argument("--impls", default="pallas,xla,fla",
                   help="comma list of pallas, xla, interpret, fla (default pallas,xla,fla)")
    add_timing_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write JSON results here")
    p.add_argument("--png", default=None,
                   help="bar chart path (default: --out with .png, if --out is given; 'none' to skip)")
    p.add_argument("--no-do-bench", action="store_true", help="skip triton.testing.do_bench for fla")
    return p.parse_args(argv)


def do_bench_rotated(fn, sets):
    import triton
    ctr = [0]

    def call():
        s = sets[ctr[0] % len(sets)]
        ctr[0] += 1
        fn(*s)

    try:
        return float(triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median"))
    except TypeError:  # older triton without return_mode
        return float(triton.testing.do_bench(call, warmup=25, rep=200))


# -------------------------------------------------------------------------------------------- inputs
def restart_cumsum(x, start):
    """Inclusive cumsum along axis 1 of x [B, T, H] restarting where start [B, T] (bool) is True."""
    import jax
    import jax.numpy as jnp
    T = x.shape[1]
    idx = jnp.arange(T, dtype=jnp.int32)[None, :]
    last = jax.lax.cummax(jnp.where(start, idx, 0), axis=1)
    cs = jnp.cumsum(x, axis=1)
    base = jnp.take_along_axis(cs - x, last[..., None], axis=1)
    return cs - base


def make_segments(rng, B, T, nseg):
    """Random packing: nseg segments of random length per row. Returns int32 ids [B, T] and lengths."""
    import numpy as np
    ids = np.zeros((B, T), np.int32)
    lens = []
    nseg = max(1, min(nseg, T))
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T), size=nseg - 1, replace=False)) if nseg > 1 else np.array([], int)
        bounds = np.concatenate([[0], cuts, [T]])
        lens.append(np.diff(bounds))
        ids[b] = np.searchsorted(cuts, np.arange(T), side="right")
    return ids, lens


def make_set(key, shp, dtype, BT):
    import jax
    import jax.numpy as jnp

    B, T, H, K, V, M = (shp[c] for c in "BTHKVM")
    NT = -(-T // BT)

    @jax.jit
    def gen(key):
        kq, kk, kv, kh, kg = jax.random.split(key, 5)
        q = jax.random.normal(kq, (B, T, H, K), jnp.float32).astype(dtype)
        k = jax.random.normal(kk, (B, T * M, H, K), jnp.float32)
        k = (k * jax.lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True) + 1e-6)).astype(dtype)
        v = (0.1 * jax.random.normal(kv, (B, T * M, H, V), jnp.float32)).astype(dtype)
        h = (0.1 * jax.random.normal(kh, (B, NT, H, K, V), jnp.float32)).astype(dtype)
        g_raw = -jax.nn.softplus(jax.random.normal(kg, (B, T, H), jnp.float32) - 2.0)
        return q, k, v, h, g_raw, chunk_cumsum_log2(g_raw, BT)

    return jax.block_until_ready(gen(key))


def load_fla():
    """Returns (torch, fwd_o, prepare_chunk_indices, versions) or raises."""
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    import triton
    import fla  # noqa: F401
    from fla.ops.gated_delta_product.chunk_deltaproduct_o import chunk_gated_delta_product_fwd_o
    from fla.ops.utils import prepare_chunk_indices
    vers = dict(torch=torch.__version__, triton=triton.__version__, fla=getattr(fla, "__version__", "?"))
    return torch, chunk_gated_delta_product_fwd_o, prepare_chunk_indices, vers


def to_torch(torch, x):
    """jax array -> torch CUDA tensor, zero-copy through dlpack when possible."""
    import jax
    import numpy as np
    jax.block_until_ready(x)
    try:
        return torch.from_dlpack(x)
    except Exception:  # noqa: BLE001 - fall back to a host round trip
        a = np.asarray(x)
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16).to(FLA_DEVICE)
        return torch.from_numpy(a.copy()).to(FLA_DEVICE)


# ----------------------------------------------------------------------------------------------- main
def main(argv=None):
    args = parse_args(argv)
    shapes = _parse_shapes(args.shapes, SHAPE_SETS)
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    bad = [i for i in impls if i not in IMPLS_OURS + ("fla",)]
    if bad:
        raise SystemExit(f"unknown --impls {bad}")

    import numpy as np
    import jax
    import jax.numpy as jnp

    dtype = jnp_dtype(args.dtype)
    dev = jax.devices()[0]
    on_cpu = dev.platform == "cpu"
    BT = args.chunk
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        jax=jax.__version__, jaxlib=getattr(__import__("jaxlib"), "__version__", "?"),
        device=str(getattr(dev, "device_kind", dev)), platform=dev.platform, n_devices=len(jax.devices()),
        python=platform.python_version(), host=platform.node(), args=vars(args),
    )
    log(f"jax {meta['jax']} on {meta['device']} ({dev.platform}); dtype {args.dtype}; chunk {BT}; "
        f"impls {impls}; sets {args.sets}")

    # ours
    op = None
    if any(i in IMPLS_OURS for i in impls):
        try:
            try:
                from gdp_jax import chunk_gdp_fwd_o as op
            except ImportError:
                from gdp_jax.chunk_o import chunk_gdp_fwd_o as op
        except Exception as e:  # noqa: BLE001
            log("cannot import gdp_jax.chunk_gdp_fwd_o:", short_exc(e))
            traceback.print_exc()

    # fla (and torch, also used for a second copy-bandwidth figure on GPU)
    torch = fla_fwd_o = prep_ci = torch_only = None
    if "fla" in impls:
        try:
            torch, fla_fwd_o, prep_ci, vers = load_fla()
            meta.update(vers)
            log(f"fla {vers['fla']} (torch {vers['torch']}, triton {vers['triton']}) loaded")
        except Exception as e:  # noqa: BLE001
            log("fla unavailable, skipping it:", short_exc(e))
            torch = fla_fwd_o = prep_ci = None
    if torch is None and not on_cpu:
        try:
            import torch as torch_only
            meta.setdefault("torch", torch_only.__version__)
        except Exception:  # noqa: BLE001
            torch_only = None

    # bandwidth
    bw = copy_bandwidth(args, on_cpu, torch if torch is not None else torch_only)
    log("copy bandwidth: " + ", ".join(f"{k}={v:.4g}" for k, v in bw.items()))
    bw_Bps = bw["GBps"] * 1e9

    relerr = relative_error_fn()
    rng = np.random.default_rng(args.seed)
    rows = []
    # SM clock and power-cap state during every GPU timing loop (none on a CPU).
    monitor = GpuMonitor() if not on_cpu else None

    def timed_phase(row, impl):      # wraps the timed loops only, not compiling or warming up
        return monitor.phase(f"{row['shape']}/{impl}") if monitor else None

    def record_phase(row, impl):
        summary = monitor and monitor.summary(f"{row['shape']}/{impl}")
        if summary:
            row[f"{impl}_gpu"] = summary
            log(f"{'':>9}  {GpuMonitor.describe(summary)}")
    for si, shp in enumerate(shapes):
        B, T, H, K, V, M = (shp[c] for c in "BTHKVM")
        label = shape_label(shp)
        scale = K ** -0.5
        row = dict(shape=label, dtype=args.dtype, chunk=BT, **shp)
        log(f"\n=== [{si + 1}/{len(shapes)}] {label} {args.dtype} ===")
        t_shape = time.perf_counter()
        try:
            keys = jax.random.split(jax.random.PRNGKey(args.seed * 1000 + si), args.sets)
            sets = [make_set(keys[i], shp, dtype, BT) for i in range(args.sets)]
            seg = seg_lens = None
            segs_j = [None] * args.sets
            if shp["segs"]:
                seg_np, seg_lens = make_segments(rng, B, T, shp["segs"])
                seg = jnp.asarray(seg_np)
                segs_j = [seg] * args.sets  # same packing for every set (fla's cu_seqlens is per call anyway)
        except Exception as e:  # noqa: BLE001
            log("input generation failed:", short_exc(e))
            row["error"] = short_exc(e)
            rows.append(row)
            continue

        q0, k0, v0, h0, _, g0 = sets[0]
        row["bytes"] = nbytes(q0, k0, v0, h0, g0, seg) + B * T * H * V * np.dtype(v0.dtype).itemsize
        row["floor_ms"] = row["bytes"] / bw_Bps * 1e3 if bw_Bps == bw_Bps else float("nan")
        log(f"bytes moved (ideal) {row['bytes'] / 1e6:.1f} MB -> floor {row['floor_ms']:.4g} ms")

        outs = {}
        for impl in impls:
            if impl not in IMPLS_OURS:
                continue
            if op is None:
                row[f"{impl}_error"] = "gdp_jax.chunk_gdp_fwd_o not importable"
                continue
            try:
                f = jax.jit(lambda q, k, v, h, g, s, _impl=impl: op(
                    q, k, v, h, g, segment_ids=s, scale=scale, chunk_size=BT, num_householder=M,
                    implementation=_impl))
                targs = [(q, k, v, h, g, s) for (q, k, v, h, _, g), s in zip(sets, segs_j)]
                ms, info = time_jax(f, targs, target_s=args.target_ms / 1e3, reps=args.reps,
                                    max_iters=args.max_iters, during=timed_phase(row, impl))
                row[f"{impl}_ms"] = ms
                row[f"{impl}_timing"] = info
                row[f"{impl}_GBps"] = row["bytes"] / (ms / 1e3) / 1e9
                outs[impl] = jax.block_until_ready(f(*targs[0]))
                log(f"{impl:>9}: {ms:.4g} ms  ({row[f'{impl}_GBps']:.0f} GB/s, N={info['n']})")
                record_phase(row, impl)
            except Exception as e:  # noqa: BLE001
                row[f"{impl}_error"] = short_exc(e)
                log(f"{impl:>9}: FAILED {short_exc(e)}")
                traceback.print_exc(limit=4)

        ref_name = "xla" if "xla" in outs else ("pallas" if "pallas" in outs else None)
        for impl in outs:
            if impl != ref_name and ref_name is not None:
                try:
                    row[f"{impl}_relerr_vs_{ref_name}"] = float(relerr(outs[impl], outs[ref_name]))
                    log(f"relerr {impl} vs {ref_name}: {row[f'{impl}_relerr_vs_{ref_name}']:.3g}")
                except Exception as e:  # noqa: BLE001
                    log("relerr failed:", short_exc(e))
        # a finite-ness check of ours
        for impl, o in outs.items():
            try:
                row[f"{impl}_finite"] = bool(jnp.all(jnp.isfinite(o.astype(jnp.float32))))
            except Exception:  # noqa: BLE001
                pass

        # fla. Unpacked: the very same buffers through dlpack. Packed: B=1, concatenated rows, cu_seqlens from
        # the segment packing. fla restarts its chunk grid at every sequence start (ours stays on the fixed
        # grid and masks by segment), so it needs its own h [1, sum ceil(L/BT), H, K, V] and a g that also
        # restarts at sequence starts; the packed case is only timed, its output is not comparable to ours.
        if fla_fwd_o is not None:
            try:
                tsets = []
                if not shp["segs"]:
                    for (q, k, v, h, _, g) in sets:
                        tsets.append(tuple(to_torch(torch, a) for a in (q, k, v, h, g)) + (None, None))
                else:
                    lens = np.concatenate(seg_lens)
                    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
                    cu_t = torch.tensor(cu, dtype=torch.long, device=FLA_DEVICE)
                    ci = prep_ci(cu_t, BT)
                    nt_total = int(sum(-(-int(L) // BT) for L in lens))
                    # chunk starts of fla's per-sequence grid, on the flattened token stream
                    pos = np.arange(B * T) - np.repeat(cu[:-1], lens)
                    start = jnp.asarray((pos % BT == 0)[None, :])
                    row["fla_nt_total"] = nt_total
                    for i, (q, k, v, _, g_raw, _) in enumerate(sets):
                        hf = (0.1 * jax.random.normal(jax.random.PRNGKey(10_000 + si * 10 + i),
                                                      (1, nt_total, H, K, V), jnp.float32)).astype(dtype)
                        gf = restart_cumsum(g_raw.reshape(1, B * T, H) * LOG2E, start)
                        tq, tk, tv, th, tg = (to_torch(torch, a) for a in (q, k, v, hf, gf))
                        tsets.append((tq.view(1, B * T, H, K), tk.view(1, B * T * M, H, K),
                                      tv.view(1, B * T * M, H, V), th, tg.view(1, B * T, H), cu_t, ci))

                def fla_call(q, k, v, h, g, cu, ci):
                    return fla_fwd_o(q, k, v, h, g, scale=scale, cu_seqlens=cu, chunk_size=BT,
                                     num_householder=M, chunk_indices=ci)

                ms, info = time_torch(fla_call, tsets, target_s=args.target_ms / 1e3,
                                      reps=args.reps, max_iters=args.max_iters,
                                      during=timed_phase(row, "fla"))
                row["fla_ms"] = ms
                row["fla_timing"] = info
                row["fla_GBps"] = row["bytes"] / (ms / 1e3) / 1e9
                log(f"{'fla':>9}: {ms:.4g} ms  ({row['fla_GBps']:.0f} GB/s, N={info['n']})")
                record_phase(row, "fla")
                if not args.no_do_bench:
                    try:
                        row["fla_do_bench_ms"] = do_bench_rotated(fla_call, tsets)
                        log(f"{'fla':>9}: do_bench median {row['fla_do_bench_ms']:.4g} ms")
                    except Exception as e:  # noqa: BLE001
                        log("do_bench failed:", short_exc(e))
                if ref_name is not None and not shp["segs"]:
                    o_f = fla_call(*tsets[0]).float()
                    o_r = to_torch(torch, outs[ref_name]).float()
                    row[f"fla_relerr_vs_{ref_name}"] = float((o_f - o_r).norm() / o_r.norm())
                    log(f"relerr fla vs {ref_name}: {row[f'fla_relerr_vs_{ref_name}']:.3g}")
                    del o_f, o_r
                del tsets
            except Exception as e:  # noqa: BLE001
                row["fla_error"] = short_exc(e)
                log(f"{'fla':>9}: FAILED {short_exc(e)}")
                traceback.print_exc(limit=4)

        for impl in IMPLS_OURS:
            if f"{impl}_ms" in row and row.get("floor_ms") == row.get("floor_ms"):
                row[f"{impl}_pct_floor"] = 100.0 * row["floor_ms"] / row[f"{impl}_ms"]
        if "fla_ms" in row and "pallas_ms" in row:
            row["fla_over_pallas"] = row["fla_ms"] / row["pallas_ms"]
        row["wall_s"] = time.perf_counter() - t_shape
        rows.append(row)
        del sets, outs, segs_j, seg
        gc.collect()
        if torch is not None:
            torch.cuda.empty_cache()

    if monitor:
        monitor.close()
    result = dict(meta=meta, copy_bandwidth=bw, rows=rows)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
        log(f"\nwrote {args.out}")
    png = args.png
    if png is None and args.out:
        png = os.path.splitext(args.out)[0] + ".png"
    if png and png.lower() != "none":
        draw_png(rows, meta, bw, png)
    print_results(rows, meta, bw)
    return result


def print_results(rows, meta, bw):
    hdr = ["shape", "dtype", "pallas ms", "% floor", "xla ms", "fla ms", "fla/ours", "floor ms",
           "relerr p/x", "relerr fla", "ours SM MHz, power cap"]
    lines = []
    for r in rows:
        fla_rel = r.get("fla_relerr_vs_xla", r.get("fla_relerr_vs_pallas"))
        pal = r.get("pallas_ms")
        lines.append([
            r["shape"], r["dtype"],
            _fmt(pal) if pal is not None else ("ERR" if "pallas_error" in r else "-"),
            _fmt(r.get("pallas_pct_floor"), ".0f"),
            _fmt(r.get("xla_ms")) if "xla_ms" in r else ("ERR" if "xla_error" in r else "-"),
            _fmt(r.get("fla_ms")) if "fla_ms" in r else ("ERR" if "fla_error" in r else "-"),
            _fmt(r.get("fla_over_pallas"), ".2f"),
            _fmt(r.get("floor_ms")),
            _fmt(r.get("pallas_relerr_vs_xla"), ".2e"),
            _fmt(fla_rel, ".2e") if not r.get("segs") else ("n/a" if "fla_ms" in r else "-"),
            (f"{r['pallas_gpu']['sm_mhz_median']:.0f}, {r['pallas_gpu']['power_capped']:.0%}"
             if r.get("pallas_gpu") else "-"),
        ])
    print_table(hdr, lines,
                f"device {meta['device']} | jax {meta['jax']} | copy bandwidth "
                f"{bw.get('GBps', float('nan')):.0f} GB/s (jax {bw.get('jax_GBps', float('nan')):.0f}, "
                f"torch {bw.get('torch_GBps', float('nan')):.0f}) | % floor = floor/ours; fla/ours > 1 "
                "means ours is faster; packed fla: own chunk grid, timing only")


def draw_png(rows, meta, bw, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except Exception as e:  # noqa: BLE001
        log("no PNG (matplotlib):", short_exc(e))
        return
    try:
        series = [("pallas_ms", "ours pallas"), ("xla_ms", "ours xla"), ("fla_ms", "fla (triton)"),
                  ("floor_ms", "bandwidth floor")]
        series = [s for s in series if any(s[0] in r for r in rows)]
        if not rows or not series:
            log("no PNG: nothing to draw")
            return
        x = np.arange(len(rows))
        w = 0.8 / len(series)
        fig, ax = plt.subplots(figsize=(max(7, 1.7 * len(rows)), 4.8))
        for i, (key, name) in enumerate(series):
            vals = [r.get(key, np.nan) for r in rows]
            bars = ax.bar(x + (i - (len(series) - 1) / 2) * w, vals, w, label=name)
            for b_, v in zip(bars, vals):
                if v == v:
                    ax.annotate(f"{v:.2f}", (b_.get_x() + b_.get_width() / 2, b_.get_height()),
                                ha="center", va="bottom", fontsize=6)
        ax.set_xticks(x)
        ax.set_xticklabels([r["shape"].replace(" M", "\nM") for r in rows], fontsize=7)
        ax.set_ylabel("ms (lower is better)")
        ax.set_title(f"chunk_gdp_fwd_o, {rows[0]['dtype']}, chunk {rows[0]['chunk']} | {meta['device']} | "
                     f"copy {bw.get('GBps', float('nan')):.0f} GB/s", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=130)
        plt.close(fig)
        log(f"wrote {path}")
    except Exception as e:  # noqa: BLE001
        log("PNG failed:", short_exc(e))


if __name__ == "__main__":
    main()
