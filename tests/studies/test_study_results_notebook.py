"""notebooks/study_results.ipynb: stored without outputs, public API only, and executed on
both studies' smoke results (figures, curve, and the trace's heatmaps where there is one)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "study_results.ipynb"


@pytest.fixture(scope="module")
def notebook():
    return nbformat.read(NOTEBOOK, as_version=4)


def code(nb) -> str:
    return "\n".join(cell.source for cell in nb.cells if cell.cell_type == "code")


def test_stored_without_outputs(notebook):
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


def test_uses_only_the_public_api(notebook):
    imports = re.findall(r"^(?:from|import) (fp4lab\S*)", code(notebook), flags=re.M)
    assert imports and set(imports) <= {"fp4lab", "fp4lab.analysis", "fp4lab.studies"}
    assert not re.search(r"\._\w", code(notebook))


def execute(notebook, folder: Path, tmp_path: Path, monkeypatch) -> list:
    """Run every cell with FP4LAB_RESULTS set to `folder`; the outputs of the code cells."""
    monkeypatch.setenv("FP4LAB_RESULTS", str(folder))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    notebook = copy.deepcopy(notebook)
    resources = {"metadata": {"path": str(tmp_path)}}
    nbclient.NotebookClient(
        notebook, kernel_name="python3", timeout=180, resources=resources
    ).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, errors[0]
    return outputs


def images(outputs) -> int:
    return sum("image/png" in o.get("data", {}) for o in outputs)


def test_opens_p_operand_with_trace_heatmaps(notebook, p_operand_smoke, tmp_path, monkeypatch):
    outputs = execute(notebook, p_operand_smoke, tmp_path, monkeypatch)
    figures = len(list((p_operand_smoke / "figures").glob("*.png")))
    assert images(outputs) == figures + 1 + 3  # report's figures, the curve, three heatmaps
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "study p-operand" in text and "p=fp8_e4m3fn,S=1,forward" in text


def test_opens_quantizer_error(notebook, quantizer_error_smoke, tmp_path, monkeypatch):
    outputs = execute(notebook, quantizer_error_smoke, tmp_path, monkeypatch)
    figures = len(list((quantizer_error_smoke / "figures").glob("*.png")))
    assert images(outputs) == figures + 1
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "stores no per-tile trace" in text
    markdown = "".join(o.get("data", {}).get("text/markdown", "") for o in outputs)
    assert "Anchors (Quartet II)" in markdown


def test_opens_attention_gradients(notebook, attention_gradients_smoke, tmp_path, monkeypatch):
    """A curve from another table than metrics (the averaging curves)."""
    outputs = execute(notebook, attention_gradients_smoke, tmp_path, monkeypatch)
    figures = len(list((attention_gradients_smoke / "figures").glob("*.png")))
    assert images(outputs) == figures + 1


def test_opens_mxfp4_pv_mechanisms_with_trace_heatmaps(notebook, mxfp4_pv_mechanisms_smoke,
                                                       tmp_path, monkeypatch):
    """The ranking in the report, the contributions as a curve, the routes' trace heatmaps."""
    outputs = execute(notebook, mxfp4_pv_mechanisms_smoke, tmp_path, monkeypatch)
    figures = len(list((mxfp4_pv_mechanisms_smoke / "figures").glob("*.png")))
    assert images(outputs) == figures + 1 + 3
    markdown = "".join(o.get("data", {}).get("text/markdown", "") for o in outputs)
    assert "| rank | mechanism |" in markdown
