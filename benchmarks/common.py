"""What the benchmark scripts share: shapes, the one input builder, timing, the GPU monitor, copy
bandwidth and floors, fla helpers, output, dtype names, and ``load_baseline``.

Timing: jitted JAX functions by wall clock over N back-to-back calls rotating through several
input sets (so the L2 never holds a working set), after block_until_ready, divided by N, median of
``reps`` loops; torch / fla functions the same way with CUDA events. N is picked so that one loop
lasts about ``target_ms``. Copy bandwidth counts bytes read + written; a floor is the bytes a call
must move (each input read once, each output written once) over that bandwidth.

Importing this module sets XLA_PYTHON_CLIENT_PREALLOCATE=false (JAX and torch share the GPU).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import importlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

LOG2E = 1.0 / math.log(2.0)

# ------------------------------------------------------------------------------------------ shapes
# B T H K V M, segs = segments per row (packed rows, random lengths; 0: unpacked).
HEADLINE = [
    dict(B=8, T=4096, H=16, K=128, V=128, M=1),
    dict(B=8, T=4096, H=16, K=128, V=128, M=2),
    dict(B=8, T=4096, H=16, K=128, V=128, M=3),
    dict(B=4, T=8192, H=32, K=64, V=64, M=2),
    dict(B=2, T=16384, H=16, K=256, V=256, M=2),
    dict(B=8, T=4096, H=16, K=128, V=128, M=2, segs=8),
]
HEADLINE_SHAPE = "B=8,T=4096,H=16,K=128,V=128,M=2"
SHAPE_SETS = {
    "headline": HEADLINE,
    "quick": [dict(B=8, T=4096, H=16, K=128, V=128, M=2),
              dict(B=8, T=4096, H=16, K=128, V=128, M=2, segs=8)],
    # The script's logic on a CPU; the numbers mean nothing.
    "tiny": [dict(B=2, T=200, H=2, K=32, V=32, M=2), dict(B=2, T=64, H=2, K=32, V=16, M=1, segs=3)],
}


def parse_shapes(spec: str, shape_sets: Optional[dict] = None):
    """A named set (``shape_sets``, default SHAPE_SETS) or 'B=..,T=..,H=..,K=..[,V=..],M=..[,segs=..];...'.
    V defaults to K, segs to 0."""
    shape_sets = SHAPE_SETS if shape_sets is None else shape_sets
    if spec in shape_sets:
        items = [dict(s) for s in shape_sets[spec]]
    else:
        items = []
        for item in filter(None, (s.strip() for s in spec.split(";"))):
            d = {}
            for kv in item.split(","):
                key, _, val = kv.partition("=")
                try:
                    d[key.strip()] = int(val)
                except ValueError:
                    raise SystemExit(f"shape {item!r}: {kv!r} is not KEY=integer; named sets: "
                                     f"{', '.join(shape_sets)}") from None
            missing = {"B", "T", "H", "K", "M"} - set(d)
            if missing:
                raise SystemExit(f"shape {item!r} lacks {sorted(missing)}")
            items.append(d)
    for d in items:
        d.setdefault("V", d["K"])
        d.setdefault("segs", 0)
    return items


def shape_label(s) -> str:
    lab = f"B{s['B']} T{s['T']} H{s['H']} K{s['K']}"
    if s.get("V", s["K"]) != s["K"]:
        lab += f" V{s['V']}"
    lab += f" M{s['M']}"
    if s.get("segs"):
        lab += f" seg{s['segs']}"
    return lab


def shape_sets_epilog(shape_sets: dict) -> str:
    return ("shape sets: " + "; ".join(f"{k}: " + ", ".join(map(shape_label, v))
                                       for k, v in shape_sets.items())
            + '.\nCustom: --shapes "B=8,T=4096,H=16,K=128,V=128,M=2,segs=8;B=1,T=512,H=4,K=64,M=1"')


# ------------------------------------------------------------------------------------------ dtypes
# --dtype: the short names the scripts print and store, each with its jnp name, and the other
# spellings they accept.
DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}
DTYPE_ALIASES = {**{name: short for short, name in DTYPES.items()}, "fp16": "f16", "half": "f16",
                 "fp32": "f32", "float": "f32", "bfloat": "bf16"}


def parse_dtype(name: str) -> str:
    """'bf16', 'bfloat16', 'fp16', 'float16', 'half', 'f32', 'fp32', 'float32', ... -> the short name."""
    short = DTYPE_ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    if short not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: bf16, f16 (fp16, float16) or f32 (fp32, float32)")
    return short


def add_dtype_arg(parser, default="bf16"):
    """--dtype bf16 | f16 | f32 (also fp16, float16, bfloat16, ...); args.dtype is the short name,
    and jnp_dtype(args.dtype) the array dtype."""
    def parse(name):
        try:
            return parse_dtype(name)
        except ValueError as e:
            import argparse
            raise argparse.ArgumentTypeError(str(e)) from None
    parser.add_argument("--dtype", default=default, type=parse,
                        help="input dtype: bf16 (bfloat16), f16 (fp16, float16) or f32 (fp32, float32)")


def jnp_dtype(name):
    import jax.numpy as jnp
    return getattr(jnp, DTYPES[parse_dtype(name)])


# ------------------------------------------------------------------------------------------ inputs
@dataclasses.dataclass
class Problem:
    """One input set of chunk_gdp_fwd_o (op "chunk_o") or of chunk_gated_delta_product ("full").

    q [B, T, H, K]; k [B, T*M, H, K] (L2-normalised); v [B, T*M, H, V]; do [B, T, H, V] (a
    cotangent of o); g: for "chunk_o" the chunk-local log2 cumsum [B, T, H] float32 the output stage
    takes, for "full" the natural-log gate [B, T, H] float32 (<= 0); g_raw: the natural-log gate
    (both ops); None when ungated. "chunk_o": h [B, NT, H, K, V]; "full": beta [B, T*M, H].
    segment_ids [B, T] int32 (or None), runs their run numbers, lengths each row's segment lengths.
    """
    op: str
    shape: dict
    dtype: str
    chunk_size: int
    q: Any
    k: Any
    v: Any
    do: Any
    g: Any = None
    g_raw: Any = None
    h: Any = None
    beta: Any = None
    segment_ids: Any = None
    runs: Any = None
    lengths: Any = None

    def chunk_o_args(self):
        """(q, k, v, h, g, segment_ids): chunk_gdp_fwd_o's operands."""
        return self.q, self.k, self.v, self.h, self.g, self.segment_ids

    def full_args(self):
        """(q, k, v, g, beta, segment_ids): chunk_gated_delta_product's operands."""
        return self.q, self.k, self.v, self.g, self.beta, self.segment_ids

    def cu_seqlens(self):
        """fla's cu_seqlens for the same packing: int64 offsets over the B rows flattened into one
        (every row start and every segment start), [N + 1]."""
        import numpy as np
        B, T = self.shape["B"], self.shape["T"]
        lengths = self.lengths if self.lengths is not None else [np.array([T])] * B
        return np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64)


