"""notebooks/*.ipynb (every one in the folder) execute top to bottom (nbclient, a kernel on this
interpreter) without a cell error, and are stored without outputs."""

import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")
pytest.importorskip("optax")
pytest.importorskip("flax.nnx")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


def test_the_notebooks_are_found():
    # The README's two notebooks at least: a wrong folder would otherwise test nothing.
    assert {"01_chunk_o.ipynb", "02_layer.ipynb"} <= set(NAMES), NAMES


@pytest.mark.parametrize("name", NAMES)
def test_stored_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


@pytest.mark.parametrize("name", NAMES)
def test_executes(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    # The "python3" kernel of ipykernel on *this* interpreter: an installed python3 kernelspec may
    # start whatever `python` is first on PATH (another environment), so look at no kernel dirs.
    km = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))
    assert km.kernel_spec.argv[0] == sys.executable
    client = nbclient.NotebookClient(nb, km=km, timeout=240, allow_errors=False,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    # The kernel imports gdp_jax from this checkout, like the tests (and as an install would).
    path = [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    client.execute(env=env)      # raises CellExecutionError, naming the cell, on any error
