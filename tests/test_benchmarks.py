"""The benchmark scripts' logic on a CPU, on tiny shapes: each runs end to end (our kernels in
Pallas' interpreter, the jnp path, fla and the GPU parts skipped), writes its JSON and table, and
the checks inside it (ours against the jnp path, a config against the default's, new against a
baseline copy of the package) agree. Their timings mean nothing here; the GPU numbers are in
benchmarks/RESULTS.md."""
import dataclasses
import gzip
import importlib.util
import json
import pathlib
import re
import shutil
import sys

import pytest

from gdp_jax._src.mosaic import has_interpreter

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

QUICK = ["--target-ms", "2", "--reps", "2"]
COPY = ["--copy-mb", "4"]
SCRIPTS = {"common.py", "bench_chunk_o.py", "bench_full_op.py", "bench_sharding.py", "tune.py",
           "profile_gpu.py", "codegen.py", "bench_generate.py", "profile_lm_prefill.py"}


def script(name):
    """benchmarks/NAME.py as a module, loaded once."""
    key = f"benchmark_script_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def header_of(printed):
    return next(line for line in printed.splitlines() if line.startswith("shape"))


@pytest.fixture(scope="module", autouse=True)
def fast_compiles():
    """Most of this file's time is XLA compiling tiny programs; their speed does not matter here."""
    import jax
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(scope="module")
def baseline_dir(tmp_path_factory):
    """A copy of the current gdp_jax package, as --baseline takes another version's."""
    root = tmp_path_factory.mktemp("baseline")
    shutil.copytree(ROOT / "gdp_jax", root / "gdp_jax", ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.mark.parametrize("name,flag", [("bench_generate.py", "--budget-s"),
                                       ("profile_lm_prefill.py", "--layers")])
def test_gpu_scripts_parse_their_command_line(name, flag):
    """bench_generate.py needs torch, fla and a GPU to run; profile_lm_prefill.py a GPU (on a CPU
    ~50 s of model init and tracing, for no kernel rows). Both import and parse --help here."""
    import subprocess
    done = subprocess.run([sys.executable, str(BENCHMARKS / name), "--help"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and flag in done.stdout, done.stderr[-2000:]


def test_the_scripts_and_their_imports():
    """Eight scripts and one input builder, and no private gdp_jax names (only the public API and
    the documented stage API: gdp_jax.ops...)."""
    assert {p.name for p in BENCHMARKS.glob("*.py")} == SCRIPTS
    private = re.compile(r"gdp_jax(\.\w+)*\._\w|from gdp_jax[\w.]* import [^\n]*\b_\w|_states_pallas|"
                         r"_sub_grid_operands")
    for path in BENCHMARKS.glob("*.py"):
        text = path.read_text()
        assert not private.search(text), (path.name, private.search(text).group(0))
        if path.name != "common.py":
            assert "def make_set" not in text and "def make_inputs(key" not in text, path.name


# ------------------------------------------------------------------------------------ common.py
def test_dtype_names():
    from common import parse_dtype
    for names, short in ((("bf16", "bfloat16", "BF16"), "bf16"),
                         (("f16", "fp16", "float16", "half"), "f16"),
                         (("f32", "fp32", "float32", "float"), "f32")):
        assert {parse_dtype(n) for n in names} == {short}
    with pytest.raises(ValueError):
        parse_dtype("int8")


def test_problems_share_one_packing_and_match_fla_cu_seqlens():
    import numpy as np

    from common import make_problems
    shape = dict(B=2, T=40, H=2, K=16, V=16, M=2, segs=3)
    a, b = make_problems(shape, op="full", dtype="f16", sets=2, chunk_size=16)
    assert a.segment_ids is b.segment_ids and a.q.dtype.name == "float16"
    assert a.k.shape == (2, 80, 2, 16) and a.beta.shape == (2, 80, 2) and a.h is None
    cu = a.cu_seqlens()
    assert cu[0] == 0 and cu[-1] == 80 and len(cu) == 2 * 3 + 1
    ids = np.asarray(a.segment_ids).reshape(-1)
    starts = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]]) | (np.arange(80) % 40 == 0))
    assert list(cu[:-1]) == list(starts)
    (c,) = make_problems(shape, op="chunk_o", dtype="bf16", sets=1, chunk_size=16, gated=False)
    assert c.h.shape == (2, 3, 2, 16, 16) and c.g is None and c.beta is None


def test_load_baseline_renames_the_package(baseline_dir):
    from common import load_baseline
    old = load_baseline(str(baseline_dir))
    assert old.__name__ == "gdp_jax_baseline" and load_baseline(str(baseline_dir / "gdp_jax")) is old
    assert "gdp_jax_baseline" in old.chunk_gdp_fwd_o.__module__
    text = (pathlib.Path(old.__file__).parent / "ops" / "gated_delta_product.py").read_text()
    assert "gdp_jax_baseline.ops" in text and not re.search(r"gdp_jax(?!_baseline)", text)


