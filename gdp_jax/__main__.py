"""`python -m gdp_jax`: run chunk_gdp_fwd_o on whatever device is present and check it.

Builds a packed, gated problem through the float64 reference recurrence, feeds its (h, v_new, g) to
chunk_gdp_fwd_o with the default implementation, and reports the implementation, the device, the
relative error against the recurrence's outputs and the time per call. Exits 1 if the error is over
SPEC's bound for that device, so it doubles as a smoke test.
"""
from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import gdp_jax
from gdp_jax import reference


def main(argv=None) -> int:
    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(prog="python -m gdp_jax", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048 if on_gpu else 300)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--key-dim", type=int, default=128 if on_gpu else 64)
    parser.add_argument("--value-dim", type=int, default=128 if on_gpu else 32)
    parser.add_argument("--householder", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--implementation", default=None, help="pallas | xla | interpret (default: auto)")
    args = parser.parse_args(argv)

    b, t, h, kd, vd, m = (args.batch, args.tokens, args.heads, args.key_dim, args.value_dim,
                          args.householder)
    rng = np.random.default_rng(0)
    q = rng.normal(size=(b, t, h, kd)).astype(np.float32)
    k = rng.normal(size=(b, t * m, h, kd))
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32)
    v = rng.normal(size=(b, t * m, h, vd)).astype(np.float32)
    beta = rng.uniform(0.1, 1.9, size=(b, t * m, h)).astype(np.float32)
    g_raw = -rng.uniform(0.0, 0.2, size=(b, t, h)).astype(np.float32)
    segment_ids = np.cumsum(rng.random((b, t)) < 4.0 / t, axis=1).astype(np.int32)  # ~4 per row

    ref = reference.recurrence(q, k, v, g_raw, beta, segment_ids=segment_ids,
                               chunk_size=args.chunk_size, dtype=jnp.float64)
    inputs = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(ref.v_new, jnp.float32),
              jnp.asarray(ref.h, jnp.float32), jnp.asarray(ref.g, jnp.float32))
    seg = jnp.asarray(segment_ids)

    impl = args.implementation or ("pallas" if on_gpu else "xla")
    op = jax.jit(lambda *a: gdp_jax.chunk_gdp_fwd_o(*a, segment_ids=seg, chunk_size=args.chunk_size,
                                                    implementation=impl))
    o = op(*inputs).block_until_ready()
    reps = 20
    start = time.perf_counter()
    for _ in range(reps):
        o = op(*inputs)
    o.block_until_ready()
    ms = (time.perf_counter() - start) / reps * 1e3

    o_ref = np.asarray(ref.o)
    err = float(np.linalg.norm(np.asarray(o, np.float64) - o_ref) / np.linalg.norm(o_ref))
    bound = 2e-3 if jax.default_backend() == "gpu" else 1e-5   # SPEC: tf32 dots on GPU, f32 on CPU
    ok = np.isfinite(err) and err < bound
    print(f"gdp_jax {gdp_jax.__version__}, jax {jax.__version__}")
    print(f"device:         {jax.devices()[0].device_kind} ({jax.default_backend()})")
    print(f"implementation: {impl}")
    print(f"shape:          B={b} T={t} H={h} K={kd} V={vd} M={m} chunk={args.chunk_size}, "
          f"{int(np.sum(segment_ids[:, 1:] != segment_ids[:, :-1])) + b} segments, float32")
    print(f"rel. error vs float64 recurrence: {err:.2e} (bound {bound:.0e}) {'OK' if ok else 'FAIL'}")
    print(f"time per call:  {ms:.3f} ms")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
