"""Quick first look: time pallas vs xla on the headline shape (the full benchmark is bench_chunk_o.py)."""
import time, sys
import jax, jax.numpy as jnp, numpy as np
import gdp_jax

B, T, H, K, V, M, BT = 8, 4096, 16, 128, 128, 2, 64
NT = T // BT
key = jax.random.split(jax.random.PRNGKey(0), 6)
dt = jnp.bfloat16
q = jax.random.normal(key[0], (B, T, H, K), dt)
k = jax.random.normal(key[1], (B, T * M, H, K), dt) / jnp.sqrt(K).astype(dt)
v = (0.1 * jax.random.normal(key[2], (B, T * M, H, V))).astype(dt)
h = (0.1 * jax.random.normal(key[3], (B, NT, H, K, V))).astype(dt)
graw = -jax.nn.softplus(jax.random.normal(key[4], (B, T, H)))
g = (graw.reshape(B, NT, BT, H).cumsum(2) * 1.4426950408889634).reshape(B, T, H)
seg = jnp.cumsum(jax.random.uniform(key[5], (B, T)) < 8 / T, axis=1).astype(jnp.int32)
for name, kw in [("plain", {}), ("segments", dict(segment_ids=seg))]:
    res = {}
    for impl in ["pallas", "xla"]:
        f = jax.jit(lambda q, k, v, h, g: gdp_jax.chunk_gdp_fwd_o(q, k, v, h, g, implementation=impl, **kw))
        o = f(q, k, v, h, g).block_until_ready()
        n = 20
        t0 = time.perf_counter()
        for _ in range(n):
            o = f(q, k, v, h, g)
        o.block_until_ready()
        res[impl] = ((time.perf_counter() - t0) / n * 1e3, o)
    err = float(jnp.linalg.norm(res["pallas"][1].astype(jnp.float32) - res["xla"][1].astype(jnp.float32))
                / jnp.linalg.norm(res["xla"][1].astype(jnp.float32)))
    nbytes = sum(x.size * x.dtype.itemsize for x in (q, k, v, h, g)) + B * T * H * V * 2
    print(f"{name}: pallas {res['pallas'][0]:.3f} ms  xla {res['xla'][0]:.3f} ms  rel(pallas,xla) {err:.2e}  "
          f"floor@4.27TB/s {nbytes / 4.27e12 * 1e3:.3f} ms")