def test_gpu_monitor_attributes_samples_to_phases():
    """GpuMonitor's parsing and phase bookkeeping, fed by a stand-in for nvidia-smi that prints
    two uncapped samples, a line it must skip, then two capped ones."""
    import time

    from common import GpuMonitor

    script_text = ("import sys, time\n"
                   "for line in ['1980, 300.5, Not Active', '1965, 310.0, Not Active', '[N/A], 1, x',"
                   " '1500, 699.0, Active', '900, 712.3, Active']:\n"
                   "    print(line, flush=True); time.sleep(0.05)\n"
                   "time.sleep(60)\n")
    with GpuMonitor(command=[sys.executable, "-c", script_text]) as monitor:
        with monitor.phase("timed"):
            deadline = time.perf_counter() + 30
            while len(monitor.samples) < 4 and time.perf_counter() < deadline:
                time.sleep(0.02)
    assert [s[1:] for s in monitor.samples] == [(1980.0, 300.5, False), (1965.0, 310.0, False),
                                                (1500.0, 699.0, True), (900.0, 712.3, True)]
    ((start, end),) = monitor.phases["timed"]
    assert start <= monitor.samples[0][0] and monitor.samples[-1][0] <= end
    # Phases split between the second and third sample, one before any sample, and one name
    # bracketing two intervals (a config timed in two rounds).
    times = [s[0] for s in monitor.samples]
    middle = (times[1] + times[2]) / 2
    monitor.phases.update(cool=[(start, middle)], hot=[(middle, end)], before=[(start - 2, start - 1)],
                          ends=[(start, times[0]), (times[3], end)])
    assert monitor.summary("before") is None and monitor.summary("never") is None
    assert GpuMonitor.describe(None) == ""
    cool, hot = monitor.summary("cool"), monitor.summary("hot")
    assert cool == dict(samples=2, sm_mhz_median=1972.5, sm_mhz_min=1965.0, power_w_max=310.0,
                        power_capped=0.0)
    assert hot["power_capped"] == 1.0 and hot["sm_mhz_min"] == 900.0 and hot["power_w_max"] == 712.3
    assert monitor.summary("ends")["samples"] == 2 and monitor.summary("ends")["power_capped"] == 0.5
    assert GpuMonitor.describe(hot) == ("SM 1200 MHz (min 900), power cap 100% of samples, "
                                       "max 712 W")


def test_gpu_monitor_without_nvidia_smi():
    from common import GpuMonitor

    with GpuMonitor(command=["surely-not-a-command-here"]) as monitor:
        with monitor.phase("p"):
            pass
    assert monitor.summary("p") is None and monitor.samples == []


def test_time_jax_enters_during_around_the_timed_loops_only():
    """A GpuMonitor phase passed as ``during`` must not cover compiling and warming up."""
    import contextlib

    import jax.numpy as jnp
    from common import time_jax

    calls = []

    def fn(x):
        calls.append(1)
        return x + 1

    seen = {}

    @contextlib.contextmanager
    def during():
        seen["enter"] = len(calls)
        yield
        seen["exit"] = len(calls)

    sets = [(jnp.ones(4),), (jnp.zeros(4),)]
    _, info = time_jax(fn, sets, target_s=1e-3, reps=3, max_iters=10, during=during())
    assert seen["enter"] == 3 * len(sets)                 # warm every set, then two estimating loops
    assert seen["exit"] - seen["enter"] == info["reps"] * info["n"]
    assert info["first_call_s"] >= 0


# ----------------------------------------------------------------------------- bench_chunk_o.py
def test_bench_chunk_o_forward(tmp_path, capsys):
    out = tmp_path / "bench.json"
    script("bench_chunk_o").main(["--shapes", "B=1,T=40,H=1,K=32,V=32,M=2;B=2,T=24,H=1,K=32,V=16,M=1,segs=3",
                                  "--chunk", "16", "--impls", "xla,interpret", "--sets", "2", "--out", str(out),
                                  *QUICK, *COPY])
    result = json.loads(out.read_text())
    assert result["meta"]["date"] and result["meta"]["jax"] and "card" in result["meta"]
    rows = result["rows"]
    assert [row["shape"] for row in rows] == ["B1 T40 H1 K32 M2", "B2 T24 H1 K32 V16 M1 seg3"]
    for row in rows:
        assert "error" not in row and row["xla_ms"] > 0 and row["interpret_ms"] > 0
        assert row["floor_ms"] > 0 and row["bytes"] > 0
        assert row["interpret_relerr_vs_xla"] < 2e-2            # bf16 inputs, f32 accumulation
        assert row["xla_pct_floor"] == pytest.approx(100 * row["floor_ms"] / row["xla_ms"], rel=1e-3)
        assert row["interpret_pct_floor"] == pytest.approx(100 * row["floor_ms"] / row["interpret_ms"],
                                                           rel=1e-3)
    printed = capsys.readouterr().out
    assert "B2 T24 H1 K32 V16 M1 seg3" in printed
    header = header_of(printed)
    for column in ("ours ms", "% floor", "xla ms", "fla ms", "fla/ours", "floor ms", "relerr ours/xla"):
        assert column in header, column
    line = next(l for l in printed.splitlines() if l.startswith("B1 T40"))
    cells = dict(zip([h.strip() for h in header.split("|")], [c.strip() for c in line.split("|")]))
    assert float(cells["% floor"]) == pytest.approx(rows[0]["interpret_pct_floor"], abs=0.06)
    pytest.importorskip("matplotlib")
    assert (tmp_path / "bench.png").stat().st_size > 0             # the bar chart beside the JSON