def make_packing(rng, batch: int, tokens: int, segments: int):
    """Random packing: ``segments`` segments of random length per row. (ids int32 [B, T], lengths)."""
    import numpy as np
    ids = np.zeros((batch, tokens), np.int32)
    lengths = []
    segments = max(1, min(segments, tokens))
    for b in range(batch):
        cuts = (np.sort(rng.choice(np.arange(1, tokens), size=segments - 1, replace=False))
                if segments > 1 else np.array([], int))
        lengths.append(np.diff(np.concatenate([[0], cuts, [tokens]])))
        ids[b] = np.searchsorted(cuts, np.arange(tokens), side="right")
    return ids, lengths


def make_problems(shape: dict, *, op: str, dtype="bf16", sets: int = 3, chunk_size: int = 64,
                  gated: bool = True, seed: int = 0) -> list:
    """``sets`` independent Problems of one shape, sharing one packing (shape["segs"] segments per
    row, or none). The inputs the benchmarks feed every implementation (ours, the baseline's, fla's):

    q normal ("full": L2-normalised), k L2-normalised, v 0.1 * normal ("full": normal), h 0.1 *
    normal, g_raw = -softplus(normal - 2) ("full": log_sigmoid(normal + 3)), beta = sigmoid(normal)
    in the inputs' dtype, do normal.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gdp_jax import segment_runs
    from gdp_jax.ops.cumsum import chunk_local_log2_cumsum

    if op not in ("chunk_o", "full"):
        raise ValueError(f"op must be 'chunk_o' or 'full'; got {op!r}")
    short = parse_dtype(dtype)
    dt = jnp_dtype(short)
    B, T, H, K, V, M = (shape[c] for c in "BTHKVM")
    NT = -(-T // chunk_size)
    f32 = jnp.float32
    unit = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)

    @jax.jit
    def gen(key):
        kq, kk, kv, kh, kg, kb, kd = jax.random.split(key, 7)
        q = jax.random.normal(kq, (B, T, H, K), f32)
        k = unit(jax.random.normal(kk, (B, T * M, H, K), f32)).astype(dt)
        v = jax.random.normal(kv, (B, T * M, H, V), f32)
        do = jax.random.normal(kd, (B, T, H, V), f32).astype(dt)
        noise = jax.random.normal(kg, (B, T, H), f32)
        if op == "chunk_o":
            h = (0.1 * jax.random.normal(kh, (B, NT, H, K, V), f32)).astype(dt)
            g_raw = -jax.nn.softplus(noise - 2.0)
            return dict(q=q.astype(dt), k=k, v=(0.1 * v).astype(dt), h=h, g_raw=g_raw,
                        g=chunk_local_log2_cumsum(g_raw, chunk_size).astype(f32), do=do)
        beta = jax.nn.sigmoid(jax.random.normal(kb, (B, T * M, H), f32)).astype(dt)
        g_raw = jax.nn.log_sigmoid(noise + 3.0)
        return dict(q=unit(q).astype(dt), k=k, v=v.astype(dt), g_raw=g_raw, g=g_raw, beta=beta,
                    do=do)

    segment_ids = runs = lengths = None
    if shape.get("segs"):
        ids, lengths = make_packing(np.random.default_rng(seed), B, T, shape["segs"])
        segment_ids = jnp.asarray(ids)
        runs = segment_runs(segment_ids)
    # RBG keys: the generator compiles in a fraction of threefry's time (the values do not matter).
    keys = jax.random.split(jax.random.key(seed, impl="unsafe_rbg"), sets)
    problems = []
    for key in keys:
        arrays = jax.block_until_ready(gen(key))
        if not gated:
            arrays["g"] = arrays["g_raw"] = None
        problems.append(Problem(op=op, shape=dict(shape), dtype=short, chunk_size=chunk_size,
                                segment_ids=segment_ids, runs=runs, lengths=lengths, **arrays))
    return problems


def tile_width(n: int) -> int:
    """The kernels' tile rule: the next power of two, at least 16."""
    return max(16, 1 << (int(n) - 1).bit_length())


