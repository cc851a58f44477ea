"""The chapters run in JupyterLab on a machine without a GPU: ``%%gpu`` cells (notebooks/gpu_cells.py)
skip themselves with one clear line, and "Run All" ends without an error cell.

Executed with nbclient and a real IPython kernel, as JupyterLab executes a notebook, every cell
included (unlike nbval, which skips the cells tagged ``gpu`` before they reach the kernel)."""
import json
from pathlib import Path

import pytest
import torch

nbformat = pytest.importorskip("nbformat")  # the book's tools: absent on a machine set up for the engine only
NotebookClient = pytest.importorskip("nbclient").NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
SKIPPED = "needs a CUDA GPU: skipped"


def run(cells: list[str], allow_errors: bool = False) -> nbformat.NotebookNode:
    """Execute code cells in a fresh kernel started in notebooks/ (as JupyterLab starts it)."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=allow_errors,
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def text(cell) -> str:
    """A cell's printed text and the plain text of its results."""
    return "".join(o.get("text", "") if o.output_type == "stream" else o.get("data", {}).get("text/plain", "")
                   for o in cell.outputs)


def test_without_a_gpu_the_cell_prints_one_line_and_runs_nothing():
    nb = run(["import gpu_cells\ngpu_cells.register()\ngpu_cells.cuda_available = lambda: False",
              "%%gpu\nran = True\nprint('the body ran')",
              "print('ran' in globals())"])
    assert text(nb.cells[1]).startswith(SKIPPED) and "the body ran" not in text(nb.cells[1])
    assert text(nb.cells[2]) == "False\n"


def test_with_a_gpu_the_cell_runs_as_if_the_magic_were_not_there():
    nb = run(["import gpu_cells\ngpu_cells.register()\ngpu_cells.cuda_available = lambda: True",
              "%%gpu\nx = 41\nprint('printed')\nx + 1",
              "%%gpu\nraise ValueError('the cell failed')",
              "print(x)"], allow_errors=True)
    assert "printed" in text(nb.cells[1]) and "42" in text(nb.cells[1])
    errors = [o for o in nb.cells[2].outputs if o.output_type == "error"]
    assert errors and errors[-1].ename == "ValueError", "an exception in a %%gpu cell must fail the cell"
    assert text(nb.cells[3]) == "41\n"


def test_the_magic_takes_no_arguments():
    nb = run(["import gpu_cells\ngpu_cells.register()", "%%gpu fast\nprint(1)"], allow_errors=True)
    errors = [o for o in nb.cells[1].outputs if o.output_type == "error"]
    assert errors and "takes no arguments" in errors[-1].evalue


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_gpu_cells_are_tagged_and_marked_alike(path):
    """The tag (nbval's skip) and the magic (JupyterLab's skip) go together, and the setup cell
    registers the magic before any cell uses it."""
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    for c in cells:
        tagged = "gpu" in c["metadata"].get("tags", [])
        marked = "".join(c["source"]).split("\n", 1)[0].strip() == "%%gpu"
        assert tagged == marked, f"{path.name}: a cell tagged gpu={tagged} but %%gpu={marked}: {''.join(c['source'])[:80]!r}"
    if any("gpu" in c["metadata"].get("tags", []) for c in cells):
        assert "gpu_cells.register()" in "".join(cells[0]["source"]), f"{path.name}: the setup cell must register %%gpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the gpu cells run; this checks the CPU path")
def test_run_all_of_a_chapter_on_a_cpu_has_no_error_cell():
    """'Run All' of chapter 02 (three gpu cells) in a kernel, as JupyterLab would run it on a laptop."""
    path = NOTEBOOKS / "02_tokens_embedding.ipynb"
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    gpu = [c for c in code if "gpu" in c.metadata.get("tags", [])]
    assert gpu and all(text(c).startswith(SKIPPED) for c in gpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the summary of a CPU run")
def test_a_cpu_run_sums_up_its_gpu_skips_in_one_line():
    """The ~90 kernel-test files' skips on a CPU end the run as one line, not one line per reason
    that would look like failures."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/test_rope_gpu.py",
                        "tests/test_rmsnorm_gpu.py"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:]
    lines = r.stdout.splitlines()
    assert not [line for line in lines if line.startswith("SKIPPED")]
    summary = [line for line in lines if line.startswith("skipped: ")]
    assert len(summary) == 1 and "need a CUDA GPU" in summary[0], r.stdout[-2000:]