# The other dtypes, by the names users type (fp16, float32 as well as f16, f32).
# The fp16 run also times a baseline (a copy of the package) in its own column.
@pytest.mark.parametrize("dtype,expected,tolerance", [("fp16", "f16", 2e-2), ("float32", "f32", 1e-5)])
def test_bench_chunk_o_dtypes(tmp_path, capsys, baseline_dir, dtype, expected, tolerance):
    out = tmp_path / "bench.json"
    baseline = ["--baseline", str(baseline_dir), "--rounds", "2"] if dtype == "fp16" else []
    script("bench_chunk_o").main(["--shapes", "B=1,T=24,H=1,K=16,V=32,M=2,segs=2", "--chunk", "16", "--dtype", dtype,
                                  "--impls", "xla,interpret", "--sets", "1", "--png", "none",
                                  "--out", str(out), *baseline, *QUICK, *COPY])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["dtype"] == expected and row["interpret_relerr_vs_xla"] < tolerance
    header = header_of(capsys.readouterr().out)
    assert ("old ms" in header and "new/old" in header) == bool(baseline)
    if baseline:
        assert row["baseline_relerr"] == 0.0 and row["baseline_timing"]["rounds"] == 2
        assert row["new_over_old"] == pytest.approx(row["interpret_ms"] / row["baseline_ms"])


def test_bench_chunk_o_bwd(tmp_path, capsys):
    out = tmp_path / "bwd.json"
    script("bench_chunk_o").main(["--bwd", "--shapes", "B=1,T=24,H=1,K=16,V=32,M=2,segs=2", "--chunk", "16",
                                  "--impls", "xla,interpret", "--sets", "1", "--rounds", "2",
                                  "--png", "none", "--out", str(out), *QUICK, *COPY])
    (row,) = json.loads(out.read_text())["rows"]
    assert "error" not in row, row
    assert row["fwdbwd_floor_ms"] == pytest.approx(row["fwd_floor_ms"] + row["bwd_floor_ms"])
    for name in ("interpret_fwdbwd", "xla_fwdbwd", "interpret_fwd", "bwd_kernel"):
        assert row[f"{name}_ms"] > 0, name
    assert row["interpret_fwdbwd_pct_floor"] == pytest.approx(
        100 * row["fwdbwd_floor_ms"] / row["interpret_fwdbwd_ms"], rel=1e-3)
    assert row["bwd_kernel_pct_floor"] == pytest.approx(100 * row["bwd_floor_ms"] / row["bwd_kernel_ms"],
                                                        rel=1e-3)
    assert set(row["relerr_vs_xla"]) == {"dq", "dk", "dv", "dh", "dg"} and row["relerr_max"] < 2e-2
    assert row["interpret_fwdbwd_timing"]["rounds"] == 2
    assert len(row["interpret_fwdbwd_timing"]["loop_ms"]) == 4          # 2 rounds of 2 loops
    assert row["bwd_over_fwd"] == pytest.approx(row["bwd_kernel_ms"] / row["interpret_fwd_ms"])
    header = header_of(capsys.readouterr().out)
    for column in ("fwd+bwd ms", "% floor", "bwd kernel ms", "bwd/fwd", "xla fwd+bwd ms", "xla/ours",
                   "relerr max"):
        assert column in header, column