def sub_grid_inputs(p: Problem) -> dict:
    """The full op's stage-2/3 operands on the Pallas path's sub-chunk grid, built by the library
    from a "full" Problem (``gdp_jax.ops.gated_delta_product.sub_grid_operands``), with the op's
    dtype rules for these stages' kernels (``stage_dtypes``): keys k_p, v_p, beta_p, gamma,
    runs_p, sub, subchunks, work_dtype, walk_bwd_dot_dtype, wy_bwd (precision, operand_dtype).
    """
    import jax

    from gdp_jax.ops.cumsum import sub_chunk_size
    from gdp_jax.ops.gated_delta_product import stage_dtypes, sub_grid_operands

    M = p.shape["M"]
    build = jax.jit(lambda k, v, beta, g, runs: sub_grid_operands(
        k, v, beta, g, runs, None, p.chunk_size, M)[:5])
    k_p, v_p, beta_p, gamma, runs_p = build(p.k, p.v, p.beta, p.g, p.runs)
    sub = sub_chunk_size(p.chunk_size)
    rules = stage_dtypes(p.k.dtype)
    return dict(k_p=k_p, v_p=v_p, beta_p=beta_p, gamma=gamma, runs_p=runs_p, sub=sub,
                subchunks=p.chunk_size * M // sub, work_dtype=rules.work,
                walk_bwd_dot_dtype=rules.walk_bwd_dot,
                wy_bwd=dict(precision=rules.wy_bwd_precision, operand_dtype=rules.wy_bwd_operand))


# ---------------------------------------------------------------------------------- floors, errors
def nbytes(*trees) -> int:
    """Bytes of every array in the given pytrees (None ignored)."""
    import jax
    return int(sum(x.size * x.dtype.itemsize for t in trees for x in jax.tree_util.tree_leaves(t)
                   if hasattr(x, "dtype")))


def chunk_o_bytes(p: Problem, *, backward: bool = False) -> int:
    """Bytes chunk_gdp_fwd_o must move. Forward: q, k, v, h, g, segment ids read once, o written
    once. Backward: those and do read once, dq, dk, dv, dh (primal dtypes) and dg written once."""
    B, T, H, V = (p.shape[c] for c in "BTHV")
    inputs = nbytes(p.q, p.k, p.v, p.h, p.g, p.segment_ids)
    if not backward:
        return inputs + B * T * H * V * p.v.dtype.itemsize
    return inputs + nbytes(p.do) + nbytes(p.q, p.k, p.v, p.h, p.g)


def floor_ms(num_bytes: float, bandwidth: dict) -> float:
    gbps = bandwidth.get("GBps", float("nan"))
    return num_bytes / (gbps * 1e9) * 1e3 if gbps == gbps and gbps > 0 else float("nan")


# The ~156M GatedDeltaProduct LM of bench_generate.py and profile_lm_prefill.py (fla's config names).
LM_CONFIG = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_heads=6,
                 head_dim=128, expand_v=1.0, num_householder=2, use_forget_gate=True,
                 allow_neg_eigval=True, use_short_conv=True, conv_size=4, use_output_gate=True,
                 hidden_ratio=4, norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2)


def roofline_ms(num_bytes: float, flops: float, bandwidth: dict, rate: dict) -> dict:
    """A kernel's floor: the larger of its bytes over the copy bandwidth and its matrix FLOPs
    over the measured matrix rate (``matmul_rate``), with which one binds."""
    memory = floor_ms(num_bytes, bandwidth)
    tflops = rate.get("TFLOPs", float("nan"))
    compute = flops / (tflops * 1e12) * 1e3 if tflops == tflops and tflops > 0 else float("nan")
    known = [x for x in (memory, compute) if x == x]
    return dict(bytes=num_bytes, flops=flops, memory_ms=memory, compute_ms=compute,
                floor_ms=max(known) if known else float("nan"),
                bound="-" if not known else ("memory" if memory == max(known) else "compute"))


def relative_error_fn():
    """A jitted ||a - b|| / ||b|| over all elements, in float32."""
    import jax
    import jax.numpy as jnp
    f32 = lambda x: x.astype(jnp.float32).ravel()
    return jax.jit(lambda a, b: jnp.linalg.norm(f32(a) - f32(b)) / jnp.maximum(
        jnp.linalg.norm(f32(b)), 1e-30))


_RELERR = None


def relative_errors(a, b) -> list:
    """||a_i - b_i|| / ||b_i|| per leaf of two pytrees of one structure (None leaves skipped),
    non-finite leaves of a giving inf."""
    global _RELERR
    import jax
    import jax.numpy as jnp
    _RELERR = _RELERR or relative_error_fn()
    out = []
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        finite = bool(jnp.all(jnp.isfinite(x.astype(jnp.float32))))
        out.append(float(_RELERR(x, y)) if finite else float("inf"))
    return out


def max_relative_error(a, b) -> float:
    errors = relative_errors(a, b)
    return max(errors) if errors else float("nan")


# ------------------------------------------------------------------------------------------ timing
def add_timing_args(parser, *, sets=3, reps=5, target_ms=150.0, max_iters=300, copy_mb=2048.0):
    """The timing options (time_jax, time_torch, copy_bandwidth); a script passes its own
    defaults, and copy_mb=None leaves --copy-mb out."""
    parser.add_argument("--sets", type=int, default=sets,
                        help=f"input sets rotated in the timing loops (default {sets}; at least 3 "
                             "keeps the inputs out of L2)")
    parser.add_argument("--reps", type=int, default=reps,
                        help=f"timed loops per measurement, median reported (default {reps})")
    parser.add_argument("--target-ms", type=float, default=target_ms,
                        help=f"wall time to aim for per timed loop, which sets its call count "
                             f"(default {target_ms:g})")
    parser.add_argument("--max-iters", type=int, default=max_iters,
                        help=f"most calls in one timed loop (default {max_iters})")
    if copy_mb is not None:
        parser.add_argument("--copy-mb", type=float, default=copy_mb,
                            help=f"size of the copy-bandwidth buffer in MB (default {copy_mb:g})")


