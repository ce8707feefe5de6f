"""notebooks/train_tpu.ipynb runs top to bottom (nbclient, the ``python3`` kernel of this interpreter) on the
CPU with ``SIZE = "tiny"``: install check, devices, ``--compile-only`` batch choice, training, loss plot,
generation. The kernel inherits this process's environment (CPU platform, 8 fake devices)."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT

NOTEBOOK = ROOT / "notebooks" / "train_tpu.ipynb"


def test_the_first_code_cell_holds_only_the_size_choice():
    import nbformat

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    first = next(cell for cell in notebook.cells if cell.cell_type == "code")
    lines = [line for line in first.source.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert len(lines) == 1 and lines[0].startswith('SIZE = "tiny"')
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")  # committed clean


@pytest.mark.slow
def test_the_notebook_runs_top_to_bottom_on_the_cpu(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = {i: "".join(o.get("text", "") for o in cell.get("outputs", [])) for i, cell in enumerate(notebook.cells)}
    text = "\n".join(outputs.values())
    assert "batch size: 16" in text  # the largest candidate fits on the CPU
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for cell in notebook.cells for o in cell.get("outputs", []))  # the loss plot
    records = [json.loads(line) for line in (tmp_path / "runs/notebook_tiny/metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps[-1] == 30 and records[-1]["loss"] < records[0]["loss"]
    assert outputs[len(notebook.cells) - 1].startswith("The ")  # the generated text
