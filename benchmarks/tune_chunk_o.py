"""Sweep launch configs of the chunk_o forward kernel on the GPU; prints the best per shape.

Used to fill the table in ``gdp_jax.chunk_o_pallas.kernel_config``: each config is checked against
the jnp path, then timed (jit, warm-up, 3 rotated input sets, median of 5 timed loops).
    PYTHONPATH=. python benchmarks/tune_chunk_o.py [--quick] [--fla]
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

import jax
import jax.numpy as jnp

from gdp_jax.chunk_o import chunk_o_xla
from gdp_jax.chunk_o_pallas import chunk_o_pallas, kernel_config
from gdp_jax.segments import segment_runs

SHAPES = [  # B, T, H, K, V, M, segments per row
    (8, 4096, 16, 128, 128, 2, 0), (8, 4096, 16, 128, 128, 1, 0), (8, 4096, 16, 128, 128, 3, 0),
    (4, 8192, 32, 64, 64, 2, 0), (2, 16384, 16, 256, 256, 2, 0), (8, 4096, 16, 128, 128, 2, 8),
]
LOG2_E = 1.4426950408889634


def make_inputs(key, b, t, h, kd, vd, m, nseg, bt=64, dtype=jnp.bfloat16):
    ks = jax.random.split(key, 6)
    nt = -(-t // bt)
    q = jax.random.normal(ks[0], (b, t, h, kd), dtype)
    k = jax.random.normal(ks[1], (b, t * m, h, kd), jnp.float32)
    k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    v = (0.1 * jax.random.normal(ks[2], (b, t * m, h, vd))).astype(dtype)
    hs = (0.1 * jax.random.normal(ks[3], (b, nt, h, kd, vd))).astype(dtype)
    g_raw = -jax.nn.softplus(jax.random.normal(ks[4], (b, nt * bt, h)))
    g = (LOG2_E * g_raw.reshape(b, nt, bt, h).cumsum(2)).reshape(b, nt * bt, h)[:, :t]
    runs = None
    if nseg:
        runs = segment_runs(jnp.cumsum(jax.random.uniform(ks[5], (b, t)) < nseg / t, axis=1))
    return q, k, v, hs, g, runs


def bench(fn, sets, reps=5):
    out = fn(*sets[0]); jax.block_until_ready(out)
    t0 = time.perf_counter(); jax.block_until_ready(fn(*sets[1 % len(sets)])); est = time.perf_counter() - t0
    n = max(3, min(200, int(0.05 / max(est, 1e-6))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(n):
            out = fn(*sets[i % len(sets)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times) * 1e3


def copy_bandwidth():
    """Best of a jnp elementwise pass and torch's copy_ over 2 GiB, bytes read + written per second."""
    x = jnp.ones((512 * 1024 * 1024,), jnp.float32)
    ms = bench(jax.jit(lambda a: a + 1), [(x,)], reps=5)
    best = 2 * x.nbytes / (ms * 1e-3)
    del x
    try:
        import torch
        a = torch.empty(512 * 1024 * 1024, dtype=torch.float32, device="cuda"); b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            b.copy_(a)
        end.record(); torch.cuda.synchronize()
        best = max(best, 2 * a.numel() * 4 / (start.elapsed_time(end) / 20 * 1e-3))
        del a, b
    except Exception as e:  # noqa: BLE001 - torch is optional
        print(f"torch copy bandwidth unavailable: {e}")
    return best


