#!/usr/bin/env python3
"""Where the full op's backward time goes on the GPU path: each stage of _states' custom_vjp alone.

    PYTHONPATH=. python3 benchmarks/profile_full_bwd.py --out $OUT/bwd_stages.json
    PYTHONPATH=. python3 benchmarks/profile_full_bwd.py --shape B=1,T=128,H=2,K=32,M=2 --interpret

On one shape (default B=8 T=4096 H=16 K=V=128 M=2, bf16, g given, chunk 64), times with
bench_common.time_jax (2 rotated input sets), every function jitted:
  states_fwd / states_fwd_rule: stages 1-3 forward, plain and as the custom_vjp's forward rule
                 (which also keeps the state before every sub-chunk);
  walk_bwd:      chunk_h_bwd_pallas on the sub-chunk grid as the op calls it (reverse-walk kernel
                 + epilogue kernel; h's cotangent at token-chunk boundaries);
  walk_kernel:   the reverse-walk kernel alone;
  wy_bwd_xla:    the WY stage's VJP in XLA (wy.wy_bwd_xla); wy_autodiff: jax.vjp of wy.wy_xla;
  wy_bwd_pallas[...]: the Pallas WY VJP kernel (wy_bwd_pallas.py) at a few launch configs
                 (warps, column block, stages), TF32 dots or bf16 operands; the op uses
                 4 warps, 64 columns, 1 stage, TF32 for 16-bit inputs.
Cotangents are small constants: only the times matter. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os

from bench_common import parse_shapes, print_table, short_exc, time_jax


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="B=8,T=4096,H=16,K=128,M=2")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU logic check)")
    p.add_argument("--out", default=None)
    p.add_argument("--walk-configs", default="",
                   help="'bk,bv,warps;...': also time the reverse walk at these blocks and warps")
    p.add_argument("--epilogue-warps", default="", help="comma-separated: also time walk_bwd at these")
    args = p.parse_args()
    import jax
    import jax.numpy as jnp

    from gdp_jax.chunk import _states_pallas, _sub_grid_operands
    from gdp_jax.chunk_h_bwd_pallas import chunk_h_bwd_pallas, chunk_h_bwd_walk
    from gdp_jax.wy import wy_bwd_xla, wy_xla
    from gdp_jax.wy_bwd_pallas import wy_bwd_pallas

    (shp,) = parse_shapes(args.shape, {})
    B, T, H, K, V, M = (shp[c] for c in "BTHKVM")
    bt, dt, f32 = args.chunk, jnp.bfloat16, jnp.float32
    stage = dict(chunk_size=bt, num_householder=M, interpret=args.interpret)

    def make(key):
        ks = jax.random.split(key, 4)
        k = jax.random.normal(ks[0], (B, T * M, H, K), f32)
        k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(dt)
        v = jax.random.normal(ks[1], (B, T * M, H, V), dt)
        g = -jax.random.uniform(ks[2], (B, T, H), f32, 0.01, 0.2)
        beta = jax.random.uniform(ks[3], (B, T * M, H), f32, 0.1, 1.9)
        return k, v, g, beta

    sets = [make(jax.random.PRNGKey(i)) for i in range(2)]
    rows = {}

    def timed(name, fn, fn_sets):
        try:
            rows[name], _ = time_jax(jax.jit(fn), fn_sets, target_s=0.1, reps=3, max_iters=50)
        except Exception as e:  # noqa: BLE001
            rows[name] = short_exc(e)
        print(f"{name:>16}: {rows[name]}", flush=True)

    fwd_rule = lambda k, v, g, beta: _states_pallas(k, v, beta, g, None, None, every_sub_chunk=True,
                                                    **stage)
    timed("states_fwd", lambda k, v, g, beta: _states_pallas(k, v, beta, g, None, None, **stage),
          sets)
    timed("states_fwd_rule", fwd_rule, sets)

    # The backward stages' operands, as _states_bwd builds them (sub-chunk grid, padded).
    stage_sets = []
    for k, v, g, beta in sets:
        k_p, v_p, beta_p, gamma, _, _, sub = _sub_grid_operands(k, v, beta, g, None, None, bt, M)
        _, _, _, (w, inverse, h_sub, v_new_p) = jax.jit(fwd_rule)(k, v, g, beta)
        per_chunk = bt * M // sub           # sub-chunks per token chunk: h's cotangent is per chunk
        # h and v_new are 16-bit on this path, so their cotangents are too.
        dh = jnp.full((B, h_sub.shape[1] // per_chunk) + h_sub.shape[2:], 1e-3, h_sub.dtype)
        dv_new = jnp.full(v_new_p.shape, 1e-3, v_new_p.dtype)
        dfinal = jnp.zeros(h_sub.shape[:1] + h_sub.shape[2:], f32)
        stage_sets.append((k_p, v_p, beta_p, gamma, w, h_sub, v_new_p, dh, dv_new, dfinal, inverse))
    walk = dict(chunk_size=sub, num_householder=1, with_initial_state=False,
                interpret=args.interpret, subchunks=per_chunk, dot_dtype=dt)   # as _states_bwd
    timed("walk_bwd", lambda k_p, v_p, beta_p, gamma, w, h_sub, v_new_p, dh, dv_new, dfinal, _:
          chunk_h_bwd_pallas(k_p, w, gamma, None, h_sub, v_new_p, dh, dv_new, dfinal, **walk),
          stage_sets)
    timed("walk_kernel", lambda k_p, v_p, beta_p, gamma, w, h_sub, v_new_p, dh, dv_new, dfinal, _:
          chunk_h_bwd_walk(k_p, w, gamma, None, dh, dv_new, dfinal, **walk), stage_sets)
    for config in filter(None, args.walk_configs.split(";")):
        bk, bv, warps = (int(x) for x in config.split(","))
        timed(f"walk_kernel[bk{bk},bv{bv},w{warps}]",
              lambda k_p, v_p, beta_p, gamma, w, h_sub, v_new_p, dh, dv_new, dfinal, _, bk=bk,
              bv=bv, warps=warps: chunk_h_bwd_walk(k_p, w, gamma, None, dh, dv_new, dfinal,
                                                  block_k=bk, block_v=bv, num_warps=warps, **walk),
              stage_sets)
    for warps in (int(x) for x in args.epilogue_warps.split(",") if x):
        timed(f"walk_bwd[epilogue w{warps}]",
              lambda k_p, v_p, beta_p, gamma, w, h_sub, v_new_p, dh, dv_new, dfinal, _,
              warps=warps: chunk_h_bwd_pallas(k_p, w, gamma, None, h_sub, v_new_p, dh, dv_new,
                                              dfinal, epilogue_warps=warps, **walk), stage_sets)
    # Stand-in cotangents of the WY stage: w as dw, v_p as du (only the time matters).
    timed("wy_bwd_xla", lambda k_p, v_p, beta_p, gamma, w, *_: wy_bwd_xla(
        k_p, v_p, beta_p, gamma, None, w, v_p, chunk_size=sub), stage_sets)

    def wy_autodiff(k_p, v_p, beta_p, gamma, w, *_):
        fn = lambda *a: wy_xla(*a, None, chunk_size=sub, num_householder=1)
        _, vjp = jax.vjp(fn, k_p.astype(f32), v_p.astype(f32), beta_p.astype(f32), gamma)
        return vjp((w.astype(f32), v_p.astype(f32)))
    timed("wy_autodiff", wy_autodiff, stage_sets)

    # num_stages 2-3 software-pipeline the column loops' loads (cp.async in the sm_90a build,
    # seen offline); "highest" (IEEE float32 dots) was 23-111 ms here, so it is not swept again.
    # "bf16": every dot's operands rounded to bfloat16 (operand_dtype), as fla's WY backward does.
    for warps, cols, stages, operands in [
            (4, 64, 1, None), (4, 32, 1, None), (4, 64, 2, None), (4, 32, 2, None), (4, 64, 3, None),
            (4, 64, 1, "bf16"), (4, 32, 1, "bf16"), (4, 128, 1, "bf16"), (8, 64, 1, "bf16"),
            (4, 64, 2, "bf16")]:
        launch = dict(num_warps=warps, block_cols=cols, num_stages=stages, precision=None,
                      operand_dtype=None if operands is None else jnp.bfloat16)
        timed(f"wy_bwd_pallas[w{warps},c{cols},s{stages}{',' + operands if operands else ''}]",
              lambda k_p, v_p, beta_p, gamma, w, *rest, launch=launch: wy_bwd_pallas(
                  k_p, v_p, beta_p, gamma, None, rest[-1], w, v_p, sub_chunk=sub,
                  interpret=args.interpret, **launch), stage_sets)

    dev = jax.devices()[0]
    meta = dict(jax=jax.__version__, device=str(getattr(dev, "device_kind", dev)), shape=shp,
                chunk=bt, dtype="bf16")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(dict(meta=meta, ms=rows), fh, indent=1)
    fmt = lambda x: f"{x:.3f}" if isinstance(x, float) else str(x)[:60]
    print_table(["stage", "ms"], [[n, fmt(x)] for n, x in rows.items()],
                f"{meta['device']} | jax {meta['jax']} | {args.shape} chunk {bt} bf16")


if __name__ == "__main__":
    main()