@pytest.mark.skipif(not has_interpreter(), reason="this jax has no Mosaic GPU interpreter")
def test_bench_chunk_o_bwd_mosaic_kernel(tmp_path, capsys):
    """--bwd with mosaic: the Mosaic backward kernel alone beside the Triton one, and its ratio."""
    out = tmp_path / "bwd.json"
    script("bench_chunk_o").main(["--bwd", "--shapes", "B=1,T=100,H=1,K=64,V=128,M=2,segs=2",
                                  "--chunk", "64", "--impls", "interpret,mosaic_interpret",
                                  "--sets", "1", "--png", "none", "--out", str(out), *QUICK, *COPY])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["mosaic_bwd_kernel_ms"] > 0 and row["bwd_kernel_ms"] > 0, row
    assert row["mosaic_bwd_kernel_pct_floor"] == pytest.approx(
        100 * row["bwd_floor_ms"] / row["mosaic_bwd_kernel_ms"], rel=1e-3)
    header = header_of(capsys.readouterr().out)
    for column in ("mosaic bwd kernel ms", "triton/mosaic", "mosaic fwd+bwd ms"):
        assert column in header, column


def test_bench_chunk_o_rested_with_baseline(capsys, baseline_dir):
    result = script("bench_chunk_o").main(
        ["--rested", "--shapes", "B=1,T=32,H=1,K=32,V=16,M=2", "--chunk", "16", "--impls", "xla", "--bursts", "2",
         "--rest", "0", "--burst-ms", "1", "--sets", "2", "--baseline", str(baseline_dir), *QUICK, *COPY])
    (row,) = result["rows"]
    assert row["shape"] == "B1 T32 H1 K32 V16 M2" and row["floor_ms"] > 0
    for name in ("ours", "baseline"):
        assert row[f"{name}_sustained_ms"] > 0 and row[f"{name}_rested_ms"] > 0
        assert row[f"{name}_rested_pct_floor"] == pytest.approx(
            100 * row["floor_ms"] / row[f"{name}_rested_ms"])
    assert "fla_sustained_ms" not in row and row["new_over_old_rested"] > 0     # no fla on a CPU
    header = header_of(capsys.readouterr().out)
    for column in ("ours sust.", "ours rested", "baseline rested", "new/old rested", "MHz"):
        assert column in header, column


# ----------------------------------------------------------------------------- bench_full_op.py
def test_bench_full_op(tmp_path, capsys, baseline_dir):
    out = tmp_path / "full.json"
    script("bench_full_op").main(["--shapes", "B=1,T=24,H=1,K=16,V=16,M=2,segs=2", "--impl", "xla",
                                  "--chunk", "16", "--l2norm", "--baseline", str(baseline_dir),
                                  "--only", "ours_fwd,baseline_fwd,ours_fwdbwd_ng,stage_o",
                                  "--rounds", "2", "--out", str(out), *QUICK])
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert "error" not in row and result["meta"]["impl"] == "xla" and row["l2norm"]
    for name in ("ours_fwd", "baseline_fwd", "ours_fwdbwd_ng", "stage_o"):
        assert row[f"{name}_ms"] > 0, name
        assert row[f"{name}_timing"]["first_call_s"] > 0
    assert row["ours_fwd_timing"]["rounds"] == 2 and "ours_fwdbwd_ms" not in row   # --only
    assert row["relerr_o_baseline"] == 0.0 and row["relerr_state_baseline"] == 0.0
    assert row["new_over_old_fwd"] == pytest.approx(row["ours_fwd_ms"] / row["baseline_fwd_ms"])
    assert not any(key.startswith("fla") for key in row)
    printed = capsys.readouterr().out
    header = header_of(printed)
    for column in ("ours_fwd", "ours_fwdbwd_ng", "baseline_fwd", "stage_o", "new/old fwd",
                   "first call s (fwd, fb)"):
        assert column in header, column


# -------------------------------------------------------------------------------------- tune.py
# A tiny config per stage, with another tiling than the default's where the stage has one.
TUNE_CONFIGS = {"chunk_o_fwd": "k16:block_k=16;odd:block_v=48", "chunk_o_bwd": "bk16:block_k=16",
                "wy": "w4:num_warps=4", "walk": "bv16:block_v=16", "walk_bwd": "bv16:block_v=16",
                "wy_t": "w4:num_warps=4", "wy_t_l2norm": "n2:sub_chunks_per_program=2",
                "walk_t": "bv16:block_v=16",
                "wy_bwd": "c16:block_cols=16"}


@pytest.mark.parametrize("stage", list(TUNE_CONFIGS))
def test_tune_stage(stage, capsys, tmp_path):
    out = tmp_path / "tune.json"
    result = script("tune").main(["--stage", stage, "--shapes", "B=1,T=32,H=1,K=32,V=32,M=2,segs=2",
                                  "--chunk", "16", "--configs", TUNE_CONFIGS[stage], "--sets", "1",
                                  "--out", str(out), "--reps", "1", "--target-ms", "1", *COPY])
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert result["stage"] == stage and set(rows) == {"default"} | set(
        c.split(":")[0] for c in TUNE_CONFIGS[stage].split(";"))
    default = rows.pop("default")
    assert default["relerr"] == 0.0 and default["ok"] and default["ms"] > 0 and default["floor_ms"] > 0
    name = TUNE_CONFIGS[stage].split(":")[0]
    assert rows[name]["ok"] and rows[name]["ms"] > 0 and rows[name]["relerr"] < 1e-2
    assert rows[name]["block_sizes"][next(iter(rows[name]["overrides"]))] == rows[name]["overrides"][
        next(iter(rows[name]["overrides"]))]
    if stage == "chunk_o_fwd":
        assert rows["odd"]["error"].startswith("does not fit")
    printed = capsys.readouterr().out
    assert "rel diff from default" in printed
    for column in ("config", "ms", "x default", "% floor", "rel diff", "SM MHz"):
        assert column in header_of(printed), column


