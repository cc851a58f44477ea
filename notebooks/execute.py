"""Execute chapters in place, in order, so their committed outputs come from a real run.

    python notebooks/execute.py notebooks/00_inference_explained.ipynb [...]

Run it on the GPU machine for the committed outputs (``gpu`` cells then run too). Stops at the
first cell that raises, leaving that notebook unchanged.
"""
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def execute(path: Path, timeout: int = 900) -> float:
    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, path)
    return time.perf_counter() - t0


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"{arg}: executed in {execute(Path(arg)):.1f} s", flush=True)