def timing_kwargs(args) -> dict:
    return dict(target_s=args.target_ms / 1e3, reps=args.reps, max_iters=args.max_iters)


def pick_n(est_s, target_s, nsets, max_iters):
    """Calls per timed loop: about ``target_s`` of calls at ``est_s`` each, between ``nsets`` and
    ``max_iters``, rounded up to whole rotations of the ``nsets`` input sets."""
    n = int(target_s / max(est_s, 1e-7))
    n = max(nsets, min(max_iters, n))
    return int(math.ceil(n / nsets) * nsets)


class JaxRunner:
    """Back-to-back calls of a JAX function rotating through input sets: ``warm()`` (compile, run
    every set once; returns the first call's seconds, compilation included), ``loop(n)`` (ms per
    call of n calls, wall clock, ended by block_until_ready)."""

    def __init__(self, fn, sets):
        self.fn, self.sets, self.out = fn, list(sets), None

    def warm(self):
        import jax
        start = time.perf_counter()
        jax.block_until_ready(self.fn(*self.sets[0]))
        first = time.perf_counter() - start
        for s in self.sets[1:]:
            jax.block_until_ready(self.fn(*s))
        return first

    def loop(self, n):
        import jax
        fn, sets, ns = self.fn, self.sets, len(self.sets)
        jax.block_until_ready(self.out)
        start = time.perf_counter()
        out = None
        for i in range(n):
            out = fn(*sets[i % ns])
        jax.block_until_ready(out)
        self.out = out
        return (time.perf_counter() - start) / n * 1e3

    def close(self):
        self.out = None


class TorchRunner:
    """The same for torch / fla functions, timed by CUDA events (wall clock kept in ``wall``)."""

    def __init__(self, fn, sets):
        import torch
        self.torch, self.fn, self.sets, self.wall = torch, fn, list(sets), []
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def warm(self):
        torch = self.torch
        start = time.perf_counter()
        self.fn(*self.sets[0])
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        # fla's kernels autotune on their first call: minutes for some backward configs, so say so.
        log(f"    (torch first call {first:.1f} s)")
        for s in self.sets[1:]:
            self.fn(*s)
        torch.cuda.synchronize()
        return first

    def loop(self, n):
        fn, sets, ns = self.fn, self.sets, len(self.sets)
        self.torch.cuda.synchronize()
        wall = time.perf_counter()
        self.start.record()
        for i in range(n):
            fn(*sets[i % ns])
        self.end.record()
        self.end.synchronize()
        self.wall.append((time.perf_counter() - wall) / n * 1e3)
        return self.start.elapsed_time(self.end) / n

    def close(self):
        pass


def estimate_call_s(runner, ns: int) -> float:
    """Seconds per call from the faster of two short loops: a process's first loop can read many
    times the call's time (one-time costs, clocks ramping up), and sized from it alone the first
    function timed got loops of a few calls (N = 6 where 80 fit), which overstate its time by the
    dispatch latency."""
    return min(runner.loop(ns), runner.loop(ns)) / 1e3


def measure(runner, *, target_s, reps, max_iters, during=None):
    """(median ms per call, info) over ``reps`` loops of N calls, N set from two estimating loops
    (``estimate_call_s``) so a loop lasts about ``target_s``. ``during``: a context manager
    entered around the timed loops only (after compiling and warming up), e.g. a GpuMonitor
    phase."""
    first = runner.warm()
    ns = len(runner.sets)
    n = pick_n(estimate_call_s(runner, ns), target_s, ns, max_iters)
    with during if during is not None else contextlib.nullcontext():
        times = [runner.loop(n) for _ in range(reps)]
    info = dict(n=n, reps=reps, loop_ms=times, first_call_s=first)
    if getattr(runner, "wall", None):
        info["wall_loop_ms"] = runner.wall[-reps:]
    runner.close()
    return statistics.median(times), info


def time_jax(fn, sets, *, target_s, reps, max_iters, during=None):
    """Median over reps of (wall time of N rotated back-to-back calls, after block_until_ready) / N,
    in ms, and an info dict (n, reps, loop_ms, first_call_s)."""
    return measure(JaxRunner(fn, sets), target_s=target_s, reps=reps, max_iters=max_iters,
                   during=during)


def time_torch(fn, sets, *, target_s, reps, max_iters, during=None):
    """time_jax for torch functions, CUDA events around each loop; ms."""
    return measure(TorchRunner(fn, sets), target_s=target_s, reps=reps, max_iters=max_iters,
                   during=during)


