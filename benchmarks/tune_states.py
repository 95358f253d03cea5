#!/usr/bin/env python3
"""Sweep the launch parameters of the full op's GPU stages 2-3 (wy_pallas, chunk_h_pallas on sub-chunks).

    PYTHONPATH=. python3 benchmarks/tune_states.py [--shape B=8,T=4096,H=16,K=128,M=2] [--out f.json]
        [--wy-warps 2,4,8] [--half-apply 0,1] [--wy-only]

Times (bench_common.time_jax, 3 rotated input sets) the WY kernel for num_warps x half_apply and the
state walk for block_v x num_warps, on the expanded, padded stream exactly as chunk.py feeds them,
and prints one table. Nothing is asserted; a failing config prints its error and the sweep goes on.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os

from bench_common import log, parse_shapes, short_exc, time_jax


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="B=8,T=4096,H=16,K=128,M=2")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--wy-warps", default="2,4,8", help="comma-separated num_warps for the WY sweep")
    p.add_argument("--wy-only", action="store_true", help="skip the chunk_h sweep")
    p.add_argument("--half-apply", default="0,1", help="comma-separated half_apply values (0, 1)")
    p.add_argument("--walk-stages", default="1",
                   help="comma-separated num_stages for the chunk_h sweep (2 and 3 software-pipeline "
                        "the walk's loads: cp.async, seen in the sm_90a build offline)")
    p.add_argument("--walk-blocks", default="16,32,64", help="comma-separated block_v for the chunk_h sweep")
    p.add_argument("--walk-warps", default="2,4,8", help="comma-separated num_warps for the chunk_h sweep")
    p.add_argument("--walk-dot-dtypes", default="bfloat16",
                   help="comma-separated dot_dtype values for the chunk_h sweep (bfloat16, as the op "
                        "runs bf16 inputs; float32: TF32 dots)")
    p.add_argument("--tf32-inverse", default="0", help="comma-separated tf32_inverse values (0, 1); "
                   "with 1, w and u's relative error against the IEEE inverse is printed too")
    args = p.parse_args()
    wy_warps = [int(w) for w in args.wy_warps.split(",") if w]
    half_applies = [bool(int(x)) for x in args.half_apply.split(",") if x]
    tf32_inverses = [bool(int(x)) for x in args.tf32_inverse.split(",") if x]
    import jax
    import jax.numpy as jnp
    from gdp_jax.chunk_h_pallas import chunk_h_pallas
    from gdp_jax.wy_pallas import expanded_log2_decays, sub_chunk_size, wy_pallas

    shp = parse_shapes(args.shape, {})[0]
    B, T, H, K, V, M = (shp[c] for c in "BTHKVM")
    bt = args.chunk
    sub = sub_chunk_size(bt)
    P = -(-T // bt) * bt * M

    def make(key):
        kk, kv, kb, kg = jax.random.split(key, 4)
        k = jax.random.normal(kk, (B, P, H, K), jnp.float32)
        k = (k * jax.lax.rsqrt(jnp.sum(k * k, -1, keepdims=True))).astype(jnp.bfloat16)
        v = jax.random.normal(kv, (B, P, H, V), jnp.float32).astype(jnp.bfloat16)
        beta = jax.nn.sigmoid(jax.random.normal(kb, (B, P, H))).astype(jnp.bfloat16)
        g = jax.nn.log_sigmoid(jax.random.normal(kg, (B, P // M, H)) + 3.0)
        gamma = expanded_log2_decays(g, M, P, sub)
        return k, v, beta, gamma

    sets = [jax.block_until_ready(jax.jit(make)(jax.random.PRNGKey(i))) for i in range(3)]
    rows = []

    def timed(name, cfg, fn, fn_sets):
        try:
            ms, _ = time_jax(jax.jit(fn), fn_sets, target_s=0.1, reps=3, max_iters=200)
            log(f"{name} {cfg}: {ms:.4f} ms")
            rows.append(dict(stage=name, config=cfg, ms=ms))
        except Exception as e:  # noqa: BLE001
            log(f"{name} {cfg}: FAILED {short_exc(e)}")
            rows.append(dict(stage=name, config=cfg, error=short_exc(e)))

    for warps in wy_warps:
        for half in half_applies:
            for tf32 in tf32_inverses:
                cfg = dict(num_warps=warps, half_apply=half, tf32_inverse=tf32)
                timed("wy", cfg, lambda k, v, b, g, cfg=cfg: wy_pallas(
                    k, v, b, g, None, sub_chunk=sub, out_dtype=jnp.bfloat16,
                    interpret=args.interpret, **cfg), sets)
    if True in tf32_inverses:   # accuracy of the TF32 inverse: w, u against the IEEE one's, set 0
        run = lambda tf32: jax.jit(lambda k, v, b, g: wy_pallas(
            k, v, b, g, None, sub_chunk=sub, out_dtype=jnp.float32, interpret=args.interpret,
            tf32_inverse=tf32))(*sets[0])
        rel = lambda x, y: float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y))
        for name, x, y in zip("wu", run(True), run(False)):
            log(f"tf32_inverse relative error of {name} (float32 out): {rel(x, y):.2e}")
            rows.append(dict(stage="tf32_inverse_relerr", config=name, ms=float("nan"),
                             error=f"{rel(x, y):.2e}"))
    wu = [jax.block_until_ready(jax.jit(lambda k, v, b, g: wy_pallas(
        k, v, b, g, None, sub_chunk=sub, out_dtype=jnp.bfloat16, interpret=args.interpret))(*s))
        for s in sets]
    h_sets = [(s[0], w, u, s[3]) for s, (w, u) in zip(sets, wu)]
    ints = lambda text: [int(x) for x in text.split(",") if x]
    walk_configs = itertools.product(ints(args.walk_blocks), ints(args.walk_warps),
                                     ints(args.walk_stages), args.walk_dot_dtypes.split(","))
    for bv, warps, stages, dot_dtype in () if args.wy_only else walk_configs:
        cfg = dict(block_v=bv, num_warps=warps, num_stages=stages, dot_dtype=dot_dtype)
        timed("chunk_h", cfg, lambda k, w, u, g, cfg=cfg: chunk_h_pallas(
            k, w, u, g, None, None, chunk_size=sub, num_householder=1, subchunks=bt * M // sub,
            h_dtype=jnp.bfloat16, v_new_dtype=jnp.bfloat16, interpret=args.interpret, **cfg),
            h_sets)
    if not args.wy_only and "bfloat16" in args.walk_dot_dtypes:   # accuracy of 16-bit walk dots
        walk = lambda dot_dtype: jax.jit(lambda k, w, u, g: chunk_h_pallas(
            k, w, u, g, None, None, chunk_size=sub, num_householder=1, subchunks=bt * M // sub,
            h_dtype=jnp.float32, v_new_dtype=jnp.float32, interpret=args.interpret,
            dot_dtype=dot_dtype))(*h_sets[0])
        rel = lambda x, y: float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y))
        for name, x, y in zip(("h", "v_new", "final"), walk("bfloat16"), walk("float32")):
            log(f"bf16 walk dots: relative difference of {name} (float32 out) from TF32 dots: "
                f"{rel(x, y):.2e}")
            rows.append(dict(stage="walk_bf16_reldiff", config=name, ms=float("nan"),
                             error=f"{rel(x, y):.2e}"))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(shape=shp, chunk=bt, rows=rows), fh, indent=1)
    print(f"\nshape {shp} chunk {bt} sub-chunk {sub}")
    for r in rows:
        print(f"{r['stage']:8} {str(r['config']):45} {r.get('ms', float('nan')):8.4f} {r.get('error', '')[:80]}")


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    main()