def test_tune_mosaic_stage(tmp_path):
    """The Mosaic GPU forward's stage (interpreted here): its slot and value-program configs give
    the default's outputs, and a config outside the problem is reported, not run."""
    out = tmp_path / "tune.json"
    script("tune").main(["--stage", "chunk_o_fwd_mosaic", "--shapes",
                         "B=1,T=100,H=1,K=64,V=128,M=2,segs=2", "--chunk", "64", "--dtype", "bf16",
                         "--configs", "s2:slots=2;v64:block_v=64;bad:slots=3", "--sets", "1",
                         "--out", str(out), "--reps", "1", "--target-ms", "1", *COPY])
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    for name in ("s2", "v64"):
        assert rows[name]["ok"] and rows[name]["relerr"] == 0.0, rows[name]
    assert rows["bad"]["error"].startswith("does not fit") and "slots" in rows["bad"]["error"]


def test_tune_walk_every_chunk_too_option(tmp_path, monkeypatch):
    """The walk's every_chunk_too option reaches the kernel (and only the config that sets it) and
    leaves the compared outputs equal to the default's."""
    from gdp_jax.ops.chunk_h import pallas_fwd
    seen, original = [], pallas_fwd.chunk_h_pallas

    def recording(*args, **kwargs):
        seen.append(kwargs["every_chunk_too"])
        return original(*args, **kwargs)

    monkeypatch.setattr(pallas_fwd, "chunk_h_pallas", recording)
    out = tmp_path / "tune.json"
    script("tune").main(["--stage", "walk", "--shapes", "B=1,T=40,H=1,K=32,V=16,M=2,segs=2",
                         "--chunk", "16", "--configs", "every:every_chunk_too=1,num_stages=2",
                         "--sets", "1", "--out", str(out), "--reps", "1", "--target-ms", "1", *COPY])
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    every = rows["every"]
    assert every["ok"] and every["relerr"] == 0.0 and every["ms"] > 0, every
    assert every["options"] == {"every_chunk_too": 1} and every["block_sizes"]["num_stages"] == 2
    assert set(seen) == {False, True}


def test_tune_walk_defaults_of_forward_and_backward_walks(tmp_path):
    """At K = 128 the forward walk's default takes one sub-chunk a step; a config with
    every_chunk_too overrides the backward walk's default (whole token chunks) instead."""
    out = tmp_path / "tune.json"
    script("tune").main(["--stage", "walk", "--shapes", "B=1,T=40,H=1,K=128,V=16,M=2",
                         "--dtype", "bf16", "--chunk", "16", "--configs",
                         "every:every_chunk_too=1;fwd:num_warps=4", "--sets", "1", "--out", str(out),
                         "--reps", "1", "--target-ms", "1", *COPY])
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["default"]["block_sizes"]["chunks_per_step"] == 1
    assert rows["fwd"]["block_sizes"]["chunks_per_step"] == 1
    assert rows["every"]["block_sizes"]["chunks_per_step"] is None, rows["every"]
    assert all(r["ok"] for r in rows.values()), rows