def time_alternating(runners: dict, *, rounds: int, target_s, reps, max_iters, phase=None):
    """Several runners compared in one process: each warmed and sized once, then ``rounds`` rounds
    in which every runner, in turn, runs ``reps`` timed loops. {name: (median ms over all its
    loops, info)}; a runner that fails gives (None, dict(error=...)) and leaves the later rounds.
    ``phase(name)`` (optional) gives a context manager (or None) entered around each runner's loops."""
    import traceback
    sized, results = {}, {}

    def failed(name, e):
        results[name] = (None, dict(error=short_exc(e)))
        sized.pop(name, None)
        traceback.print_exc(limit=4)

    for name, runner in runners.items():
        try:
            first = runner.warm()
            ns = len(runner.sets)
            sized[name] = (pick_n(estimate_call_s(runner, ns), target_s, ns, max_iters), first)
        except Exception as e:  # noqa: BLE001
            failed(name, e)
    times = {name: [] for name in sized}
    for _ in range(rounds):
        for name, (n, _) in list(sized.items()):
            try:
                with (phase(name) if phase else None) or contextlib.nullcontext():
                    times[name] += [runners[name].loop(n) for _ in range(reps)]
            except Exception as e:  # noqa: BLE001
                failed(name, e)
    for name, (n, first) in sized.items():
        runners[name].close()
        results[name] = (statistics.median(times[name]),
                         dict(n=n, reps=reps, rounds=rounds, loop_ms=times[name],
                              first_call_s=first))
    return {name: results[name] for name in runners}


def time_into_row(row, fns, sets, args, phases, suffix="", floor=None):
    """Times jitted fns {name: fn} on ``sets`` (alternated over --rounds) and stores
    row[name + suffix + '_ms' / '_timing' / '_pct_floor' / '_gpu'] or '_error'."""
    label = row["shape"]
    runners = {name: JaxRunner(fn, sets) for name, fn in fns.items()}
    results = time_alternating(runners, rounds=args.rounds, **timing_kwargs(args),
                               phase=lambda name: phases.during(f"{label}/{name}{suffix}"))
    for name, (ms, info) in results.items():
        key = name + suffix
        if ms is None:
            row[f"{key}_error"] = info["error"]
            log(f"{key:>16}: FAILED {info['error']}")
            continue
        row[f"{key}_ms"], row[f"{key}_timing"] = ms, info
        pct = ""
        if floor is not None and floor == floor:
            row[f"{key}_pct_floor"] = 100.0 * floor / ms
            pct = f", {row[f'{key}_pct_floor']:.1f} % of floor"
        log(f"{key:>16}: {ms:.4g} ms{pct} (N={info['n']}, first call {info['first_call_s']:.1f} s)")
        phases.record(row, f"{key}_gpu", f"{label}/{key}")


def rested(runner, *, burst_ms: float, bursts: int, rest_s: float, est_ms: float, during=None):
    """(median ms per call, calls per loop) of ``bursts`` loops of about ``burst_ms`` each, every
    one after ``rest_s`` idle seconds, so the card starts each at full clock. The runner must be
    warm; ``est_ms`` is a sustained estimate of one call."""
    ns = len(runner.sets)
    n = max(ns, int(burst_ms / max(est_ms, 1e-6)) // ns * ns)
    per_call = []
    with during if during is not None else contextlib.nullcontext():
        for _ in range(bursts):
            time.sleep(rest_s)
            per_call.append(runner.loop(n))
    return statistics.median(per_call), n


def _calibration_timing(args, on_cpu) -> dict:
    """time_jax's settings for the calibration loops (copy bandwidth, matrix rate): the script's,
    and on a GPU long enough loops whatever the script's settings."""
    timing = dict(target_s=args.target_ms / 1e3, reps=args.reps, max_iters=args.max_iters)
    if not on_cpu:
        timing = dict(target_s=max(timing["target_s"], 0.1), reps=max(args.reps, 3),
                      max_iters=max(args.max_iters, 200))
    return timing


def copy_bandwidth(args, on_cpu, torch_mod=None):
    """Bytes read + written per second: a large jnp elementwise pass, and torch's copy_ when given;
    GBps is the larger (args: copy_mb, target_ms, reps, max_iters)."""
    import jax
    import jax.numpy as jnp
    res = {}
    mb = min(args.copy_mb, 128.0) if on_cpu else args.copy_mb
    n = int(mb * 2**20) // 4
    timing = _calibration_timing(args, on_cpu)
    try:
        x = jnp.arange(n, dtype=jnp.float32)
        f = jax.jit(lambda a: a * 1.0009765625 + 1.0)  # elementwise: read n*4 bytes, write n*4 bytes
        # On a GPU twice, the faster kept: an idle card takes a while to reach its memory clock.
        ms = min(time_jax(f, [(x,)], **timing)[0] for _ in range(1 if on_cpu else 2))
        res.update(jax_GBps=2 * n * 4 / (ms / 1e3) / 1e9, jax_ms=ms, bytes=2 * n * 4)
        del x
    except Exception as e:  # noqa: BLE001
        log("copy bandwidth (jax) failed:", short_exc(e))
    gc.collect()
    if torch_mod is not None and torch_mod.cuda.is_available():
        torch = torch_mod
        try:
            a = torch.empty(n, dtype=torch.float32, device="cuda").fill_(1.0)
            b = torch.empty_like(a)
            ms, _ = time_torch(lambda: b.copy_(a), [()], **timing)
            res.update(torch_GBps=2 * n * 4 / (ms / 1e3) / 1e9, torch_ms=ms)
            del a, b
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            log("copy bandwidth (torch) failed:", short_exc(e))
    bws = [res[k] for k in ("jax_GBps", "torch_GBps") if k in res]
    res["GBps"] = max(bws) if bws else float("nan")
    return res


def matmul_rate(args, on_cpu, dtype="bf16"):
    """Dense matrix-multiply rate: one N x N by N x N product in ``dtype`` (N = 8192 on a GPU: the
    tensor cores' rate, 2 N^3 FLOPs per call; 256 on a CPU), float32 accumulation.
    (args: target_ms, reps, max_iters)."""
    import jax
    import jax.numpy as jnp
    n = 256 if on_cpu else 8192
    timing = _calibration_timing(args, on_cpu)
    try:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp_dtype(dtype))
        b = jax.random.normal(jax.random.key(1), (n, n), jnp_dtype(dtype))
        f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
        ms = min(time_jax(f, [(a, b)], **timing)[0] for _ in range(1 if on_cpu else 2))
        return dict(TFLOPs=2 * n**3 / (ms / 1e3) / 1e12, ms=ms, n=n, dtype=parse_dtype(dtype))
    except Exception as e:  # noqa: BLE001
        log("matmul rate failed:", short_exc(e))
        return dict(TFLOPs=float("nan"), n=n, dtype=parse_dtype(dtype))


