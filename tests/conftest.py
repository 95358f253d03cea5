import os

import jax
import pytest

# Tests that run for tens of seconds in one piece (subprocesses with 4 virtual devices, notebook
# kernels, training runs). They go first, so that under ``-n 2`` (pytest-xdist hands out tests in
# collection order) one worker takes them while the other works through the many short ones,
# instead of one of them starting last and leaving a worker idle at the end.
LONG_TESTS = ("on_4_cpu_devices", "test_notebooks.py::test_executes", "test_training_lowers_the_loss",
              "test_smallest_training_run")


def _has_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


# On a CPU the suite's time is mostly XLA compiling small programs: compile them with XLA's cheap
# pipeline (jax_disable_most_optimizations), about half the suite's CPU time. What is tested is
# unchanged: the same programs, compared against float64 references. The environment variable
# carries the setting into the subprocesses (4 virtual devices) and notebook kernels.
# GDP_TEST_OPTIMIZED=1 keeps XLA's full pipeline; on a GPU it is always kept.
if not _has_gpu() and os.environ.get("GDP_TEST_OPTIMIZED", "0") in ("", "0"):
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    jax.config.update("jax_disable_most_optimizations", True)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not any(name in item.nodeid for name in LONG_TESTS))  # stable
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (Pallas Triton path)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