def test_tune_backward_stages_where_the_op_works_from_T(tmp_path):
    """bf16 at K = 128: the op's backward works from T, and so do the walk_bwd and wy_bwd stages
    (T as the walk's operand, the WY VJP on right-hand-side cotangents); walk_t also runs as the
    differentiable forward's walk (every_chunk_too). The wy_bwd stage adds the other dk shares
    as the op does (the walk's, whose gate terms it forms, so the epilogue of walk_bwd does not)."""
    tune = script("tune")
    shape = ["--shapes", "B=1,T=32,H=1,K=128,V=16,M=2", "--dtype", "bf16", "--chunk", "16",
             "--sets", "1", "--reps", "1", "--target-ms", "1", *COPY]
    for stage, configs in (("walk_bwd", "w8:num_warps=8"),
                           ("wy_bwd", "w:rhs_cotangents=0;n:l2norm=1"),
                           ("walk_t", "every:every_chunk_too=1")):
        out = tmp_path / f"{stage}.json"
        tune.main(["--stage", stage, "--configs", configs, "--out", str(out), *shape])
        rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
        assert rows["default"]["ok"], rows
        for name in (c.split(":")[0] for c in configs.split(";")):
            assert rows[name]["ms"] > 0, rows
            if stage == "wy_bwd":   # other cotangents or the keys' l2norm VJP: another function
                assert rows[name]["relerr"] > 1e-2, rows
            else:
                assert rows[name]["ok"], rows
    stage = tune.STAGES["walk_bwd"]()
    stage.interpret = True
    problems = script("common").make_problems(dict(B=1, T=32, H=1, K=128, V=16, M=2), op="full",
                                              dtype="bf16", sets=1, chunk_size=16)
    (operands,) = stage.inputs(problems)
    assert stage.from_inverse and operands[1].shape[-1] == 16      # T [B, P, H, sub]
    assert tune.backward_from_inverse(problems[0], True)
    # the epilogue leaves the gate terms of the walk's dk share to the WY VJP kernel wherever
    # that kernel runs (16-bit inputs, or the interpreter), as _states_bwd has it
    assert not tune.walk_key_gate_terms(problems[0], True)
    assert not tune.walk_key_gate_terms(problems[0], False)
    f32 = script("common").make_problems(dict(B=1, T=32, H=1, K=128, V=16, M=2), op="full",
                                         dtype="f32", sets=1, chunk_size=16)
    assert not tune.backward_from_inverse(f32[0], True)
    assert tune.walk_key_gate_terms(f32[0], False)      # compiled float32: the WY VJP in jnp
    result = script("profile_gpu").main(["--mode", "stages", "--shape", "B=1,T=32,H=1,K=128,V=16,M=2",
                                         "--dtype", "bf16", "--chunk", "16",
                                         "--only", "walk_kernel,wy_bwd_pallas,wy_bwd_pallas_l2norm,wy_bwd_xla",
                                         "--sets", "1", "--reps", "1", "--target-ms", "1",
                                         "--out", str(tmp_path / "stages.json"), *COPY])
    rows = result["rows"]
    assert set(rows) == {"walk_kernel", "wy_bwd_pallas", "wy_bwd_pallas_l2norm", "wy_bwd_xla"}, rows
    assert all(row["ms"] > 0 for row in rows.values()), rows
    # the kernel's floor, counted by hand on the P = 64 positions: k, dw, the two dk shares and dk
    # ([P, 128] bf16 each), v, T, du and dv ([P, 16] bf16), beta (bf16), gamma, the keys' factors,
    # dbeta and dgamma (float32)
    assert rows["wy_bwd_pallas_l2norm"]["bytes"] == 64 * (5 * 128 * 2 + 4 * 16 * 2 + 2 + 4 * 4)
    assert rows["wy_bwd_pallas"]["bytes"] == rows["wy_bwd_pallas_l2norm"]["bytes"] - 64 * 4


def test_tune_ab_rounds_list_and_budget(capsys):
    tune = script("tune")
    result = tune.main(["--stage", "chunk_o_fwd", "--shapes", "B=1,T=32,H=1,K=16,V=16,M=1",
                        "--chunk", "16", "--configs", "w8:num_warps=8", "--rounds", "3", "--sets", "1",
                        "--reps", "1", "--target-ms", "1", *COPY])
    rows = {r["config"]: r for r in result["rows"]}
    assert len(rows["default"]["round_ms"]) == 3 and len(rows["w8"]["round_ms"]) == 3
    assert rows["w8"]["min_ms"] <= rows["w8"]["ms"] <= rows["w8"]["max_ms"]
    assert rows["w8"]["relerr"] == 0.0                     # warps do not change the interpreter's math
    assert tune.main(["--stage", "walk", "--shapes", "B=1,T=32,H=1,K=16,M=1", "--list"]) is None
    assert "block_v=16,num_warps=2" in capsys.readouterr().out
    # walk_bwd's default depends on whether the backward works from T, which --list reads off
    # the forward's output structure (no inputs are built)
    assert tune.main(["--stage", "walk_bwd", "--shapes", "B=1,T=32,H=1,K=128,V=16,M=2",
                      "--dtype", "bf16", "--chunk", "16", "--list"]) is None
    assert "default BlockSizes(" in capsys.readouterr().out
    skipped = tune.main(["--stage", "wy", "--shapes", "B=1,T=32,H=1,K=16,M=1", "--budget-s", "0", *COPY])
    assert skipped["rows"] == [] and skipped["skipped"] == [dict(shape="B1 T32 H1 K16 M1", config="(all)")]
    with pytest.raises(SystemExit, match="not field=value"):
        tune.parse_configs("a:block_k")
    assert tune.parse_configs("x:block_k=None,split=True,copy_order=fused;num_warps=8") == {
        "x": dict(block_k=None, split=True, copy_order="fused"), "num_warps=8": dict(num_warps=8)}