# ------------------------------------------------------------------------------------- GPU monitor
class GpuMonitor:
    """Samples the GPU's SM clock, power draw and power-cap state while timing loops run.

    On an H200 the K = V = 256 chunk_o timing loops run into the card's 700 W limit: the driver's
    software power cap engages and the SM clock falls from 1980 MHz to 840-1600 MHz (RESULTS.md,
    "K = V = 256 and the power cap"), and the same kernel times 2-4 % apart on different cards.
    So every timed phase records what the clock did.

    ``with monitor.phase(name): ...`` brackets a phase (a name may bracket several intervals);
    pass one as a timing function's ``during`` so it covers the timed loops only.
    ``monitor.summary(name)`` is then None (no samples: no nvidia-smi, a CPU, or a phase shorter
    than the sampling period) or a dict: median and min SM MHz, max power W, and the fraction of
    samples with the power cap active; ``describe`` formats one in a line.
    ``command`` replaces the nvidia-smi query (tests); it must print lines of "MHz, W, Active".
    """

    QUERY = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.sw_power_cap",
             "--format=csv,noheader,nounits", "-lms", "100", "-i", "0"]

    def __init__(self, command=None):
        import atexit
        import threading

        self.samples = []                        # (perf_counter, sm_mhz, power_w, capped)
        self.phases = {}                         # name -> [(start, end), ...]
        self._process = None
        command = command or self.QUERY
        if shutil.which(command[0]) is None:
            return
        try:
            self._process = subprocess.Popen(command, stdout=subprocess.PIPE,
                                             stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        atexit.register(self.close)           # never leave nvidia-smi running after a crash

    def _read(self):
        for line in self._process.stdout:
            fields = [f.strip() for f in line.split(",")]
            try:
                self.samples.append((time.perf_counter(), float(fields[0]), float(fields[1]),
                                     fields[2].lower() == "active"))
            except (IndexError, ValueError):    # a header, "[N/A]" or an unsupported field
                continue

    def phase(self, name):
        @contextlib.contextmanager
        def bracket():
            start = time.perf_counter()
            try:
                yield
            finally:
                self.phases.setdefault(name, []).append((start, time.perf_counter()))
        return bracket()

    def summary(self, name):
        inside = [s for s in self.samples
                  if any(start <= s[0] <= end for start, end in self.phases.get(name, ()))]
        if not inside:
            return None
        clocks = [s[1] for s in inside]
        return dict(samples=len(inside), sm_mhz_median=statistics.median(clocks),
                    sm_mhz_min=min(clocks), power_w_max=max(s[2] for s in inside),
                    power_capped=sum(s[3] for s in inside) / len(inside))

    @staticmethod
    def describe(s):
        """One short line for a summary (``summary(name)``), or '' for None."""
        if s is None:
            return ""
        return (f"SM {s['sm_mhz_median']:.0f} MHz (min {s['sm_mhz_min']:.0f}), "
                f"power cap {s['power_capped']:.0%} of samples, max {s['power_w_max']:.0f} W")

    def close(self):
        if self._process is not None:
            self._process.terminate()
            self._process.wait()
            self._reader.join(timeout=1.0)
            self._process = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Phases:
    """A GpuMonitor or nothing (a CPU): ``during(name)`` for the timing functions' ``during``,
    ``record(row, key, name)`` stores and logs the phase's summary under row[key]."""

    def __init__(self, on_cpu: bool):
        self.monitor = None if on_cpu else GpuMonitor()

    def during(self, name):
        return self.monitor.phase(name) if self.monitor else None

    def summary(self, name):
        return self.monitor.summary(name) if self.monitor else None

    def record(self, row, key, name):
        summary = self.summary(name)
        if summary:
            row[key] = summary
            log(f"{'':>11}{GpuMonitor.describe(summary)}")
        return summary

    def close(self):
        if self.monitor:
            self.monitor.close()


# -------------------------------------------------------------------------------------------- fla
FLA_DEVICE = "cuda"


def load_fla():
    """fla and torch, or raises: a namespace with torch, fwd_o (chunk_gated_delta_product_fwd_o),
    op (the full chunk_gated_delta_product), prepare_chunk_indices and versions."""
    import types

    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    import triton

    import fla  # noqa: F401
    from fla.ops.gated_delta_product import chunk_gated_delta_product
    from fla.ops.gated_delta_product.chunk_deltaproduct_o import chunk_gated_delta_product_fwd_o
    from fla.ops.utils import prepare_chunk_indices
    versions = dict(torch=torch.__version__, triton=triton.__version__,
                    fla=getattr(fla, "__version__", "?"))
    return types.SimpleNamespace(torch=torch, fwd_o=chunk_gated_delta_product_fwd_o,
                                 op=chunk_gated_delta_product,
                                 prepare_chunk_indices=prepare_chunk_indices, versions=versions)


def try_load_fla(wanted: bool, on_cpu: bool, meta: dict):
    """load_fla() where wanted and on a GPU, else None; failures are logged, not raised."""
    if not wanted:
        return None
    if on_cpu:
        log("fla skipped: no GPU")
        return None
    try:
        fla = load_fla()
    except Exception as e:  # noqa: BLE001
        log("fla unavailable, skipping it:", short_exc(e))
        return None
    meta.update(fla.versions)
    log(f"fla {fla.versions['fla']} (torch {fla.versions['torch']}, triton "
        f"{fla.versions['triton']}) loaded")
    return fla


def to_torch(torch, x):
    """jax array -> torch CUDA tensor, zero-copy through dlpack when possible."""
    import jax
    import numpy as np
    jax.block_until_ready(x)
    try:
        return torch.from_dlpack(x)
    except Exception:  # noqa: BLE001 - fall back to a host round trip
        a = np.asarray(x)
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16).to(FLA_DEVICE)
        return torch.from_numpy(a.copy()).to(FLA_DEVICE)


