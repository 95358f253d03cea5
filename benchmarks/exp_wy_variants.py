#!/usr/bin/env python3
"""Where the WY forward kernel's time goes: variants of wy_pallas's kernel, timed on the op's inputs.

    PYTHONPATH=. python3 benchmarks/exp_wy_variants.py [--shape B=8,T=4096,H=16,K=128,M=2] [--fla]

Each variant changes one part of the kernel (the diagonal blocks' substitution, the off-diagonal
blocks of the inverse, the application of the inverse, the warps) and is timed like tune_states.py
(bench_common.time_jax, 3 rotated input sets). Attribution variants ("skip ...") compute wrong w, u
on purpose and say so; the others print their largest difference from the production kernel
(wy_pallas, which since commit da327b0 runs the "stacked" substitution; the variants' base is the
per-block "reduce" one it replaced). With --fla, fla's forward is profiled per kernel
(torch.profiler) on the same shape. Results: benchmarks/RESULTS.md, sixth session.
"""
from __future__ import annotations

import argparse
import functools

from bench_common import log, parse_shapes, short_exc, time_jax


# Exact (float32) alternatives to the "reduce" substitution, same recurrence T_ii = (I + A_ii)^{-1}
# row by row (row `step` of T = e_step - sum_{c<step} A[step, c] T[c, :]), named
# [stacked_]{rows,rowvec,tcols}[_unrolled] (plain "rows" is spelled "unrolled" / "stacked..."):
#   stacked:  the nb diagonal blocks as one [nb, 16, 16] array (built by broadcasting and selects),
#             each step one masked extraction and one reduction over a 3-D array, not nb 2-D ones;
#   rows:     as "reduce": A[step, :] by a masked sum over A's rows (axis -2), comes out indexed
#             along the columns' axis and is used as a column vector (Triton: a layout change);
#   rowvec:   A kept transposed, A[step, :] is a column of A^T, reduced along axis -1: it comes out
#             indexed along the rows' axis, as the column vector needs it (no layout change);
#   tcols:    T kept transposed (U = T^T), so the serial reduction is along axis -1 (within a warp
#             in Triton's default layout) and the new row is written as a column of U:
#             U[:, step] = -sum_c U[:, c] A[step, c]; A[step, :] used as a row vector;
#   unrolled: a static Python loop (masks are constants) and the rows A[step, :] extracted for all
#             steps up front (they do not depend on the carry, so they leave the serial chain);
#             otherwise a lax.fori_loop over step = 1..15.
SUBST_EXACT = ("unrolled", "rowvec", "rowvec_unrolled", "tcols", "tcols_unrolled",
               "stacked", "stacked_unrolled", "stacked_rowvec", "stacked_rowvec_unrolled",
               "stacked_tcols", "stacked_tcols_unrolled")


