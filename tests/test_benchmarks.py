"""The benchmark scripts' logic on a CPU, on tiny shapes: they run end to end, write their JSON,
and our kernel (in Pallas' interpreter) agrees with the jnp path inside them. Their timings mean
nothing here; the GPU numbers are in benchmarks/RESULTS.md."""
import json
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

QUICK = ["--copy-mb", "16", "--target-ms", "5", "--reps", "2"]


def test_bench_chunk_o_tiny(tmp_path, capsys):
    import bench_chunk_o

    out = tmp_path / "bench.json"
    bench_chunk_o.main(["--shapes", "tiny", "--impls", "xla,interpret", "--sets", "2",
                        "--out", str(out), *QUICK])
    rows = json.loads(out.read_text())["rows"]
    assert [row["shape"] for row in rows] == ["B2 T200 H2 K32 M2", "B2 T256 H2 K32 V16 M1 seg3"]
    for row in rows:
        assert "error" not in row and row["xla_ms"] > 0 and row["interpret_ms"] > 0
        assert row["floor_ms"] > 0 and row["bytes"] > 0
        assert row["interpret_relerr_vs_xla"] < 2e-2            # bf16 inputs, f32 accumulation
        assert row["xla_pct_floor"] == pytest.approx(100 * row["floor_ms"] / row["xla_ms"], rel=1e-3)
    printed = capsys.readouterr().out
    assert "B2 T256 H2 K32 V16 M1 seg3" in printed
    header = next(line for line in printed.splitlines() if line.startswith("shape"))
    for column in ("pallas ms", "% floor", "xla ms", "fla ms", "fla/ours", "floor ms"):
        assert column in header, column
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "bench.png").stat().st_size > 0             # the bar chart beside the JSON


# The other dtypes, by the names users type (fp16, float32 as well as f16, f32).
@pytest.mark.parametrize("dtype,expected,tolerance", [("fp16", "f16", 2e-2), ("float32", "f32", 1e-5)])
def test_bench_chunk_o_dtypes(tmp_path, dtype, expected, tolerance):
    import bench_chunk_o

    out = tmp_path / "bench.json"
    bench_chunk_o.main(["--shapes", "B=1,T=80,H=2,K=16,V=32,M=2,segs=2", "--dtype", dtype,
                        "--impls", "xla,interpret", "--sets", "2", "--png", "none", "--out", str(out),
                        *QUICK])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["dtype"] == expected and row["interpret_relerr_vs_xla"] < tolerance


def test_ab_chunk_o_tiny(capsys):
    import ab_chunk_o

    results = ab_chunk_o.main(["--shape", "B=1,T=100,H=2,K=32,V=32,M=2,segs=3", "--configs",
                               "k16:block_k=16", "--rounds", "1", "--sets", "2", *QUICK])
    printed = capsys.readouterr().out
    assert "default" in printed and "{'block_k': 16}" in printed
    assert results["default"]["rel_err"] == 0.0
    assert results["k16"]["rel_err"] < 1e-2        # another K tiling: at most f32 rounding


def test_burst_chunk_o_tiny(capsys):
    import burst_chunk_o

    rows = burst_chunk_o.main(["--shapes", "B=1,T=100,H=2,K=32,V=16,M=2", "--bursts", "2",
                               "--rest", "0", "--burst-ms", "1", "--sets", "2", *QUICK])
    (row,) = rows
    assert row["shape"] == "B1 T100 H2 K32 V16 M2" and row["floor_ms"] > 0
    assert row["ours_sustained_ms"] > 0 and row["ours_rested_ms"] > 0
    assert "fla_sustained_ms" not in row                  # no fla on a CPU
    assert "B1 T100 H2 K32 V16 M2" in capsys.readouterr().out


def test_ab_chunk_o_rejects_unnamed_config():
    import ab_chunk_o

    with pytest.raises(SystemExit, match="needs a name"):
        ab_chunk_o.parse_named_configs("block_k=16")


def test_gpu_monitor_attributes_samples_to_phases():
    """GpuMonitor's parsing and phase bookkeeping, fed by a stand-in for nvidia-smi that prints
    two uncapped samples, a line it must skip, then two capped ones."""
    import time

    from bench_common import GpuMonitor

    script = ("import sys, time\n"
              "for line in ['1980, 300.5, Not Active', '1965, 310.0, Not Active', '[N/A], 1, x',"
              " '1500, 699.0, Active', '900, 712.3, Active']:\n"
              "    print(line, flush=True); time.sleep(0.05)\n"
              "time.sleep(60)\n")
    with GpuMonitor(command=[sys.executable, "-c", script]) as monitor:
        with monitor.phase("timed"):
            deadline = time.perf_counter() + 30
            while len(monitor.samples) < 4 and time.perf_counter() < deadline:
                time.sleep(0.02)
    assert [s[1:] for s in monitor.samples] == [(1980.0, 300.5, False), (1965.0, 310.0, False),
                                                (1500.0, 699.0, True), (900.0, 712.3, True)]
    start, end = monitor.phases["timed"]
    assert start <= monitor.samples[0][0] and monitor.samples[-1][0] <= end
    # Phases split between the second and third sample, and one before any sample.
    times = [s[0] for s in monitor.samples]
    middle = (times[1] + times[2]) / 2
    monitor.phases.update(cool=(start, middle), hot=(middle, end), before=(start - 2, start - 1))
    assert monitor.summary("before") is None and GpuMonitor.describe(None) == ""
    cool, hot = monitor.summary("cool"), monitor.summary("hot")
    assert cool == dict(samples=2, sm_mhz_median=1972.5, sm_mhz_min=1965.0, power_w_max=310.0,
                        power_capped=0.0)
    assert hot["power_capped"] == 1.0 and hot["sm_mhz_min"] == 900.0 and hot["power_w_max"] == 712.3
    assert GpuMonitor.describe(hot) == ("SM 1200 MHz (min 900), power cap 100% of samples, "
                                       "max 712 W")


def test_gpu_monitor_without_nvidia_smi():
    from bench_common import GpuMonitor

    with GpuMonitor(command=["surely-not-a-command-here"]) as monitor:
        with monitor.phase("p"):
            pass
    assert monitor.summary("p") is None and monitor.samples == []


def test_time_jax_enters_during_around_the_timed_loops_only():
    """A GpuMonitor phase passed as ``during`` must not cover compiling and warming up."""
    import contextlib

    import jax.numpy as jnp
    from bench_common import time_jax

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
    assert seen["enter"] == 2 * len(sets)                 # warm every set, then one timing estimate
    assert seen["exit"] - seen["enter"] == info["reps"] * info["n"]
