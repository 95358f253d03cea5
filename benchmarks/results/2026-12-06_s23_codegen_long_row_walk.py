"""Offline sm_90a builds of the long row's primal walk (T applied, narrowed value blocks), the default against
the transposed state (h^T carried, every dot's left operand the previous result): registers, shared memory and
the main loop's tensor-core, barrier and shared-memory instructions.

    # BlockSizes.transposed: in the library since the twenty-fourth session (a patch before), and the
    # launch table's choice here since then; "default" below is the untransposed walk
    pip download --no-deps triton==3.6.0 -d /tmp/tw && (mkdir -p /tmp/triton_site && cd /tmp/triton_site && unzip -q /tmp/tw/triton-*.whl)
    PYTHONPATH=. python benchmarks/results/2026-12-06_s23_codegen_long_row_walk.py /tmp/cg_walk
"""
import dataclasses, json, os, sys
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
import codegen
from gdp_jax.ops.chunk_h import pallas_fwd as hf

out = sys.argv[1]; os.makedirs(out, exist_ok=True)
B, T, H, K, V, M = 1, 65536, 16, 128, 128, 2
P, sub = T * M, 64
bf16, f32, sds = jnp.bfloat16, jnp.float32, jax.ShapeDtypeStruct
args = (sds((B, P, H, K), bf16), sds((B, P, H, sub), bf16), sds((B, P, H, V), bf16),
        sds((B, P, H), f32), sds((B, P, H), bf16))
base = hf.default_block_sizes(K, V, sub, M, 1, bf16, False, walks=B * H, steps=P // sub, applies_inverse=True)
print("default", base)
variants = {"default": dict(transposed=False), "transposed": dict(transposed=True),
            "transposed_w1": dict(transposed=True, num_warps=1),
            "transposed_v64": dict(transposed=True, block_v=64),
            "default_v64": dict(block_v=64, transposed=False)}
meta = {}
for name, over in variants.items():
    sizes = dataclasses.replace(base, **over)
    walk = lambda k, t, v, gamma, beta, sizes=sizes: hf.chunk_h_pallas(
        k, None, v, gamma, None, None, chunk_size=sub, num_householder=1, subchunks=M,
        h_dtype=bf16, v_new_dtype=bf16, dot_dtype=bf16, inverse=t, beta=beta, block_sizes=sizes)
    meta[name] = info = codegen.build_and_count(name, walk, args, sizes, out, "/tmp/triton_site")
    print(name, sizes, {k: info.get(k) for k in ("registers", "spill_store_bytes", "shared_bytes", "error")},
          info.get("loop"), flush=True)
json.dump(meta, open(os.path.join(out, "walk_codegen.json"), "w"), indent=1)
