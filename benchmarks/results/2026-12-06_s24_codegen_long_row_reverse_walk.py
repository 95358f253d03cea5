"""Offline sm_90a builds of the long row's reverse walk (from T, narrowed value blocks, the op's call), the default
against dS carried transposed (BwdBlockSizes.transposed, results/2026-12-06_s24_reverse_walk_transposed_pending.patch):
registers, spills, shared memory and the main loop's tensor-core, barrier and shared-memory instructions.

    git apply benchmarks/results/2026-12-06_s24_reverse_walk_transposed_pending.patch
    pip download --no-deps triton==3.6.0 -d /tmp/tw && (mkdir -p /tmp/triton_site && cd /tmp/triton_site && unzip -q /tmp/tw/triton-*.whl)
    PYTHONPATH=. python benchmarks/results/2026-12-06_s24_codegen_long_row_reverse_walk.py /tmp/cg_rwalk
"""
import dataclasses, json, os, re, subprocess, sys
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
            "default_v64": dict(block_v=64), "transposed_v64": dict(transposed=True, block_v=64)}
meta = {}
for name, over in variants.items():
    sizes = dataclasses.replace(base, **over)
    with codegen._Capture() as cap:
        codegen._lower(lambda k, t, gamma, dh, dv, dfinal, beta, sizes=sizes: hb.chunk_h_bwd_walk(
            k, None, gamma, None, dh, dv, dfinal, chunk_size=sub, num_householder=1,
            with_initial_state=False, subchunks=M, dot_dtype=bf16, inverse=t, beta=beta,
            block_sizes=sizes), args)
    (kernel,) = cap.kernels
    with open(os.path.join(out, f"{name}.ttir"), "w") as fh:
        fh.write(kernel["ir"])
    info = dict(num_warps=sizes.num_warps, num_stages=sizes.num_stages)
    if "/tmp/triton_site" not in sys.path:
        sys.path.insert(0, "/tmp/triton_site")
    try:
        codegen.compile_and_count(name, info, out, "/tmp/triton_site")
    except Exception as e:
        info["error"] = str(e)[:300]
    sass = subprocess.run(["/tmp/triton_site/triton/backends/nvidia/bin/cuobjdump", "-sass",
                           os.path.join(out, f"{name}.cubin")], capture_output=True, text=True).stdout
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    loops = []
    for addr, op in ins:
        mm = re.search(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", op)
        if mm and int(mm.group(1), 16) < addr:
            loops.append((int(mm.group(1), 16), addr))
    counts = {}
    if loops:
        a, b = max(loops, key=lambda x: x[1] - x[0])
        body = [re.sub(r"^@!?U?P\w+\s+", "", op).split()[0] for ad, op in ins if a <= ad <= b]
        for key in ("HGMMA", "HMMA", "WARPGROUP.ARRIVE", "BAR.SYNC", "MEMBAR", "STSM", "STS", "LDS", "LDSM", "SHFL"):
            counts[key] = sum(1 for o in body if o.startswith(key))
        counts["instructions"] = len(body)
    info["loop"] = counts
    meta[name] = info
    print(name, sizes, {k: info.get(k) for k in ("registers", "spill_store_bytes", "shared_bytes", "error")}, counts, flush=True)
json.dump(meta, open(os.path.join(out, "reverse_walk_codegen.json"), "w"), indent=1)
