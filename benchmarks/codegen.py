#!/usr/bin/env python3
"""What our Pallas kernels compile to for an H200 (sm_90a), without a GPU.

    PYTHONPATH=. python benchmarks/codegen.py --triton /path/to/site-packages --out /tmp/cg
    PYTHONPATH=. python benchmarks/codegen.py --triton DIR --out /tmp/cg --case full
    PYTHONPATH=. python benchmarks/codegen.py --triton DIR --out /tmp/cg --case full \
        --shape "B=8,T=4096,H=16,K=128,M=3" --stages 1,2     # also every kernel at 1 and 2 stages
    PYTHONPATH=. python benchmarks/codegen.py --out /tmp/cg --variants M2,K256   # the Triton IR only

1. Lowers through JAX's Pallas Triton lowering on CPU (``lowering_platforms=("cuda",)``; no GPU
   needed) and keeps the Triton IR of every pallas_call:
   ``--case chunk_o`` (default): the chunk_o forward kernel (ops.chunk_o.pallas_fwd) at the
   launch variants in VARIANTS (BlockSizes overrides of its default_block_sizes);
   ``--case chunk_o_bwd``: its backward (ops.chunk_o.pallas_bwd) at BWD_VARIANTS (B=8 T=4096
   H=16 K=V=128 M=2, or ``--shape``); ``--case full``: every kernel of jax.grad of the full op
   (chunk_gated_delta_product, implementation="pallas") at B=8 T=4096 H=16 K=V=128 M=2, launch
   parameters as the op picks them (``--shape``: another shape; ``--stages``: each kernel also
   compiled at those pipeline stage counts, rows NAME@sN);
2. with ``--triton`` (a directory holding a separately installed ``triton`` package, e.g.
   ``pip install --target DIR triton``), compiles that IR for sm_90a and runs that Triton's
   bundled ptxas -v on the PTX (registers, spills, the C7512 "wgmma serialized" warning);
3. counts, in the SASS (cuobjdump), global loads (LDG), async copies (LDGSTS, TMA's UTMALDG),
   tensor-core ops (HGMMA, HMMA), local-memory spill traffic (LDL/STL), and prints the order in
   which load groups and tensor-core groups come.
Without --triton only step 1 runs (the .ttir files and the kernels' names, warps and stages).

Caveat: this is the local jax's lowering plus the separate Triton's compiler, not necessarily the
pipeline jaxlib runs on the GPU machine (jax 0.11.2 with its own Triton); treat the numbers as
evidence of what the kernels ask for, not as the GPU's exact binaries. Nothing is timed here.
Results are in CODEGEN.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys


def no_key_loop(key_dim, value_dim, m, **extra):
    """BlockSizes overrides for the kernel without the K loop, as the launch table picks it there:
    all of V <= 128 in one program (wider V: 128-wide tiles looped in one program), 2 stages,
    copy_order "fused" at M >= 3."""
    block_v = min(value_dim, 128)
    return dict(dict(block_k=None, value_step=None, prefetch_values=False, num_stages=2,
                     block_v=block_v, value_blocks_per_program=value_dim // block_v,
                     copy_order="fused" if m >= 3 else "scores_first"), **extra)


# name: (B, T, H, K, V, M, overrides of ops.chunk_o.pallas_fwd.default_block_sizes's choice,
# applied with dataclasses.replace; "segments": True passes segment runs). Kept for the record of
# CODEGEN.md, whose sessions named the same builds through the old kernel_config's overrides.
VARIANTS = {
    "M1": (8, 4096, 16, 128, 128, 1, {}),
    "M2": (8, 4096, 16, 128, 128, 2, {}),
    "M3": (8, 4096, 16, 128, 128, 3, {}),
    "K64": (4, 8192, 32, 64, 64, 2, {}),
    "K256": (2, 16384, 16, 256, 256, 2, {}),
    # v loaded before the K loop (eleventh session): the K = 256, M = 2 default, off elsewhere.
    "K256_no_prefetch": (2, 16384, 16, 256, 256, 2, dict(prefetch_values=False)),
    "K256_M1": (2, 16384, 16, 256, 256, 1, {}),
    "K256_M1_prefetch": (2, 16384, 16, 256, 256, 1, dict(prefetch_values=True)),
    "M2_prefetch": (8, 4096, 16, 128, 128, 2, dict(prefetch_values=True)),
    "M2_segments": (8, 4096, 16, 128, 128, 2, dict(segments=True)),   # with segment ids (packed rows)
    # Both value tiles in one program, so the scores are made once (the next K = 256 lead).
    "K256_vb2": (2, 16384, 16, 256, 256, 2, dict(block_v=128, value_blocks_per_program=2,
                                                 prefetch_values=False)),
    "K256_vb2_s3": (2, 16384, 16, 256, 256, 2, dict(block_v=128, value_blocks_per_program=2,
                                                    prefetch_values=False, num_stages=3)),
    "M2_w8": (8, 4096, 16, 128, 128, 2, no_key_loop(128, 128, 2, num_warps=8)),
    "M3_scores_first": (8, 4096, 16, 128, 128, 3, no_key_loop(128, 128, 3, copy_order="scores_first")),
    "M2_fused": (8, 4096, 16, 128, 128, 2, no_key_loop(128, 128, 2, copy_order="fused")),
    # Without the K loop, timed in the seventh session and earlier.
    # Pipelining over chunks at K = 128 (what took K = 64 from 74 % to 99 % of the floor):
    "M1_cpp2": (8, 4096, 16, 128, 128, 1, no_key_loop(128, 128, 1, chunks_per_program=2)),
    "M1_cpp4": (8, 4096, 16, 128, 128, 1, no_key_loop(128, 128, 1, chunks_per_program=4)),
    "M2_cpp2": (8, 4096, 16, 128, 128, 2, no_key_loop(128, 128, 2, chunks_per_program=2)),
    "M2_bv64_cpp2": (8, 4096, 16, 128, 128, 2, no_key_loop(128, 128, 2, block_v=64, value_blocks_per_program=1,
                                                           chunks_per_program=2)),
    "M2_bv64_cpp4": (8, 4096, 16, 128, 128, 2, no_key_loop(128, 128, 2, block_v=64, value_blocks_per_program=1,
                                                           chunks_per_program=4)),
    "M2_bv64": (8, 4096, 16, 128, 128, 2, no_key_loop(128, 128, 2, block_v=64, value_blocks_per_program=1)),
    # Without the loop over K, the default at K >= 128 until the eighth session:
    "M1_no_k_loop": (8, 4096, 16, 128, 128, 1, no_key_loop(128, 128, 1)),
    "M2_no_k_loop": (8, 4096, 16, 128, 128, 2, no_key_loop(128, 128, 2)),
    "M3_no_k_loop": (8, 4096, 16, 128, 128, 3, no_key_loop(128, 128, 3)),
    "K256_no_k_loop": (2, 16384, 16, 256, 256, 2, no_key_loop(256, 256, 2)),
    # K-loop variants timed and not kept:
    "M2_bk64": (8, 4096, 16, 128, 128, 2, dict(block_k=64, num_stages=2)),
    "M2_bk64_w8": (8, 4096, 16, 128, 128, 2, dict(block_k=64, num_stages=2, num_warps=8)),
    "M3_bk32_s3": (8, 4096, 16, 128, 128, 3, dict(block_k=32, num_stages=3, value_step=None)),
    "K256_bk32_vb2": (2, 16384, 16, 256, 256, 2, dict(block_k=32, num_stages=2, block_v=128,
                                                      value_blocks_per_program=2, prefetch_values=False)),
    # A second loop over value columns for q·h and score·v (value_step; ninth session), and the
    # eighth session's defaults for M = 2 (4 stages) and M = 3 (no value loop):
    "M2_s4": (8, 4096, 16, 128, 128, 2, dict(block_k=32, num_stages=4)),
    "M3_no_value_step": (8, 4096, 16, 128, 128, 3, dict(block_k=64, num_stages=2, value_step=None)),
    "M1_vs64": (8, 4096, 16, 128, 128, 1, dict(value_step=64)),
    "M2_vs32": (8, 4096, 16, 128, 128, 2, dict(value_step=32, num_stages=4)),
    "M2_vs64": (8, 4096, 16, 128, 128, 2, dict(value_step=64, num_stages=4)),
    "M2_vs128": (8, 4096, 16, 128, 128, 2, dict(value_step=128, num_stages=4)),
    "M2_vs64_bk64": (8, 4096, 16, 128, 128, 2, dict(value_step=64, block_k=64, num_stages=2)),
    "M3_vs64": (8, 4096, 16, 128, 128, 3, dict(value_step=64)),
    "K256_vs64": (2, 16384, 16, 256, 256, 2, dict(value_step=64, prefetch_values=False)),
    "K256_one_vs64": (2, 16384, 16, 256, 256, 2, dict(value_step=64, block_v=256, prefetch_values=False)),
    "K256_one_vs32": (2, 16384, 16, 256, 256, 2, dict(value_step=32, block_v=256, prefetch_values=False)),
    "K256_vs64_s2": (2, 16384, 16, 256, 256, 2, dict(value_step=64, num_stages=2, prefetch_values=False)),
    "K256_vs64_s3": (2, 16384, 16, 256, 256, 2, dict(value_step=64, num_stages=3, prefetch_values=False)),
    "K256_vs32_s3": (2, 16384, 16, 256, 256, 2, dict(value_step=32, num_stages=3, prefetch_values=False)),
    "K256_one_vs32_s2": (2, 16384, 16, 256, 256, 2, dict(value_step=32, block_v=256, num_stages=2,
                                                         prefetch_values=False)),
    "K256_one_vs64_s2": (2, 16384, 16, 256, 256, 2, dict(value_step=64, block_v=256, num_stages=2,
                                                         prefetch_values=False)),
    "M2_vs32_s3": (8, 4096, 16, 128, 128, 2, dict(value_step=32, num_stages=3)),
    "M2_vs64_s3": (8, 4096, 16, 128, 128, 2, dict(value_step=64, num_stages=3)),
    "M2_vs64_s2": (8, 4096, 16, 128, 128, 2, dict(value_step=64, num_stages=2)),
    "M3_vs32": (8, 4096, 16, 128, 128, 3, dict(value_step=32)),
    "M1_vs32": (8, 4096, 16, 128, 128, 1, dict(value_step=32)),
    "M1_vs128": (8, 4096, 16, 128, 128, 1, dict(value_step=128)),
}


class _Capture:
    """Context manager: the Triton IR (text), kernel name and launch parameters of every
    pallas_call lowered inside it."""

    def __enter__(self):
        from jax._src.pallas.triton import lowering, pallas_call_registration

        self.kernels, self._registration = [], pallas_call_registration
        self._original = original = lowering.lower_jaxpr_to_triton_module

        def keep(*args, **kwargs):
            result = original(*args, **kwargs)
            caller = sys._getframe(1).f_locals         # the pallas_call lowering rule's locals
            module = result.module.operation
            self.kernels.append(dict(
                ir=module.get_asm(), name=str(module.attributes["sym_name"]).strip('"'),
                num_warps=caller.get("num_warps"), num_stages=caller.get("num_stages")))
            return result

        pallas_call_registration.lowering.lower_jaxpr_to_triton_module = keep
        return self

    def __exit__(self, *exc):
        self._registration.lowering.lower_jaxpr_to_triton_module = self._original


def _lower(fn, args):
    """Lowers for CUDA on this host, for an H200: jax >= 0.11's Triton lowering asks the device
    for its compute capability, which on a CPU host only an abstract device gives."""
    import jax
    h200 = jax.sharding.AbstractMesh(
        (1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
        abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                                    platform="cuda"))
    with jax.sharding.use_abstract_mesh(h200):
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def capture_chunk_o(names, out_dir):
    """Each chunk_o forward variant: {name: info} with its IR written to out_dir/name.ttir."""
    import jax
    import jax.numpy as jnp

    from gdp_jax.ops.chunk_o.pallas_fwd import chunk_o_fwd_pallas, default_block_sizes

    meta = {}
    for name in names:
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
        batch, tokens, heads, key_dim, value_dim, m, overrides = VARIANTS[name]
        overrides = dict(overrides)
        segments = overrides.pop("segments", False)      # not a BlockSizes field: pass runs
        bf16, sds = jnp.bfloat16, jax.ShapeDtypeStruct
        args = (sds((batch, tokens, heads, key_dim), bf16), sds((batch, tokens * m, heads, key_dim), bf16),
                sds((batch, tokens * m, heads, value_dim), bf16),
                sds((batch, tokens // 64, heads, key_dim, value_dim), bf16),
                sds((batch, tokens, heads), jnp.float32),
                sds((batch, tokens), jnp.int32) if segments else None)
        sizes = dataclasses.replace(default_block_sizes(key_dim, value_dim, 64, m), **overrides)
        with _Capture() as cap:
            _lower(lambda q, k, v, h, g, runs, sizes=sizes, m=m, key_dim=key_dim: chunk_o_fwd_pallas(
                q, k, v, h, g, runs, scale=key_dim ** -0.5, chunk_size=64, num_householder=m,
                block_sizes=sizes), args)
        (kernel,) = cap.kernels
        with open(os.path.join(out_dir, f"{name}.ttir"), "w") as fh:
            fh.write(kernel["ir"])
        meta[name] = dict(config=str(sizes), num_warps=sizes.num_warps, num_stages=sizes.num_stages)
    return meta


def capture_full_op(out_dir, shape=None, l2norm: bool = False, gated: bool = True):
    """Every kernel of the full op's forward and backward (bf16; ``shape`` a dict with B, T, H, K,
    V, M, default B=8 T=4096 H=16 K=V=128 M=2; ``l2norm``: use_qk_l2norm; ``gated``: g given, else
    None), and as NAME@primal those the undifferentiated forward launches with another program
    (its own launch rules)."""
    import jax
    import jax.numpy as jnp

    import gdp_jax

    shape = shape or dict(B=8, T=4096, H=16, K=128, V=128, M=2)
    B, T, H, K, V, M = (shape[c] for c in "BTHKVM")
    bf16, sds = jnp.bfloat16, jax.ShapeDtypeStruct
    args = (sds((B, T, H, K), bf16), sds((B, T * M, H, K), bf16), sds((B, T * M, H, V), bf16),
            sds((B, T, H), jnp.float32), sds((B, T * M, H), bf16))

    def loss(q, k, v, g, beta):
        g = g if gated else None
        o, _ = gdp_jax.chunk_gated_delta_product(q, k, v, g, beta, num_householder=M,
                                                 use_qk_l2norm=l2norm, implementation="pallas")
        return o.astype(jnp.float32).sum()

    with _Capture() as cap:
        _lower(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), args)
    with _Capture() as primal:    # the undifferentiated forward launches some kernels otherwise
        _lower(lambda *a: loss(*a), args)
    grad_irs = {kernel["name"]: kernel["ir"] for kernel in cap.kernels}
    kernels = cap.kernels + [dict(kernel, name=kernel["name"] + "@primal") for kernel in primal.kernels
                             if grad_irs.get(kernel["name"]) != kernel["ir"]]
    meta = {}
    for kernel in kernels:
        name = kernel["name"]
        if name in meta:
            continue
        with open(os.path.join(out_dir, f"{name}.ttir"), "w") as fh:
            fh.write(kernel["ir"])
        meta[name] = dict(num_warps=int(kernel["num_warps"]), num_stages=int(kernel["num_stages"]))
    return meta


BWD_VARIANTS = {   # chunk_o backward: BlockSizes overrides of the shape's default
    "bwd_default": {},                                  # split: dh | dq | dk, dv programs
    "bwd_w8": dict(num_warps=8),
    "bwd_s2": dict(num_stages=2),
    "bwd_fused": dict(split=False),                     # one program per chunk
    "bwd_fused_w8": dict(split=False, num_warps=8),
    "bwd_bk64": dict(block_k=64),                       # narrower key blocks (K = 128)
    "bwd_bk64_w8": dict(block_k=64, num_warps=8),
    "bwd_bk128": dict(block_k=128),                     # wider key blocks (K = 256: 64 by default)
}


def capture_chunk_o_bwd(out_dir, shape=None):
    """The chunk_o backward kernel at its default launch and the BWD_VARIANTS, at ``shape`` (a
    common.parse_shapes dict; default B=8 T=4096 H=16 K=V=128 M=2). Variants whose blocks do not
    tile the shape are skipped."""
    import jax
    import jax.numpy as jnp

    from gdp_jax.ops.chunk_o.pallas_bwd import chunk_o_bwd_pallas, default_block_sizes

    shape = shape or dict(B=8, T=4096, H=16, K=128, V=128, M=2)
    B, T, H, K, V, M = (shape[n] for n in ("B", "T", "H", "K", "V", "M"))
    bf16, sds = jnp.bfloat16, jax.ShapeDtypeStruct
    args = (sds((B, T, H, K), bf16), sds((B, T * M, H, K), bf16), sds((B, T * M, H, V), bf16),
            sds((B, T // 64, H, K, V), bf16), sds((B, T, H), jnp.float32), sds((B, T, H, V), bf16))
    meta = {}
    for name, overrides in BWD_VARIANTS.items():
        sizes = dataclasses.replace(default_block_sizes(K, V, 64, 2), **overrides)
        try:
            sizes.check(K, V)
        except ValueError:
            continue
        with _Capture() as cap:
            _lower(lambda q, k, v, h, g, do, sizes=sizes: chunk_o_bwd_pallas(
                q, k, v, h, g, None, do, scale=K ** -0.5, chunk_size=64, num_householder=M,
                block_sizes=sizes), args)
        for i, kernel in enumerate(cap.kernels):
            tag = name if len(cap.kernels) == 1 else f"{name}_{i}"
            with open(os.path.join(out_dir, f"{tag}.ttir"), "w") as fh:
                fh.write(kernel["ir"])
            meta[tag] = dict(config=str(sizes), num_warps=int(kernel["num_warps"]),
                             num_stages=int(kernel["num_stages"]))
    return meta


def compile_and_count(name, info, out_dir, triton_dir, ir_name=None):
    """Compiles out_dir/(ir_name or name).ttir at info's warps and stages; adds what ptxas and the
    SASS say to info."""
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = triton.compile(os.path.join(out_dir, f"{ir_name or name}.ttir"),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=info["num_warps"], num_stages=info["num_stages"]))
    ptx = os.path.join(out_dir, f"{name}.ptx")
    with open(ptx, "w") as fh:
        fh.write(kernel.asm["ptx"])
    bin_dir = os.path.join(triton_dir, "triton", "backends", "nvidia", "bin")
    ptxas = next(os.path.join(bin_dir, p) for p in ("ptxas-blackwell", "ptxas")
                 if os.path.exists(os.path.join(bin_dir, p)))
    cubin = os.path.join(out_dir, f"{name}.cubin")
    report = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", cubin],
                            capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin],
                          capture_output=True, text=True).stdout
    ops = re.findall(r"\b(LDGSTS|UTMALDG|LDG|HGMMA|HMMA|LDL|STL)\b", sass)
    order, last = [], None
    for op in ops:
        if op == last:
            order[-1][1] += 1
        else:
            order.append([op, 1])
            last = op
    info.update(shared_bytes=kernel.metadata.shared, registers=int(regs.group(1)) if regs else None,
                spill_store_bytes=int(spills.group(1)) if spills else None,
                wgmma_serialized="C7512" in report,
                counts={op: ops.count(op) for op in ("LDG", "LDGSTS", "UTMALDG", "HGMMA", "HMMA",
                                                     "LDL", "STL")},
                order=" ".join(f"{op}x{n}" for op, n in order))
    return info


MAIN_LOOP_OPS = ("HGMMA", "HMMA", "WARPGROUP.ARRIVE", "BAR.SYNC", "MEMBAR", "STSM", "STS", "LDS",
                 "LDSM", "SHFL")


def main_loop_counts(cubin: str, triton_dir: str) -> dict:
    """Instruction counts (MAIN_LOOP_OPS, and all instructions) in the longest backward branch's
    body of a cubin's SASS: a walk kernel's chunk loop."""
    cuobjdump = os.path.join(triton_dir, "triton", "backends", "nvidia", "bin", "cuobjdump")
    sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True).stdout
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    loops = []
    for addr, op in ins:
        target = re.search(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", op)
        if target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    if not loops:
        return {}
    start, end = max(loops, key=lambda x: x[1] - x[0])
    body = [re.sub(r"^@!?U?P\w+\s+", "", op).split()[0] for addr, op in ins if start <= addr <= end]
    counts = {key: sum(1 for op in body if op.startswith(key)) for key in MAIN_LOOP_OPS}
    counts["instructions"] = len(body)
    return counts


def build_and_count(name: str, fn, args, sizes, out_dir: str, triton_dir: str) -> dict:
    """Lowers fn(*args) (one pallas_call, launched with ``sizes``' num_warps and num_stages),
    writes its Triton IR to out_dir/name.ttir, compiles it for sm_90a and returns
    compile_and_count's info with the main loop's counts under "loop" (an "error" instead where
    the compile fails)."""
    with _Capture() as cap:
        _lower(fn, args)
    (kernel,) = cap.kernels
    with open(os.path.join(out_dir, f"{name}.ttir"), "w") as fh:
        fh.write(kernel["ir"])
    info = dict(num_warps=sizes.num_warps, num_stages=sizes.num_stages)
    if triton_dir not in sys.path:
        sys.path.insert(0, triton_dir)
    try:
        compile_and_count(name, info, out_dir, triton_dir)
    except Exception as e:   # a failed build is a row of its own
        info["error"] = str(e)[:300]
        return info
    info["loop"] = main_loop_counts(os.path.join(out_dir, f"{name}.cubin"), triton_dir)
    return info


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--triton", default=None,
                   help="directory holding a Triton package with ptxas (without: the IR only)")
    p.add_argument("--out", required=True)
    p.add_argument("--case", default="chunk_o", choices=["chunk_o", "chunk_o_bwd", "full"])
    p.add_argument("--variants", default=",".join(VARIANTS), help="chunk_o variants (--case chunk_o)")
    p.add_argument("--shape", default=None,
                   help="--case full / chunk_o_bwd: 'B=..,T=..,H=..,K=..[,V=..],M=..' "
                        "(default B=8,T=4096,H=16,K=128,M=2)")
    p.add_argument("--l2norm", action="store_true", help="--case full: use_qk_l2norm=True")
    p.add_argument("--no-g", action="store_true", help="--case full: g None (the ungated op)")
    p.add_argument("--stages", default="",
                   help="comma-separated pipeline stage counts to also compile every kernel at "
                        "(rows NAME@sN; with --triton): shared memory and registers of 'num_stages' "
                        "overrides without a GPU")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    shape = None
    if args.shape:
        from common import parse_shapes
        (shape,) = parse_shapes(args.shape)
    if args.case == "chunk_o":
        meta = capture_chunk_o([v for v in args.variants.split(",") if v], args.out)
    elif args.case == "chunk_o_bwd":
        meta = capture_chunk_o_bwd(args.out, shape)
    else:
        meta = capture_full_op(args.out, shape, args.l2norm, gated=not args.no_g)
    if args.triton is None:
        with open(os.path.join(args.out, "codegen.json"), "w") as fh:
            json.dump(meta, fh, indent=1)
        print(f"{'kernel':24} {'warps':>5} {'stages':>6}  (Triton IR in {args.out}; --triton DIR compiles it)")
        for name, r in meta.items():
            print(f"{name:24} {r['num_warps']:5d} {r['num_stages']:6d}")
        return meta
    sys.path.insert(0, args.triton)
    rows = {name: compile_and_count(name, dict(info), args.out, args.triton)
            for name, info in meta.items()}
    for stages in (int(x) for x in args.stages.split(",") if x):
        for name, info in meta.items():
            if stages != info["num_stages"]:
                variant = dict(info, num_stages=stages)
                try:
                    rows[f"{name}@s{stages}"] = compile_and_count(f"{name}@s{stages}", variant,
                                                                  args.out, args.triton, name)
                except Exception as e:  # noqa: BLE001  (e.g. out of shared memory)
                    print(f"{name}@s{stages}: {type(e).__name__}: {str(e)[:200]}")
    with open(os.path.join(args.out, "codegen.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    print(f"{'kernel':24} {'warps':>5} {'stages':>6} {'regs':>5} {'spill B':>7} {'smem B':>7} "
          f"{'C7512':>5}  order")
    for name, r in rows.items():
        print(f"{name:24} {r['num_warps']:5d} {r['num_stages']:6d} {r['registers'] or -1:5d} {r['spill_store_bytes'] or 0:7d} "
              f"{r['shared_bytes']:7d} {'yes' if r['wgmma_serialized'] else 'no':>5}  {r['order']}")
    return rows


if __name__ == "__main__":
    main()