# ------------------------------------------------------------------------------- profile_gpu.py
def test_profile_stages(tmp_path, capsys):
    out = tmp_path / "stages.json"
    result = script("profile_gpu").main(["--mode", "stages", "--shape", "B=1,T=16,H=1,K=16,M=2", "--chunk", "16",
                                     "--only", "states_fwd_rule,wy_autodiff,walk_fwd_t", "--sets", "1",
                                     "--reps", "1", "--target-ms", "1", "--out", str(out), *COPY])
    assert set(result["rows"]) == {"states_fwd_rule", "wy_autodiff", "walk_fwd_t"}
    assert all(r["ms"] > 0 for r in result["rows"].values()), result["rows"]
    assert json.loads(out.read_text())["rows"]["wy_autodiff"]["ms"] > 0
    assert result["bandwidth"]["GBps"] > 0 and result["matmul_rate"]["TFLOPs"] > 0
    for name, row in result["rows"].items():
        assert row["bytes"] > 0 and row["flops"] > 0 and row["bound"] in ("memory", "compute"), row
        assert row["floor_ms"] == max(row["memory_ms"], row["compute_ms"]) > 0
        assert row["pct_floor"] == pytest.approx(100 * row["floor_ms"] / row["ms"])
    printed = capsys.readouterr().out
    assert "states_fwd_rule" in printed
    header = next(line for line in printed.splitlines() if line.startswith("stage"))
    for column in ("floor ms", "% floor", "bound", "MB moved", "GFLOP"):
        assert column in header, column


def test_stage_floors_by_hand():
    """stage_dot_flops against the counts written out for B=2 T=16 H=3 K=16 V=8 M=2, chunk 16
    (P = 32 positions, sub-chunks S = 16), io_bytes and roofline_ms on numbers known here."""
    profile, common = script("profile_gpu"), script("common")
    shp = dict(B=2, T=16, H=3, K=16, V=8, M=2)
    wy = 2 * 32 * 16 * (2 * 16 + 8) + 2 * 32 * 16 * 16 / 3
    walk = 4 * 32 * 16 * 8
    out = 2 * 16 * (16 * 2 * (16 + 8) + 16 * 8)
    flops = lambda name: profile.stage_dot_flops(name, shp, 16) / 6        # per (row, head)
    assert flops("wy_fwd") == pytest.approx(wy) and flops("walk_fwd") == walk
    assert flops("chunk_o_fwd") == out and flops("chunk_o_bwd") == 2 * out
    assert flops("op_fwd") == pytest.approx(wy + walk + out)
    assert flops("op_fwdbwd") == pytest.approx(3 * (wy + walk + out))
    assert profile.stage_dot_flops("walk_fwd", dict(shp, V=None), 16) == 6 * 4 * 32 * 16 * 16
    # the WY kernel writing T alone (K K^T, the inverse) and the walk applying it (T x one more)
    assert flops("wy_fwd_t") == pytest.approx(2 * 32 * 16 * 16 + 2 * 32 * 16 * 16 / 3)
    assert flops("walk_fwd_t") == walk + 2 * 32 * 16 * 8
    import jax.numpy as jnp
    x = jnp.zeros((10, 4), jnp.float32)
    assert profile.io_bytes(lambda a, _: (a.astype(jnp.bfloat16), a[0]), (x, None)) == 160 + 80 + 16
    memory = common.roofline_ms(2e9, 5e11, dict(GBps=1000.0), dict(TFLOPs=500.0))
    assert memory["bound"] == "memory" and memory["floor_ms"] == pytest.approx(2.0)
    assert memory["compute_ms"] == pytest.approx(1.0)
    compute = common.roofline_ms(1e9, 2e12, dict(GBps=1000.0), dict(TFLOPs=500.0))
    assert compute["bound"] == "compute" and compute["floor_ms"] == pytest.approx(4.0)
    unknown = common.roofline_ms(1e9, 2e12, dict(GBps=float("nan")), dict(TFLOPs=float("nan")))
    assert unknown["bound"] == "-" and unknown["floor_ms"] != unknown["floor_ms"]