def sweep(kd, vd, m, full):
    """Configs tried for one shape (keyword overrides of kernel_config)."""
    out = []
    block_vs = [(vd, 1), (vd // 2, 2), (vd // 2, 1)] if vd >= 64 else [(vd, 1)]
    if kd >= 256:
        block_vs = [(128, 2), (64, 4), (64, 2), (64, 1), (128, 1)]
    for (bv, vbpp), hf in itertools.product(block_vs, (False, True)):
        for stages in ((2, 3) if full else (2,)):
            out.append(dict(block_v=bv, value_blocks_per_program=vbpp, heads_fastest=hf, num_stages=stages))
    if full:  # launch-level knobs, on the headline shape
        for warps in (2, 4, 8):
            out.append(dict(num_warps=warps))
    if kd <= 64:  # pipelining over chunks fits shared memory only for narrow tiles
        for cpp, hf, stages in itertools.product((2, 4, 8), (False, True), (2, 3)):
            out.append(dict(chunks_per_program=cpp, heads_fastest=hf, num_stages=stages))
    else:
        # K >= 128: the loop over K (block_k) at its step widths and pipeline depths, and the
        # kernel without it (block_k=0) for comparison.
        out.append(dict(block_k=0))
        for bk, stages in itertools.product((32, 64), (2, 3, 4, 5)):
            out.append(dict(block_k=bk, num_stages=stages))
        # ... and the second loop over value columns (value_step) for q·h and score·v.
        for step, bk in itertools.product((32, 64), (32, 64)):
            out.append(dict(value_step=step, block_k=bk, num_stages=2))
    return out


def parse_configs(text):
    """'a=1,b=x;c=2' -> [{'a': 1, 'b': 'x'}, {'c': 2}] (ints and True/False converted)."""
    def value(v):
        return int(v) if v.lstrip("-").isdigit() else {"True": True, "False": False}.get(v, v)
    return [dict((kv.split("=")[0], value(kv.split("=")[1])) for kv in part.split(","))
            for part in text.split(";") if part]


def fla_time(sets, m, scale):
    import torch
    from fla.ops.gated_delta_product.chunk_deltaproduct_o import chunk_gated_delta_product_fwd_o
    tsets = [tuple(torch.from_dlpack(x) for x in s[:5]) for s in sets]
    call = lambda s: chunk_gated_delta_product_fwd_o(*s, scale=scale, num_householder=m)
    for s in tsets:
        call(s)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(60):
            call(tsets[i % len(tsets)])
        end.record(); torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 60)
    o_fla = call(tsets[0])
    return statistics.median(times), jnp.asarray(o_fla.float().cpu().numpy())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="headline shape only")
    ap.add_argument("--fla", action="store_true", help="also time fla in this process")
    ap.add_argument("--only", default=None, help="comma-separated indices into SHAPES")
    ap.add_argument("--configs", default=None,
                    help="time these kernel_config overrides (after the default) instead of the "
                         "sweep: 'key=value,...;key=value,...', e.g. 'copy_order=fused;num_warps=8'")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    chosen = [int(i) for i in args.only.split(",")] if args.only else range(1 if args.quick else len(SHAPES))
    for si in chosen:
        b, t, h, kd, vd, m, nseg = SHAPES[si]
        sets = [make_inputs(jax.random.PRNGKey(10 * si + j), b, t, h, kd, vd, m, nseg) for j in range(3)]
        nbytes = sum(x.size * x.dtype.itemsize for x in sets[0] if x is not None) + b * t * h * vd * 2
        floor_ms = nbytes / bw * 1e3
        kw = dict(scale=kd ** -0.5, chunk_size=64, num_householder=m)
        ref = jax.jit(lambda *a: chunk_o_xla(*a, **kw))(*sets[0]).astype(jnp.float32)
        label = f"B={b} T={t} H={h} K={kd} V={vd} M={m}" + (f" seg~{nseg}" if nseg else "")
        results = []
        tried = parse_configs(args.configs) if args.configs else sweep(kd, vd, m, full=si == 0)
        for over in [{}] + tried:
            cfg = kernel_config(kd, vd, 64, m, **over)
            fn = jax.jit(lambda *a, cfg=cfg: chunk_o_pallas(*a, config=cfg, **kw))
            try:
                o = fn(*sets[0]).astype(jnp.float32)
                err = float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref))
                ms = bench(fn, sets)
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is just skipped
                print(f"  {label} {over or 'default'}: FAILED {type(e).__name__}: {str(e)[:160]}")
                continue
            results.append((ms, str(over or "default"), err))
            print(f"  {label} {over or 'default'}: {ms:.3f} ms ({floor_ms / ms:.0%} of floor) err {err:.1e}")
        fla = "-"
        if args.fla and not nseg:
            try:
                fla_ms, o_fla = fla_time(sets, m, kd ** -0.5)
                fla = f"{fla_ms:.3f} ({float(jnp.linalg.norm(o_fla - ref) / jnp.linalg.norm(ref)):.1e})"
            except Exception as e:  # noqa: BLE001
                fla = f"err {type(e).__name__}: {str(e)[:120]}"
        default_ms = next((r[0] for r in results if r[1] == "default"), float("nan"))
        rows.append((label, floor_ms, default_ms, min(results), fla))
    print(f"\n{'shape':38s} {'floor ms':>8s} {'default':>8s} {'best ms':>8s} {'%floor':>6s} err      fla ms (err)  best config")
    for label, floor_ms, default_ms, (ms, over, err), fla in rows:
        print(f"{label:38s} {floor_ms:8.3f} {default_ms:8.3f} {ms:8.3f} {floor_ms / ms:6.1%} {err:.1e}  {fla}  {over}")


if __name__ == "__main__":
    main()
