#!/usr/bin/env python3
"""Benchmark the full op, gdp_jax.chunk_gated_delta_product, against fla 0.6.0's chunk_gated_delta_product.

Run on a GPU box from the repo root (fla and torch importable for the fla columns):

    PYTHONPATH=. python3 benchmarks/bench_chunk.py --out $OUT/full.json
    PYTHONPATH=. python3 benchmarks/bench_chunk.py --shapes tiny --interpret     # CPU logic check

What it times, per shape (bf16 by default; every JAX function jitted; input sets rotated as in
bench_common.time_jax; fla with CUDA events on torch copies of the same inputs):
  * ours_fwd:        o, final_state of chunk_gated_delta_product(implementation="pallas"), gated;
  * ours_fwdbwd:     value and gradient of sum(o * do) in q, k, v, g, beta (gated);
  * ours_fwdbwd_ng:  the same without g (to compare with fla's ungated backward);
  * xla_fwd:         the jnp path (implementation="xla"), for scale;
  * stage_states, stage_o: the forward's stages alone (the WY + state-walk kernels with their
                     jnp prologue, and the Pallas chunk_o), to show where the time goes;
  * fla_fwd:         fla's forward, gated; fla_fwdbwd_ng: forward + backward, ungated (fla 0.6.0 refuses
                     the gated backward on Triton 3.6 / Hopper; a gated attempt is made and its error kept).
Packed shapes (segs > 0) give us segment ids and fla the same packing as cu_seqlens over one
flattened row (B = 1), as fla requires.

Sanity: relative Frobenius error of our o against fla's o on input set 0 (and of our jnp path's o).
Nothing is asserted; a failing column prints its error and the run goes on. The table is printed last.
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

from bench_common import (add_dtype_arg, add_timing_args, jnp_dtype, fmt as _fmt, log,
                          parse_shapes as _parse_shapes, relative_error_fn, shape_label, short_exc,
                          time_jax, time_torch, print_table)

SHAPE_SETS = {
    "default": [
        dict(B=8, T=4096, H=16, K=128, V=128, M=2),
        dict(B=8, T=4096, H=16, K=128, V=128, M=2, segs=8),
        dict(B=8, T=4096, H=16, K=128, V=128, M=1),
        dict(B=8, T=4096, H=16, K=128, V=128, M=3),
    ],
    "quick": [dict(B=8, T=4096, H=16, K=128, V=128, M=2)],
    "tiny": [dict(B=1, T=100, H=2, K=32, V=32, M=2), dict(B=2, T=64, H=2, K=16, V=32, M=1, segs=3)],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="default", help="default, quick, tiny, or 'B=..,T=..,...;...'")
    add_dtype_arg(p)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--only", default="", help="comma-separated subset of columns to time")
    p.add_argument("--no-fla", action="store_true", help="skip fla even if importable")
    p.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU logic check only)")
    add_timing_args(p, max_iters=200, copy_mb=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write JSON results here")
    args = p.parse_args(argv)
    args.sets = max(3, args.sets)
    return args


def make_set(key, shp, dtype, rng):
    """q, k, v, g (natural log, <= 0), beta, segment ids (or None), do; k is L2-normalised."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    B, T, H, K, V, M = (shp[c] for c in "BTHKVM")

    @jax.jit
    def gen(key):
        kq, kk, kv, kg, kb, kd = jax.random.split(key, 6)
        q = jax.random.normal(kq, (B, T, H, K), jnp.float32)
        q = (q * jax.lax.rsqrt(jnp.sum(q * q, -1, keepdims=True))).astype(dtype)
        k = jax.random.normal(kk, (B, T * M, H, K), jnp.float32)
        k = (k * jax.lax.rsqrt(jnp.sum(k * k, -1, keepdims=True))).astype(dtype)
        v = jax.random.normal(kv, (B, T * M, H, V), jnp.float32).astype(dtype)
        g = jax.nn.log_sigmoid(jax.random.normal(kg, (B, T, H), jnp.float32) + 3.0)
        beta = jax.nn.sigmoid(jax.random.normal(kb, (B, T * M, H), jnp.float32)).astype(dtype)
        do = jax.random.normal(kd, (B, T, H, V), jnp.float32).astype(dtype)
        return q, k, v, g, beta, do

    q, k, v, g, beta, do = jax.block_until_ready(gen(key))
    ids = None
    if shp["segs"]:
        ids = np.zeros((B, T), np.int32)
        for b in range(B):
            cuts = np.sort(rng.choice(np.arange(1, T), size=min(shp["segs"], T) - 1, replace=False))
            ids[b] = np.searchsorted(cuts, np.arange(T), side="right")
        ids = jnp.asarray(ids)
    return q, k, v, g, beta, ids, do