def test_profile_kernels_on_cpu_and_trace_parsing(tmp_path):
    profile = script("profile_gpu")
    result = profile.main(["--shape", "B=1,T=16,H=1,K=16,M=1", "--chunk", "16", "--impl", "xla",
                           "--only", "fwd", "--calls", "1", "--out", str(tmp_path / "kernels")])
    assert set(result["tables"]) <= {"fwd"} and (tmp_path / "kernels" / "kernels.json").exists()
    events = [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0")),
              dict(ph="M", name="thread_name", pid=1, tid=7, args=dict(name="Stream #14")),
              dict(ph="M", name="thread_name", pid=1, tid=8, args=dict(name="XLA Ops")),
              dict(ph="M", name="process_name", pid=2, args=dict(name="/host:CPU")),
              dict(ph="X", name="gdp_wy_fwd", pid=1, tid=7, dur=300.0),
              dict(ph="X", name="gdp_wy_fwd", pid=1, tid=7, dur=500.0),
              dict(ph="X", name="fusion", pid=1, tid=7, dur=100.0),
              dict(ph="X", name="gdp_wy_fwd", pid=1, tid=8, dur=900.0),       # a summary line
              dict(ph="X", name="host_work", pid=2, tid=7, dur=5000.0)]
    trace = tmp_path / "trace.json.gz"
    with gzip.open(trace, "wt") as fh:
        json.dump(dict(traceEvents=events), fh)
    assert profile.gpu_kernel_times(str(trace), calls=2) == [("gdp_wy_fwd", 0.4, 1), ("fusion", 0.05, 0)]


# ----------------------------------------------------------------------------------- codegen.py
def test_codegen_captures_the_triton_ir(tmp_path, capsys):
    from gdp_jax.ops.chunk_o.pallas_fwd import default_block_sizes

    codegen = script("codegen")
    for name, (_, _, _, key_dim, value_dim, m, overrides) in codegen.VARIANTS.items():
        sizes = dataclasses.replace(default_block_sizes(key_dim, value_dim, 64, m),
                                    **{k: v for k, v in overrides.items() if k != "segments"})
        sizes.check(key_dim, value_dim)                    # every recorded variant still builds
    meta = codegen.main(["--out", str(tmp_path), "--variants", "M2,M2_segments,K256_no_k_loop"])
    assert meta["M2"]["num_stages"] == 5 and meta["K256_no_k_loop"]["num_stages"] == 2
    for name in meta:
        assert "tt.func" in (tmp_path / f"{name}.ttir").read_text()
    bwd = codegen.main(["--out", str(tmp_path / "bwd"), "--case", "chunk_o_bwd"])
    assert {"bwd_default", "bwd_fused", "bwd_bk64"} <= set(bwd) and bwd["bwd_w8"]["num_warps"] == 8
    # --shape: K = 256's default has 64-wide key blocks; variants that do not tile K = 32 are skipped
    wide = codegen.main(["--out", str(tmp_path / "bwd256"), "--case", "chunk_o_bwd",
                         "--shape", "B=1,T=128,H=1,K=256,M=2"])
    assert "block_k=64" in wide["bwd_default"]["config"] and "block_k=128" in wide["bwd_bk128"]["config"]
    narrow = codegen.main(["--out", str(tmp_path / "bwd32"), "--case", "chunk_o_bwd",
                           "--shape", "B=1,T=128,H=1,K=32,M=1"])
    assert "bwd_default" in narrow and "bwd_bk64" not in narrow
    assert "Triton IR in" in capsys.readouterr().out


def test_codegen_full_op_has_the_primal_forwards_own_kernels(tmp_path):
    """--case full lists the grad path's kernels and, as NAME@primal, the undifferentiated
    forward's where they differ: its walk takes one sub-chunk a step at K = 128."""
    meta = script("codegen").main(["--out", str(tmp_path), "--case", "full",
                                   "--shape", "B=1,T=256,H=1,K=128,M=2"])
    assert {"gdp_wy_fwd", "gdp_chunk_h_fwd", "gdp_chunk_h_bwd", "gdp_chunk_h_fwd@primal"} <= set(meta)
    assert "tt.func" in (tmp_path / "gdp_chunk_h_fwd@primal.ttir").read_text()
    # --no-g: the ungated op's kernels, whose walks take no decays
    script("codegen").main(["--out", str(tmp_path / "ungated"), "--case", "full", "--no-g",
                            "--shape", "B=1,T=256,H=1,K=128,M=2"])
    gated_walk = (tmp_path / "gdp_chunk_h_bwd.ttir").read_text()
    ungated_walk = (tmp_path / "ungated" / "gdp_chunk_h_bwd.ttir").read_text()
    assert "exp2" in gated_walk and "exp2" not in ungated_walk


# ---------------------------------------------------------------------------- bench_sharding.py
def test_bench_sharding_one_device(tmp_path):
    out = tmp_path / "sharding.json"
    results = script("bench_sharding").main(["--devices", "1", "--shapes", "B=2,T=16,H=1,K=16,M=1",
                                             "--layouts", "data", "--no-grad", "--chunk-size", "16",
                                             "--out", str(out), *QUICK])
    (row,) = results
    assert "error" not in row, row
    assert row["sharded_ms"] > 0 and row["collectives"] == [] and row["rel_err_vs_1gpu"] == 0.0
    assert json.loads(out.read_text())["meta"]["impl"] == "xla"
