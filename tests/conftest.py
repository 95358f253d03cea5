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


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not any(name in item.nodeid for name in LONG_TESTS))  # stable
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (Pallas Triton path)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