def restart_cumsum(x, start):
    """Inclusive cumsum along axis 1 of x [B, T, H] restarting where start [B, T] (bool) is True."""
    import jax
    import jax.numpy as jnp
    idx = jnp.arange(x.shape[1], dtype=jnp.int32)[None, :]
    last = jax.lax.cummax(jnp.where(start, idx, 0), axis=1)
    cs = jnp.cumsum(x, axis=1)
    return cs - jnp.take_along_axis(cs - x, last[..., None], axis=1)


def fla_chunk_o_args(fla, p: Problem, seed: int = 0):
    """fla's chunk_gated_delta_product_fwd_o operands (q, k, v, h, g, cu_seqlens, chunk_indices).
    Unpacked: the very same buffers (dlpack). Packed: B = 1, the rows concatenated, cu_seqlens
    from the packing. fla restarts its chunk grid at every sequence start (ours stays on the fixed
    grid and masks by segment), so it gets its own h [1, sum ceil(L / BT), H, K, V] and a g that
    also restarts at sequence starts: the packed case is timed only, not comparable to ours."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    torch = fla.torch
    t = lambda x: None if x is None else to_torch(torch, x)
    if p.segment_ids is None:
        return (t(p.q), t(p.k), t(p.v), t(p.h), t(p.g), None, None)
    B, T, H, K, V, M = (p.shape[c] for c in "BTHKVM")
    bt = p.chunk_size
    cu = p.cu_seqlens()
    lengths = np.diff(cu)
    cu_t = torch.tensor(cu, dtype=torch.long, device=FLA_DEVICE)
    nt_total = int(sum(-(-int(n) // bt) for n in lengths))
    h = (0.1 * jax.random.normal(jax.random.PRNGKey(10_000 + seed), (1, nt_total, H, K, V),
                                 jnp.float32)).astype(p.q.dtype)
    g = None
    if p.g_raw is not None:   # chunk starts of fla's per-sequence grid, on the flattened stream
        pos = np.arange(B * T) - np.repeat(cu[:-1], lengths)
        g = restart_cumsum(p.g_raw.reshape(1, B * T, H) * LOG2E, jnp.asarray((pos % bt == 0)[None]))
        g = t(g).view(1, B * T, H)
    return (t(p.q).view(1, B * T, H, K), t(p.k).view(1, B * T * M, H, K),
            t(p.v).view(1, B * T * M, H, V), t(h), g, cu_t, fla.prepare_chunk_indices(cu_t, bt))


def fla_full_op_args(fla, p: Problem):
    """fla's chunk_gated_delta_product operands (q, k, v, g, beta, do, cu_seqlens) for a "full"
    Problem: torch views of the same buffers; packed rows flattened to B = 1 with cu_seqlens (fla's
    varlen form)."""
    torch = fla.torch
    t = lambda x: None if x is None else to_torch(torch, x)
    tq, tk, tv, tg, tb, tdo = map(t, (p.q, p.k, p.v, p.g, p.beta, p.do))
    cu = None
    if p.segment_ids is not None:
        cu = torch.tensor(p.cu_seqlens(), dtype=torch.long, device=FLA_DEVICE)
        flat = lambda x: None if x is None else x.reshape(1, -1, *x.shape[2:]).contiguous()
        tq, tk, tv, tg, tb, tdo = map(flat, (tq, tk, tv, tg, tb, tdo))
    return tq, tk, tv, tg, tb, tdo, cu


def full_op_fwdbwd(op, gated: bool):
    """Forward + backward of the full op as fla's ``o.backward(do)`` runs it: jit of (q, k, v, g,
    beta, s, do) -> (o, cotangents of q, k, v, [g,] beta) for o's cotangent do, through jax.vjp
    of ``op(q, k, v, g, beta, s) -> o`` (g None when not ``gated``). No loss: a sum(o * do) would
    add a reduction over o that fla does not run."""
    import jax

    def run(q, k, v, g, beta, s, do):
        o, vjp = jax.vjp(lambda q, k, v, g, beta: op(q, k, v, g if gated else None, beta, s),
                         q, k, v, g, beta)
        grads = vjp(do.astype(o.dtype))
        return o, grads if gated else grads[:3] + grads[4:]
    return jax.jit(run)


# --------------------------------------------------------------------------------------- baseline
_BASELINES = {}


def load_baseline(directory: str):
    """Another version of the library, importable beside this one: ``directory`` holds its
    ``gdp_jax/`` package directory (or is that directory). It is copied to a temporary directory
    as ``gdp_jax_baseline`` (every ``gdp_jax`` in its .py files renamed), imported and returned,
    so old and new code are timed in one process through the public API (``chunk_gdp_fwd_o``,
    ``chunk_gated_delta_product``). E.g. ``git archive 5f3414e gdp_jax | tar -x -C /tmp/old``,
    then ``--baseline /tmp/old``."""
    source = os.path.abspath(directory)
    if os.path.basename(source.rstrip(os.sep)) != "gdp_jax" or not os.path.isfile(
            os.path.join(source, "__init__.py")):
        source = os.path.join(source, "gdp_jax")
    if not os.path.isfile(os.path.join(source, "__init__.py")):
        raise SystemExit(f"--baseline {directory}: no gdp_jax/__init__.py there")
    if source in _BASELINES:
        return _BASELINES[source]
    if "gdp_jax_baseline" in sys.modules:
        raise RuntimeError("a different baseline is already imported in this process")
    root = tempfile.mkdtemp(prefix="gdp_jax_baseline_")
    target = os.path.join(root, "gdp_jax_baseline")
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for folder, _, files in os.walk(target):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(text.replace("gdp_jax", "gdp_jax_baseline"))
    sys.path.insert(0, root)
    try:
        module = importlib.import_module("gdp_jax_baseline")
    finally:
        sys.path.remove(root)
    module.baseline_source = source
    _BASELINES[source] = module
    log(f"baseline: {source} imported as gdp_jax_baseline")
    return module


# ------------------------------------------------------------------------------------------ output
def add_ratios(row: dict, kinds, name: str, top: str, bottom: str) -> None:
    """row[f"{name}_{kind}"] = row[f"{top}_{kind}_ms"] / row[f"{bottom}_{kind}_ms"] for each kind
    where both times are there (e.g. name "new_over_old", top "ours", bottom "baseline")."""
    for kind in kinds:
        if f"{top}_{kind}_ms" in row and f"{bottom}_{kind}_ms" in row:
            row[f"{name}_{kind}"] = row[f"{top}_{kind}_ms"] / row[f"{bottom}_{kind}_ms"]


def run_shapes(shapes, new_row, build, run_shape, *, title: str = "", after=None) -> list:
    """One row per shape: row = new_row(shape); run_shape(row, build(shape, index), shape). An
    exception goes into row["error"] (logged, with its traceback) and the next shape runs; the
    shape's wall time goes into row["wall_s"]; ``after()`` runs after each shape (cache frees)."""
    rows = []
    for si, shp in enumerate(shapes):
        row = new_row(shp)
        log(f"\n=== [{si + 1}/{len(shapes)}] {row['shape']} {title} ===")
        start = time.perf_counter()
        problems = None
        try:
            problems = build(shp, si)
            run_shape(row, problems, shp)
        except Exception as e:  # noqa: BLE001
            row["error"] = short_exc(e)
            log(f"FAILED: {short_exc(e)}")
            import traceback
            traceback.print_exc(limit=6)
        row["wall_s"] = time.perf_counter() - start
        rows.append(row)
        del problems
        gc.collect()
        if after is not None:
            after()
    return rows