def to_fla(q, k, v, g, beta, ids, do):
    """Torch views (dlpack) on the GPU; packed rows are flattened to B = 1 with cu_seqlens (fla's
    varlen form)."""
    import jax
    import numpy as np
    import torch

    def t(x):  # zero-copy through dlpack; a host round trip (slow at these sizes) only if that fails
        jax.block_until_ready(x)
        try:
            return torch.from_dlpack(x)
        except Exception:  # noqa: BLE001
            a = np.asarray(x.astype("float32") if x.dtype.name == "bfloat16" else x)
            out = torch.from_numpy(np.array(a)).cuda()
            return out.to(torch.bfloat16) if x.dtype.name == "bfloat16" else out

    tq, tk, tv, tg, tb, tdo = map(t, (q, k, v, g, beta, do))
    cu = None
    if ids is not None:
        B, T = ids.shape
        ids_np = np.asarray(ids)
        starts = [0]
        for b in range(B):
            row = ids_np[b]
            cut = np.flatnonzero(row[1:] != row[:-1]) + 1
            starts += list(b * T + cut) + [(b + 1) * T]
        cu = torch.tensor(sorted(set(starts)), dtype=torch.long, device="cuda")
        flat = lambda x: x.reshape(1, -1, *x.shape[2:]).contiguous()
        tq, tk, tv, tg, tb, tdo = map(flat, (tq, tk, tv, tg, tb, tdo))
    return tq, tk, tv, tg, tb, tdo, cu


