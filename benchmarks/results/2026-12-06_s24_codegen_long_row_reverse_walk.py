"""Offline sm_90a builds of the long row's reverse walk (from T, narrowed value blocks, the op's call), the default
against dS carried transposed (BwdBlockSizes.transposed, results/2026-12-06_s24_reverse_walk_transposed_dropped.patch):
registers, spills, shared memory and the main loop's tensor-core, barrier and shared-memory instructions.

    git apply benchmarks/results/2026-12-06_s24_reverse_walk_transposed_dropped.patch
    pip download --no-deps triton==3.6.0 -d /tmp/tw && (mkdir -p /tmp/triton_site && cd /tmp/triton_site && unzip -q /tmp/tw/triton-*.whl)
    PYTHONPATH=. python benchmarks/results/2026-12-06_s24_codegen_long_row_reverse_walk.py /tmp/cg_rwalk
    ... /tmp/cg_rwalk default,transposed,tr32,tr2,tr1     # the variants to build (default: the first four)
"""
import dataclasses, json, os, sys
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
import codegen
from gdp_jax.ops.chunk_h import pallas_bwd as hb

out = sys.argv[1]; os.makedirs(out, exist_ok=True)
B, T, H, K, V, M = 1, 65536, 16, 128, 128, 2
P, sub = T * M, 64
bf16, f32, sds = jnp.bfloat16, jnp.float32, jax.ShapeDtypeStruct
NS = P // sub
args = (sds((B, P, H, K), bf16), sds((B, P, H, sub), bf16), sds((B, P, H), f32), sds((B, NS // M, H, K, V), bf16),
        sds((B, P, H, V), bf16), sds((B, H, K, V), f32), sds((B, P, H), bf16))
base = hb.default_block_sizes(K, V, sub, sub * M, bf16, walks=B * H, steps=NS, applies_inverse=True)
print("default", base)
variants = {"default": {}, "transposed": dict(transposed=True),
            "default_v64": dict(block_v=64), "transposed_v64": dict(transposed=True, block_v=64),
            "tr32": dict(transposed=True, block_v=32), "tr2": dict(transposed=True, num_warps=2),
            "tr1": dict(transposed=True, num_warps=1)}
chosen = sys.argv[2].split(",") if len(sys.argv) > 2 else list(variants)[:4]
meta = {}
for name, over in ((n, variants[n]) for n in chosen):
    sizes = dataclasses.replace(base, **over)
    walk = lambda k, t, gamma, dh, dv, dfinal, beta, sizes=sizes: hb.chunk_h_bwd_walk(
        k, None, gamma, None, dh, dv, dfinal, chunk_size=sub, num_householder=1,
        with_initial_state=False, subchunks=M, dot_dtype=bf16, inverse=t, beta=beta,
        block_sizes=sizes)
    meta[name] = info = codegen.build_and_count(name, walk, args, sizes, out, "/tmp/triton_site")
    print(name, sizes, {k: info.get(k) for k in ("registers", "spill_store_bytes", "shared_bytes", "error")},
          info.get("loop"), flush=True)
json.dump(meta, open(os.path.join(out, "reverse_walk_codegen.json"), "w"), indent=1)