def log(*a):
    print(*a, flush=True)


def short_exc(e: BaseException, limit: int = 400) -> str:
    msg = f"{type(e).__name__}: {e}"
    return msg if len(msg) <= limit else msg[:limit] + " ..."


def fmt(x, spec=".3f"):
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return format(x, spec)


def ms_cell(row, name, spec=".3f"):
    """row[name_ms] formatted, 'ERR' when row has name_error, '-' when neither."""
    if row.get(f"{name}_ms") is not None:
        return fmt(row[f"{name}_ms"], spec)
    return "ERR" if f"{name}_error" in row else "-"


def print_table(header, lines, caption):
    """Prints ``caption`` then an aligned text table: ``header`` (column names) over ``lines``
    (rows of strings), columns separated by " | "."""
    widths = [max([len(h)] + [len(l[i]) for l in lines]) for i, h in enumerate(header)]
    print()
    print(caption)
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    print("-+-".join("-" * w for w in widths))
    for l in lines:
        print(" | ".join(c.ljust(w) for c, w in zip(l, widths)).rstrip())
    sys.stdout.flush()


def card_info() -> dict:
    """The GPU as nvidia-smi names it (name, serial, driver, power limit, max SM clock), or {}."""
    if shutil.which("nvidia-smi") is None:
        return {}
    fields = ["name", "serial", "driver_version", "power.limit", "clocks.max.sm"]
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                              "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    values = [v.strip() for v in out.splitlines()[0].split(",")] if out else []
    return dict(zip(fields, values)) if len(values) == len(fields) else {}


def run_meta(args=None, **extra) -> dict:
    """date, versions, device and card, host, the script's arguments."""
    import jax
    dev = jax.devices()[0]
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        jax=jax.__version__, jaxlib=getattr(importlib.import_module("jaxlib"), "__version__", "?"),
        device=str(getattr(dev, "device_kind", dev)), platform=dev.platform,
        n_devices=len(jax.devices()), python=platform.python_version(), host=platform.node(),
        script=os.path.basename(sys.argv[0]), card=card_info())
    if args is not None:
        meta["args"] = vars(args)
    meta.update(extra)
    return meta


def write_json(path, result):
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1, default=str)
    log(f"\nwrote {path}")


def on_cpu() -> bool:
    import jax
    return jax.devices()[0].platform == "cpu"