def main(argv=None):
    args = parse_args(argv)
    shapes = _parse_shapes(args.shapes, SHAPE_SETS)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import gdp_jax
    from gdp_jax.chunk import _states_pallas
    from gdp_jax.chunk_o import chunk_gdp_fwd_o
    from gdp_jax.cumsum import chunk_local_log2_cumsum
    from gdp_jax.segments import segment_runs

    dtype = jnp_dtype(args.dtype)
    dev = jax.devices()[0]
    impl = "interpret" if args.interpret else "pallas"
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                jax=jax.__version__, device=str(getattr(dev, "device_kind", dev)), platform=dev.platform,
                python=platform.python_version(), args=vars(args))
    torch = fla_op = None
    if not args.no_fla and dev.platform == "gpu":
        try:
            import torch
            from fla.ops.gated_delta_product import chunk_gated_delta_product as fla_op
            meta["torch"] = torch.__version__
        except Exception as e:  # noqa: BLE001
            log("fla not importable:", short_exc(e))
    log(f"jax {meta['jax']} on {meta['device']}; dtype {args.dtype}; chunk {args.chunk}; impl {impl}; "
        f"fla {'yes' if fla_op else 'no'}")
    relerr = relative_error_fn()
    rng = np.random.default_rng(args.seed)
    only = set(filter(None, args.only.split(",")))
    rows = []
    for si, shp in enumerate(shapes):
        B, T, H, K, V, M = (shp[c] for c in "BTHKVM")
        bt = args.chunk
        row = dict(shape=shape_label(shp), dtype=args.dtype, **shp)
        log(f"\n=== [{si + 1}/{len(shapes)}] {row['shape']} ===")
        t_shape = time.perf_counter()
        keys = jax.random.split(jax.random.PRNGKey(args.seed * 1000 + si), args.sets)
        sets = [make_set(keys[i], shp, dtype, rng) for i in range(args.sets)]
        kw = dict(num_householder=M, chunk_size=bt)

        def op(q, k, v, g, beta, ids, implementation=impl):
            return gdp_jax.chunk_gated_delta_product(q, k, v, g, beta, segment_ids=ids,
                                                     output_final_state=True,
                                                     implementation=implementation, **kw)

        def fwdbwd(gated):
            def loss(q, k, v, g, beta, ids, do):
                o, _ = op(q, k, v, g if gated else None, beta, ids)
                return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
            argnums = (0, 1, 2, 3, 4) if gated else (0, 1, 2, 4)
            return jax.value_and_grad(loss, argnums=argnums)

        def stage_states(q, k, v, g, beta, ids):
            runs = None if ids is None else segment_runs(ids)
            return _states_pallas(k, v, beta, g, runs, None, interpret=args.interpret, **kw)

        fns = dict(
            ours_fwd=lambda q, k, v, g, beta, ids, do: op(q, k, v, g, beta, ids),
            ours_fwdbwd=fwdbwd(True),
            ours_fwdbwd_ng=fwdbwd(False),
            xla_fwd=lambda q, k, v, g, beta, ids, do: op(q, k, v, g, beta, ids, implementation="xla"),
            stage_states=lambda q, k, v, g, beta, ids, do: stage_states(q, k, v, g, beta, ids),
        )
        # chunk_o alone, on the h / v_new the op produced for set 0's shapes (values don't matter for time)
        NT = -(-T // bt)
        h_dummy = jnp.zeros((B, NT, H, K, V), dtype)
        fns["stage_o"] = lambda q, k, v, g, beta, ids, do: chunk_gdp_fwd_o(
            q, k, v, h_dummy, chunk_local_log2_cumsum(g, bt), segment_ids=ids, implementation=impl, **kw)
        outs = {}
        for name, fn in fns.items():
            if only and name not in only:
                continue
            try:
                jfn = jax.jit(fn)
                ms, info = time_jax(jfn, sets, target_s=args.target_ms / 1e3, reps=args.reps,
                                    max_iters=args.max_iters)
                row[f"{name}_ms"] = ms
                log(f"{name:>15}: {ms:.4g} ms (N={info['n']})")
                if name in ("ours_fwd", "xla_fwd"):
                    outs[name] = jax.block_until_ready(jfn(*sets[0]))
            except Exception as e:  # noqa: BLE001
                row[f"{name}_error"] = short_exc(e)
                log(f"{name:>15}: FAILED {short_exc(e)}")
                traceback.print_exc(limit=6)
            gc.collect()
        for name in ("xla_fwd",):
            if name in outs and "ours_fwd" in outs:
                row[f"relerr_o_{name}_vs_ours"] = float(relerr(outs[name][0], outs["ours_fwd"][0]))
                row[f"relerr_state_{name}_vs_ours"] = float(relerr(outs[name][1], outs["ours_fwd"][1]))

        if fla_op is not None and (not only or any(n.startswith("fla") for n in only)):
            fla_sets = [to_fla(*s) for s in sets]

            def fla_fwd(q, k, v, g, b, do, cu):
                return fla_op(q, k, v, g, b, num_householder=M, output_final_state=True, cu_seqlens=cu)

            def fla_fwdbwd(gated):
                def run(q, k, v, g, b, do, cu):
                    leaves = [x.detach().requires_grad_(True) for x in (q, k, v, b)]
                    gg = g.detach().requires_grad_(True) if gated else None
                    o, _ = fla_op(leaves[0], leaves[1], leaves[2], gg, leaves[3], num_householder=M,
                                  output_final_state=True, cu_seqlens=cu)
                    o.backward(do)
                return run

            for name, fn in (("fla_fwd", fla_fwd), ("fla_fwdbwd_ng", fla_fwdbwd(False)),
                             ("fla_fwdbwd", fla_fwdbwd(True))):
                if only and name not in only:
                    continue
                try:
                    ms, info = time_torch(fn, fla_sets, target_s=args.target_ms / 1e3, reps=args.reps,
                                          max_iters=args.max_iters)
                    row[f"{name}_ms"] = ms
                    log(f"{name:>15}: {ms:.4g} ms (N={info['n']})")
                except Exception as e:  # noqa: BLE001
                    row[f"{name}_error"] = short_exc(e)
                    log(f"{name:>15}: FAILED {short_exc(e)}")
            if "ours_fwd" in outs:
                try:
                    o_fla, s_fla = fla_fwd(*fla_sets[0])
                    o_fla = jnp.asarray(o_fla.float().cpu().numpy()).reshape(B, T, H, V)
                    row["relerr_o_vs_fla"] = float(relerr(outs["ours_fwd"][0], o_fla))
                    if shp["segs"] == 0:
                        s_fla = jnp.asarray(s_fla.float().cpu().numpy())
                        row["relerr_state_vs_fla"] = float(relerr(outs["ours_fwd"][1], s_fla))
                    log(f"relerr vs fla: o {row['relerr_o_vs_fla']:.2e}"
                        + (f", final state {row['relerr_state_vs_fla']:.2e}" if "relerr_state_vs_fla" in row
                           else ""))
                except Exception as e:  # noqa: BLE001
                    log("relerr vs fla failed:", short_exc(e))
            del fla_sets
            torch.cuda.empty_cache()
        if "fla_fwd_ms" in row and "ours_fwd_ms" in row:
            row["fla_over_ours_fwd"] = row["fla_fwd_ms"] / row["ours_fwd_ms"]
        if "fla_fwdbwd_ng_ms" in row and "ours_fwdbwd_ng_ms" in row:
            row["ours_over_fla_fwdbwd_ng"] = row["ours_fwdbwd_ng_ms"] / row["fla_fwdbwd_ng_ms"]
        row["wall_s"] = time.perf_counter() - t_shape
        rows.append(row)
        del sets, outs
        gc.collect()

    result = dict(meta=meta, rows=rows)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
        log(f"\nwrote {args.out}")
    print_results(rows, meta)
    return result


COLUMNS = ["ours_fwd", "fla_fwd", "ours_fwdbwd", "ours_fwdbwd_ng", "fla_fwdbwd_ng", "fla_fwdbwd",
           "xla_fwd", "stage_states", "stage_o"]


def print_results(rows, meta):
    hdr = ["shape"] + COLUMNS + ["fla/ours fwd", "ours/fla fb ng", "err vs fla"]
    lines = []
    for r in rows:
        cell = lambda n: _fmt(r[f"{n}_ms"]) if f"{n}_ms" in r else ("ERR" if f"{n}_error" in r else "-")
        lines.append([r["shape"]] + [cell(c) for c in COLUMNS]
                     + [_fmt(r.get("fla_over_ours_fwd"), ".2f"), _fmt(r.get("ours_over_fla_fwdbwd_ng"), ".2f"),
                        _fmt(r.get("relerr_o_vs_fla"), ".1e")])
    print_table(hdr, lines, f"device {meta['device']} | jax {meta['jax']} | ms per call; "
                            "fb = forward + backward; ng = ungated (g None)")


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    main()
