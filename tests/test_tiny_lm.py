"""examples/tiny_lm.py: a few dozen CPU training steps must lower the loss clearly; the CLI works."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("flax.nnx")
pytest.importorskip("optax")

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "tiny_lm.py"

CONFIG = dict(batch=16, pairs=4, num_keys=16, num_values=8, dim=32, depth=1, heads=2,
              head_dim=16, num_householder=2, chunk_size=16)


@pytest.fixture(scope="module")
def tiny_lm():
    """The example script, imported as a module from its path (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("tiny_lm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_lowers_the_loss(tiny_lm):
    _, losses, accs = tiny_lm.train(60, implementation="xla", lr=3e-3, seed=0, **CONFIG)
    assert len(losses) == len(accs) == 60 and np.all(np.isfinite(losses))
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert last < 0.8 * first, (first, last, losses)


def test_recall_batch_pairs_query_with_its_value(tiny_lm):
    import jax
    tokens, target = tiny_lm.recall_batch(jax.random.key(3), 8, pairs=5, num_keys=16,
                                          num_values=8)
    tokens, target = np.asarray(tokens), np.asarray(target)
    assert tokens.shape == (8, 11) and target.shape == (8,)
    keys, values, query = tokens[:, 0:10:2], tokens[:, 1:10:2], tokens[:, -1]
    assert np.all(keys < 16) and np.all((values >= 16) & (values < 24))
    assert all(len(set(row)) == 5 for row in keys)               # distinct keys per row
    for b in range(8):
        assert target[b] == values[b][list(keys[b]).index(query[b])]


def test_gpu_flag_refuses_a_cpu_backend(tiny_lm, capsys):
    import jax
    if jax.default_backend() == "gpu":
        pytest.skip("has a GPU")
    with pytest.raises(SystemExit) as exc:
        tiny_lm.main(["--gpu"])
    assert exc.value.code == 2 and "--gpu needs a GPU backend" in capsys.readouterr().err


def test_script_help_runs_standalone():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--gpu" in out.stdout and "--batch" in out.stdout
