"""notebooks/quickstart.ipynb executed headless in a real Jupyter kernel (nbclient + ipykernel),
the way Colab runs it: every cell must run without error and show what it promises."""

from __future__ import annotations

import os
import re

import nbclient
import nbformat
import pytest

from tests.servers import REPO
from tests.test_launcher import port_open

QUICKSTART = REPO / "notebooks" / "quickstart.ipynb"


def cell_text(cell: nbformat.NotebookNode) -> str:
    return "".join(out.get("text", "") for out in cell.get("outputs", []) if out.output_type == "stream")


def test_quickstart_notebook_is_valid_and_saved_without_outputs():
    notebook = nbformat.read(QUICKSTART, as_version=4)
    nbformat.validate(notebook)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")
    assert "pip" in notebook.cells[1].source and "constraints.txt" in notebook.cells[1].source  # Colab install


@pytest.mark.slow
def test_quickstart_notebook_runs(monkeypatch):
    # The kernel imports this checkout (so the install cell skips pip) on one CPU device, as on Colab.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    notebook = nbformat.read(QUICKSTART, as_version=4)
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=600,
                                     resources={"metadata": {"path": str(QUICKSTART.parent)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, if a cell fails

    texts = [cell_text(cell) for cell in notebook.cells]
    output = "\n".join(texts)
    assert f"agentgym_jax in {REPO / 'agentgym_jax'}" in texts[1]

    # Both trajectories shown: masked runs alternate, some but not all tokens are trained on, and
    # the oracle demonstration trains on its "Action: ..." replies.
    shown = re.findall(r"(\d+) of (\d+) tokens trained on; status=(\w+)", output)
    assert len(shown) == 2 and all(0 < int(trained) < int(total) for trained, total, _ in shown)
    assert shown[0][2] == "success"
    assert re.search(r"mask=1 \| 'Action: move (up|down|left|right)", output)
    assert re.search(r"mask=0 \| '.*Goal: ", output)

    assert re.search(r"^16 episodes, success_rate=\d\.\d\d$", output, re.M)
    steps = re.findall(r"^step (\d): success_rate=(\S+) loss=(\S+) entropy=(\S+) kl=(\S+)$", output, re.M)
    assert [s[0] for s in steps] == ["1", "2"] and all(float(s[3]) > 0 for s in steps)  # a sampling policy has entropy

    plots = [out for cell in notebook.cells for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
    assert len(plots) == 1
    url = re.search(r"^stopped (http://\S+)$", output, re.M).group(1)
    assert not port_open(url)
