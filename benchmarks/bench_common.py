"""Helpers shared by the benchmark scripts: shape parsing, timing loops, copy bandwidth.

Timing: jitted JAX functions by wall clock over N back-to-back calls rotating through several input
sets (so the L2 never holds a working set), after block_until_ready, divided by N, median of `reps`
loops; torch/fla functions the same way with CUDA events. Copy bandwidth counts bytes read + written.
"""
from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time

LOG2E = 1.0 / math.log(2.0)


def parse_shapes(spec: str, shape_sets: dict):
    """A named set from ``shape_sets`` or 'B=..,T=..,H=..,K=..[,V=..],M=..[,segs=..];...'."""
    if spec in shape_sets:
        items = [dict(s) for s in shape_sets[spec]]
    else:
        items = []
        for item in filter(None, (s.strip() for s in spec.split(";"))):
            d = {}
            for kv in item.split(","):
                key, val = kv.split("=")
                d[key.strip()] = int(val)
            missing = {"B", "T", "H", "K", "M"} - set(d)
            if missing:
                raise SystemExit(f"shape {item!r} lacks {sorted(missing)}")
            items.append(d)
    for d in items:  # V defaults to K, segs (segments per row) to 0: unpacked
        d.setdefault("V", d["K"])
        d.setdefault("segs", 0)
    return items


def relative_error_fn():
    """A jitted ||a - b|| / ||b|| over all elements, in float32."""
    import jax
    import jax.numpy as jnp
    f32 = lambda x: x.astype(jnp.float32).ravel()
    return jax.jit(lambda a, b: jnp.linalg.norm(f32(a) - f32(b)) / jnp.linalg.norm(f32(b)))


def shape_label(s):
    lab = f"B{s['B']} T{s['T']} H{s['H']} K{s['K']}"
    if s.get("V", s["K"]) != s["K"]:
        lab += f" V{s['V']}"
    lab += f" M{s['M']}"
    if s.get("segs"):
        lab += f" seg{s['segs']}"
    return lab


def short_exc(e: BaseException, limit: int = 400) -> str:
    msg = f"{type(e).__name__}: {e}"
    return msg if len(msg) <= limit else msg[:limit] + " ..."


def log(*a):
    print(*a, flush=True)


class GpuMonitor:
    """Samples the GPU's SM clock, power draw and power-cap state while timing loops run.

    On an H200 the K = V = 256 chunk_o timing loops run into the card's 700 W limit: the driver's
    software power cap engages and the SM clock falls from 1980 MHz to 840-1600 MHz (eleventh
    session, benchmarks/RESULTS.md). The same kernel also times 2-4 % apart on different
    machines; if the cap pulls some cards further than others, that would explain it. So every
    timed phase records what the clock did.

    ``with monitor.phase(name): ...`` brackets a phase; pass one as time_jax's or time_torch's
    ``during`` so it covers the timed loops only, not compiling and warming up.
    ``monitor.summary(name)`` is then None (no samples: no nvidia-smi, a CPU, or a phase shorter
    than the sampling period) or a dict: median and min SM MHz, max power W, and the fraction of
    samples with the power cap active; ``describe`` formats one in a line.
    ``command`` replaces the nvidia-smi query (tests); it must print lines of "MHz, W, Active".
    """

    QUERY = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.sw_power_cap",
             "--format=csv,noheader,nounits", "-lms", "100", "-i", "0"]

    def __init__(self, command=None):
        import atexit
        import shutil
        import subprocess
        import threading

        self.samples = []                        # (perf_counter, sm_mhz, power_w, capped)
        self.phases = {}                         # name -> (start, end)
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
                self.phases[name] = (start, time.perf_counter())
        return bracket()

    def summary(self, name):
        start, end = self.phases[name]
        inside = [s for s in self.samples if start <= s[0] <= end]
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


def _pick_n(est_s, target_s, nsets, max_iters):
    n = int(target_s / max(est_s, 1e-7))
    n = max(nsets, min(max_iters, n))
    return int(math.ceil(n / nsets) * nsets)


# --dtype: the short names the scripts print and store, each with its jnp name, and the other
# spellings they accept.
DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}
DTYPE_ALIASES = {**{name: short for short, name in DTYPES.items()}, "fp16": "f16", "half": "f16",
                 "fp32": "f32"}


def add_dtype_arg(parser, default="bf16"):
    """--dtype bf16 | f16 | f32 (also fp16, float16, bfloat16, ...); args.dtype is the short name,
    and jnp_dtype(args.dtype) the array dtype."""
    parser.add_argument("--dtype", default=default, type=lambda name: DTYPE_ALIASES.get(name, name),
                        choices=list(DTYPES),
                        help="input dtype: bf16, f16 (fp16, float16) or f32 (fp32, float32)")


def jnp_dtype(short_name):
    import jax.numpy as jnp
    return getattr(jnp, DTYPES[short_name])


