"""The committed notebooks are what a full GPU run produced: every cell executed in order, no error,
no warning on stderr, and a provenance cell that names a GPU. (Outputs come from
``python notebooks/execute.py notebooks/NN_*.ipynb`` on the GPU machine.)"""
import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def code_cells(path):
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_cell_executed_in_order(path):
    counts = [c["execution_count"] for c in code_cells(path)]
    assert counts == list(range(1, len(counts) + 1)), f"{path.name}: execution counts {counts}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_cell_has_its_own_id(path):
    """nbformat 4.5 cells carry ids (a missing one is a warning today, an error in later nbformat); a cell
    inserted by a script must get one."""
    cells = json.loads(path.read_text())["cells"]
    missing = [i for i, c in enumerate(cells) if not c.get("id")]
    ids = [c.get("id") for c in cells]
    assert not missing, f"{path.name}: cells {missing} have no id"
    assert len(set(ids)) == len(ids), f"{path.name}: repeated cell ids"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_cell_sources_are_in_canonical_form(path):
    """A source is a list of lines as Jupyter writes it: no trailing empty entry (a script that split on
    newlines left one), which Jupyter would drop on the next save and make a spurious diff."""
    cells = json.loads(path.read_text())["cells"]
    bad = [i for i, c in enumerate(cells) if isinstance(c["source"], list) and c["source"] and c["source"][-1] == ""]
    assert not bad, f"{path.name}: cells {bad} end their source with an empty line entry"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_error_or_warning_outputs(path):
    for cell in code_cells(path):
        for out in cell.get("outputs", []):
            assert out["output_type"] != "error", f"{path.name} cell {cell['execution_count']}: {out.get('ename')}"
            if out["output_type"] == "stream" and out["name"] == "stderr":
                assert "Warning" not in "".join(out["text"]), f"{path.name} cell {cell['execution_count']}: {''.join(out['text'])}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_provenance_is_a_gpu(path):
    first = code_cells(path)[0]
    text = "".join("".join(o.get("text", "")) for o in first.get("outputs", []) if o["output_type"] == "stream")
    gpu = [line for line in text.splitlines() if line.startswith("GPU:")]
    assert gpu and "none" not in gpu[0], f"{path.name}: committed outputs must come from a GPU run, got {gpu}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_kernel_exercises_were_graded_on_a_gpu(path):
    """A kernel exercise's committed verdict ran the kernel: "needs a CUDA GPU" is what grade_kernel
    prints on a machine without one, which the rendered book must not show."""
    for cell in code_cells(path):
        for out in cell.get("outputs", []):
            text = "".join(out.get("text", "")) if out["output_type"] == "stream" else ""
            assert "needs a CUDA GPU" not in text, f"{path.name} cell {cell['execution_count']}: {text.strip()}"
