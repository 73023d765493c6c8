"""``notebooks/sampling.ipynb`` runs top to bottom and is committed without outputs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "sampling.ipynb"


def test_notebook_is_committed_without_outputs():
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, (f"cells {dirty} of {NOTEBOOK.name} hold outputs; strip them with "
                       "'jupyter nbconvert --clear-output --inplace notebooks/sampling.ipynb'")


@pytest.mark.slow
def test_notebook_runs_top_to_bottom(monkeypatch):
    """Executes every cell in a fresh kernel; any cell error fails with that cell's traceback."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"{NOTEBOOK.name} failed:\n{e}")
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for o in outputs), "the throughput plot was not drawn"