def add_timing_args(parser, *, sets=3, reps=5, target_ms=150.0, max_iters=300, copy_mb=2048.0):
    """The timing options every benchmark script takes (time_jax, time_torch, copy_bandwidth);
    a script passes its own defaults, and copy_mb=None leaves --copy-mb out."""
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


def time_jax(fn, sets, *, target_s, reps, max_iters, during=None):
    """Median over reps of (wall time of N rotated back-to-back calls, after block_until_ready) / N, in ms.

    ``during``: a context manager entered around the timed loops only (after compiling and warming
    up), e.g. a GpuMonitor phase."""
    import jax
    ns = len(sets)
    for s in sets:  # compile + warm every set
        jax.block_until_ready(fn(*s))
    t0 = time.perf_counter()
    out = None
    for i in range(ns):
        out = fn(*sets[i % ns])
    jax.block_until_ready(out)
    est = (time.perf_counter() - t0) / ns
    n = _pick_n(est, target_s, ns, max_iters)
    times = []
    with during if during is not None else contextlib.nullcontext():
        for _ in range(reps):
            jax.block_until_ready(out)
            t0 = time.perf_counter()
            for i in range(n):
                out = fn(*sets[i % ns])
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t0) / n * 1e3)
    del out
    return statistics.median(times), dict(n=n, reps=reps, loop_ms=times)


def time_torch(fn, sets, *, target_s, reps, max_iters, during=None):
    """Same as time_jax but with torch.cuda.Event around the loop; returns ms."""
    import torch
    ns = len(sets)
    t_first = time.perf_counter()
    fn(*sets[0])
    torch.cuda.synchronize()
    # fla's kernels autotune on their first call: minutes for some backward configs, so say so.
    log(f"    (torch first call {time.perf_counter() - t_first:.1f} s)")
    for s in sets[1:]:
        fn(*s)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(ns):
        fn(*sets[i % ns])
    end.record()
    end.synchronize()
    est = start.elapsed_time(end) / 1e3 / ns
    n = _pick_n(est, target_s, ns, max_iters)
    times, wall = [], []
    with during if during is not None else contextlib.nullcontext():
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            start.record()
            for i in range(n):
                fn(*sets[i % ns])
            end.record()
            end.synchronize()
            wall.append((time.perf_counter() - t0) / n * 1e3)
            times.append(start.elapsed_time(end) / n)
    return statistics.median(times), dict(n=n, reps=reps, loop_ms=times, wall_loop_ms=wall)


def copy_bandwidth(args, on_cpu, torch_mod=None):
    """Bytes read + written per second: a large jnp elementwise pass, and torch's copy_ when given;
    GBps is the larger (args: copy_mb, target_ms, reps, max_iters)."""
    import jax
    import jax.numpy as jnp
    res = {}
    mb = min(args.copy_mb, 128.0) if on_cpu else args.copy_mb
    n = int(mb * 2**20) // 4
    try:
        x = jnp.arange(n, dtype=jnp.float32)
        f = jax.jit(lambda a: a * 1.0009765625 + 1.0)  # elementwise: read n*4 bytes, write n*4 bytes
        ms, info = time_jax(f, [(x,)], target_s=args.target_ms / 1e3, reps=args.reps,
                            max_iters=args.max_iters)
        res["jax_GBps"] = 2 * n * 4 / (ms / 1e3) / 1e9
        res["jax_ms"] = ms
        res["bytes"] = 2 * n * 4
        del x
    except Exception as e:  # noqa: BLE001
        log("copy bandwidth (jax) failed:", short_exc(e))
    gc.collect()
    if torch_mod is not None and torch_mod.cuda.is_available():
        torch = torch_mod
        try:
            a = torch.empty(n, dtype=torch.float32, device="cuda").fill_(1.0)
            b = torch.empty_like(a)
            ms, _ = time_torch(lambda: b.copy_(a), [()], target_s=args.target_ms / 1e3, reps=args.reps,
                               max_iters=args.max_iters)
            res["torch_GBps"] = 2 * n * 4 / (ms / 1e3) / 1e9
            res["torch_ms"] = ms
            del a, b
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            log("copy bandwidth (torch) failed:", short_exc(e))
    bws = [res[k] for k in ("jax_GBps", "torch_GBps") if k in res]
    res["GBps"] = max(bws) if bws else float("nan")
    return res


def nbytes(*arrs):
    return int(sum(a.size * a.dtype.itemsize for a in arrs if a is not None))


def print_table(header, lines, caption):
    """Prints ``caption`` then an aligned text table: ``header`` (column names) over ``lines`` (rows of
    strings), columns separated by " | "."""
    import sys
    widths = [max([len(h)] + [len(l[i]) for l in lines]) for i, h in enumerate(header)]
    print()
    print(caption)
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    print("-+-".join("-" * w for w in widths))
    for l in lines:
        print(" | ".join(c.ljust(w) for c, w in zip(l, widths)).rstrip())
    sys.stdout.flush()


def fmt(x, spec=".3f"):
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return format(x, spec)
