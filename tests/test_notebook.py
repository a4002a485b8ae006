"""The per-block heatmaps notebook runs from a clean kernel, on the public API, stored without
outputs."""

import copy
import re
from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "per_block_heatmaps.ipynb"


@pytest.fixture(scope="module")
def notebook():
    return nbformat.read(NOTEBOOK, as_version=4)


def code(nb) -> list[str]:
    return [cell.source for cell in nb.cells if cell.cell_type == "code"]


def test_stored_without_outputs(notebook):
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


def test_uses_only_the_public_api(notebook):
    imports = re.findall(r"^(?:from|import) (fp4lab\S*)", "\n".join(code(notebook)), flags=re.M)
    assert imports and set(imports) <= {"fp4lab", "fp4lab.analysis"}
    assert not re.search(r"\._\w", "\n".join(code(notebook)))  # no private names


def test_executes_and_draws_the_heatmaps(notebook, tmp_path):
    """Runs every cell with the python3 kernel of this interpreter (nbclient; < 60 s)."""
    notebook = copy.deepcopy(notebook)  # the stored one stays clean for the other tests
    resources = {"metadata": {"path": str(tmp_path)}}
    nbclient.NotebookClient(
        notebook, kernel_name="python3", timeout=120, resources=resources
    ).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 5
    table = outputs[0]["data"]["text/plain"]
    for recipe in ("nvfp4", "fa4fp4_causal", "fa4fp4_causal_mxfp4pv"):
        assert recipe in table