def substitute_exact(subst, a_diag):
    """[(I + A_ii)^{-1} for each A_ii in a_diag] (16 x 16 float32, A_ii strictly lower)."""
    import jax
    import jax.numpy as jnp
    f32, B16, nb = jnp.float32, 16, len(a_diag)
    stacked, unrolled = subst.startswith("stacked"), subst.endswith("unrolled")
    mode = "rowvec" if "rowvec" in subst else "tcols" if "tcols" in subst else "rows"
    src = [m.T for m in a_diag] if mode == "rowvec" else a_diag
    if stacked:
        shape = (nb, B16, B16)
        blk = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
        mats = jnp.zeros(shape, f32)
        for i, m in enumerate(src):
            mats = jnp.where(blk == i, m[None, :, :], mats)
        mats = [mats]
    else:
        shape, mats = (B16, B16), list(src)
    r = jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 2)
    c = jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)
    ax_r, ax_c = len(shape) - 2, len(shape) - 1

    def a_row_of(m, step):   # A[step, :]: a column vector [..., 16, 1], or for tcols a row [..., 1, 16]
        if mode == "rowvec":
            return jnp.expand_dims(jnp.sum(jnp.where(c == step, m, 0.0), axis=ax_c), ax_c)
        row = jnp.sum(jnp.where(r == step, m, 0.0), axis=ax_r)
        return jnp.expand_dims(row, ax_r if mode == "tcols" else ax_c)

    def update(step, t, a_row):
        if mode == "tcols":
            new_col = -jnp.sum(t * a_row, axis=ax_c)
            return t + jnp.where(c == step, jnp.expand_dims(new_col, ax_c), 0.0)
        new_row = -jnp.sum(a_row * t, axis=ax_r)
        return t + jnp.where(r == step, jnp.expand_dims(new_row, ax_r), 0.0)

    eye = (r == c).astype(f32)
    ts = tuple(eye for _ in mats)
    if unrolled:
        a_rows = {step: [a_row_of(m, step) for m in mats] for step in range(1, B16)}
        for step in range(1, B16):
            ts = tuple(update(step, t, a_row) for t, a_row in zip(ts, a_rows[step]))
    else:
        ts = jax.lax.fori_loop(
            1, B16, lambda step, ts: tuple(update(step, t, a_row_of(m, step)) for t, m in zip(ts, mats)), ts)
    diag = [jnp.sum(jnp.where(blk == i, ts[0], 0.0), axis=0) for i in range(nb)] if stacked else list(ts)
    return tuple(d.T for d in diag) if mode == "tcols" else tuple(diag)


