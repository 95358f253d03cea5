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
    assert "B2 T256 H2 K32 V16 M1 seg3" in capsys.readouterr().out


def test_ab_chunk_o_tiny(capsys):
    import ab_chunk_o

    results = ab_chunk_o.main(["--shape", "B=1,T=100,H=2,K=32,V=32,M=2,segs=3", "--configs",
                               "k16:block_k=16", "--rounds", "1", "--sets", "2", *QUICK])
    printed = capsys.readouterr().out
    assert "default" in printed and "{'block_k': 16}" in printed
    assert results["default"]["rel_err"] == 0.0
    assert results["k16"]["rel_err"] < 1e-2        # another K tiling: at most f32 rounding


def test_ab_chunk_o_rejects_unnamed_config():
    import ab_chunk_o

    with pytest.raises(SystemExit, match="needs a name"):
        ab_chunk_o.parse_named_configs("block_k=16")