def make_variant_kernel(*, subst: str, offdiag: bool, apply: str, hoist: bool):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    f32 = jnp.float32
    B16 = 16

    def kernel(k_ref, v_ref, beta_ref, gamma_ref, w_ref, u_ref, *, sub_chunk):
        nb = sub_chunk // B16
        rows_of = lambda i: pl.ds(i * B16, B16)
        beta = [beta_ref[rows_of(i)].astype(f32) for i in range(nb)]
        gamma = [gamma_ref[rows_of(i)] for i in range(nb)]
        keys = [k_ref[rows_of(i), :] for i in range(nb)]
        r16 = jax.lax.broadcasted_iota(jnp.int32, (B16, B16), 0)
        c16 = jax.lax.broadcasted_iota(jnp.int32, (B16, B16), 1)

        def a_block(i, l):
            gram = plgpu.dot(keys[i], keys[l], trans_b=True)
            mask = (r16 > c16) if i == l else jnp.ones((B16, B16), bool)
            coeff = beta[i][:, None] * jnp.exp2(jnp.where(mask, gamma[i][:, None] - gamma[l][None, :], 0.0))
            return jnp.where(mask, coeff * gram, 0.0)

        a = {(i, l): a_block(i, l) for i in range(nb) for l in range(i + 1)}
        eye = (r16 == c16).astype(f32)
        if subst == "reduce":
            def substitute(step, ts):
                out = []
                for i in range(nb):
                    a_row = jnp.sum(jnp.where(r16 == step, a[i, i], 0.0), axis=0)
                    new_row = -jnp.sum(a_row[:, None] * ts[i], axis=0)
                    out.append(ts[i] + jnp.where(r16 == step, new_row[None, :], 0.0))
                return tuple(out)
            diag = jax.lax.fori_loop(1, B16, substitute, tuple(eye for _ in range(nb)))
        elif subst in ("dot", "dot_x3"):
            prec = (jax.lax.Precision.HIGHEST if subst == "dot"
                    else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
            # Row `step` of T_ii = e_step - (A_ii T_ii)[step]: rows < step are final, A strictly lower.
            def substitute(step, ts):
                return tuple(jnp.where(r16 == step, eye - plgpu.dot(a[i, i], ts[i], precision=prec), ts[i])
                             for i in range(nb))
            diag = jax.lax.fori_loop(1, B16, substitute, tuple(eye for _ in range(nb)))
        elif subst in SUBST_EXACT:
            diag = substitute_exact(subst, [a[i, i] for i in range(nb)])
        elif subst == "none":
            diag = tuple(eye - a[i, i] for i in range(nb))
        else:
            raise ValueError(subst)
        t = {(i, i): diag[i] for i in range(nb)}
        tdot = functools.partial(plgpu.dot, precision=None)
        for i in range(1, nb):
            for l in range(i - 1, -1, -1):
                if offdiag:
                    acc = sum(tdot(a[i, j], t[j, l]) for j in range(l, i))
                    t[i, l] = -tdot(t[i, i], acc)
                else:
                    t[i, l] = a[i, l]
        dt = k_ref.dtype
        if hoist:
            rhs_u = [(v_ref[rows_of(l), :].astype(f32) * beta[l][:, None]).astype(dt) for l in range(nb)]
            rhs_w = [(keys[l].astype(f32) * (beta[l] * jnp.exp2(gamma[l]))[:, None]).astype(dt)
                     for l in range(nb)]
        for i in range(nb):
            u_acc = w_acc = None
            for l in (range(i + 1) if apply == "full" else (i,)):
                if hoist:
                    ru, rw = rhs_u[l], rhs_w[l]
                else:
                    ru = (v_ref[rows_of(l), :].astype(f32) * beta[l][:, None]).astype(dt)
                    rw = (keys[l].astype(f32) * (beta[l] * jnp.exp2(gamma[l]))[:, None]).astype(dt)
                t_il = t[i, l].astype(dt)
                du, dw = plgpu.dot(t_il, ru), plgpu.dot(t_il, rw)
                u_acc = du if u_acc is None else u_acc + du
                w_acc = dw if w_acc is None else w_acc + dw
            u_ref[rows_of(i), :] = u_acc.astype(u_ref.dtype)
            w_ref[rows_of(i), :] = w_acc.astype(w_ref.dtype)

    return kernel


def variant_call(k, v, beta, gamma, *, sub, warps, interpret=False, **flags):
    import jax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    batch, positions, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    rows = lambda width: pl.BlockSpec((None, sub, None, width), lambda hd, s, b: (b, s, hd, 0))
    per_position = pl.BlockSpec((None, sub, None), lambda hd, s, b: (b, s, hd))
    kernel = functools.partial(make_variant_kernel(**flags), sub_chunk=sub)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        grid=(heads, positions // sub, batch),
        in_specs=[rows(key_dim), rows(value_dim), per_position, per_position],
        out_specs=(rows(key_dim), rows(value_dim)),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        name="gdp_wy_variant",
        interpret=interpret,
    )(k, v, beta, gamma)


def profile_fla(shp, log_fn):
    import torch
    from fla.ops.gated_delta_product import chunk_gated_delta_product as fla_op
    B, T, H, K, V, M = (shp[c] for c in "BTHKVM")
    dev = "cuda"
    q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, T * M, H, K, device=dev), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T * M, H, V, device=dev, dtype=torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=dev) + 3.0)
    beta = torch.sigmoid(torch.randn(B, T * M, H, device=dev)).to(torch.bfloat16)
    call = lambda: fla_op(q, k, v, g, beta, num_householder=M)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    calls = 10
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            rows[e.key] = t / calls / 1e3
    total = 0.0
    for name, ms in sorted(rows.items(), key=lambda r: -r[1]):
        log_fn(f"  fla kernel {ms:8.4f} ms  {name[:90]}")
        total += ms
    log_fn(f"  fla kernels total {total:.4f} ms per forward")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="B=8,T=4096,H=16,K=128,M=2")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--fla", action="store_true")
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--only", default="", help="semicolon-separated variant names (names hold commas)")
    args = p.parse_args()
    import jax
    import jax.numpy as jnp
    from gdp_jax.chunk import _sub_grid_operands
    from gdp_jax.wy_pallas import wy_pallas

    shp = parse_shapes(args.shape, {})[0]
    B, T, H, K, V, M = (shp[c] for c in "BTHKVM")
    bt = args.chunk

    def make(key):   # as bench_chunk.make_set builds them, then as chunk.py pads them
        kk, kv, kb, kg = jax.random.split(key, 4)
        k = jax.random.normal(kk, (B, T * M, H, K), jnp.float32)
        k = (k * jax.lax.rsqrt(jnp.sum(k * k, -1, keepdims=True))).astype(jnp.bfloat16)
        v = jax.random.normal(kv, (B, T * M, H, V), jnp.float32).astype(jnp.bfloat16)
        beta = jax.nn.sigmoid(jax.random.normal(kb, (B, T * M, H))).astype(jnp.bfloat16)
        g = jax.nn.log_sigmoid(jax.random.normal(kg, (B, T, H)) + 3.0)
        k_p, v_p, beta_p, gamma, _, _, sub = _sub_grid_operands(k, v, beta, g, None, None, bt, M)
        return k_p, v_p, beta_p, gamma

    sets = [jax.block_until_ready(jax.jit(make)(jax.random.PRNGKey(i))) for i in range(3)]
    sub = min(bt, 64)
    time = lambda fn: time_jax(jax.jit(fn), sets, target_s=0.1, reps=3, max_iters=200)[0]
    prod = lambda k, v, b, g, warps=2: wy_pallas(k, v, b, g, None, sub_chunk=sub, out_dtype=k.dtype,
                                                 num_warps=warps, tf32_inverse=True,
                                                 interpret=args.interpret)
    ref_w, ref_u = jax.jit(prod)(*sets[0])
    table = []
    try:
        ms = time(prod)
        table.append(("production (2 warps, tf32 inverse)", ms, 0.0))
        log(f"production: {ms:.4f} ms")
        ms = time(lambda k, v, b, g: prod(k, v, b, None))
        table.append(("production, ungated", ms, float("nan")))
        log(f"production ungated: {ms:.4f} ms")
    except Exception as e:  # noqa: BLE001
        log("production FAILED", short_exc(e))
    base = dict(subst="reduce", offdiag=True, apply="full", hoist=False, warps=2)
    variants = {
        "per-block substitution (production before da327b0)": {},
        "subst by dot (ieee)": dict(subst="dot"),
        "subst by dot (tf32x3)": dict(subst="dot_x3"),
        "hoisted rhs": dict(hoist=True),
        "hoisted rhs + subst dot": dict(hoist=True, subst="dot"),
        "hoisted rhs, 4 warps": dict(hoist=True, warps=4),
        **{f"subst {name.replace('_', ' ')}": dict(subst=name) for name in SUBST_EXACT},
        **{f"hoisted rhs + subst {name.replace('_', ' ')}": dict(hoist=True, subst=name)
           for name in ("unrolled", "tcols", "tcols_unrolled", "stacked_tcols", "stacked_tcols_unrolled")},
        "skip subst [wrong]": dict(subst="none"),
        "skip offdiag [wrong]": dict(offdiag=False),
        "skip subst+offdiag [wrong]": dict(subst="none", offdiag=False),
        "apply diag only [wrong]": dict(apply="diag"),
        "only loads+gram+apply diag [wrong]": dict(subst="none", offdiag=False, apply="diag"),
    }
    only = set(filter(None, args.only.split(";")))
    rel = jax.jit(lambda a, b: jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                  / jnp.max(jnp.abs(b.astype(jnp.float32))))
    for name, change in variants.items():
        if only and name not in only:
            continue
        flags = dict(base, **change)
        fn = lambda k, v, b, g, flags=flags: variant_call(k, v, b, g, sub=sub, interpret=args.interpret, **flags)
        try:
            ms = time(fn)
            w, u = jax.jit(fn)(*sets[0])
            err = max(float(rel(w, ref_w)), float(rel(u, ref_u)))
            log(f"{name}: {ms:.4f} ms, max rel diff {err:.2e}")
            table.append((name, ms, err))
        except Exception as e:  # noqa: BLE001
            log(f"{name}: FAILED {short_exc(e)}")
    if args.fla:
        try:
            profile_fla(shp, log)
        except Exception as e:  # noqa: BLE001
            log("fla profile FAILED", short_exc(e))
    log("\n| WY variant | ms | max rel diff vs production |\n|---|---|---|")
    for name, ms, err in table:
        log(f"| {name} | {ms:.4f} | {err:.1e} |")


if __name__ == "__main__":
    main()
