"""The ``%%gpu`` cell magic of the chapters: a cell that needs a CUDA GPU skips itself without one.

Each chapter's setup cell calls :func:`register`. A cell that launches kernels or measures on the GPU
starts with ``%%gpu`` (and carries the cell tag ``gpu``, by which nbval skips it in CI). With a CUDA
GPU the magic runs the cell as if the line were not there; without one it prints
:data:`SKIPPED` instead, so "Run All" in JupyterLab works on a laptop. A ``gpu`` cell never defines
a name that a later cell needs, so skipping it is safe.
"""
from __future__ import annotations

SKIPPED = "needs a CUDA GPU: skipped (the output shown in the book is from a GPU run)"


def cuda_available() -> bool:
    """Whether the cells marked ``%%gpu`` can run here (a CUDA GPU that PyTorch sees)."""
    import torch

    return torch.cuda.is_available()


def gpu(line: str, cell: str) -> None:
    """The magic: run ``cell`` in the notebook's namespace when :func:`cuda_available`, else print
    :data:`SKIPPED`. An exception in the cell is raised again, so the cell fails as it would without
    the magic."""
    from IPython import get_ipython

    if line.strip():
        raise ValueError(f"%%gpu takes no arguments, got {line.strip()!r}")
    if not cuda_available():
        print(SKIPPED)
        return
    get_ipython().run_cell(cell).raise_error()


def register() -> None:
    """Register ``%%gpu`` in the running IPython kernel; nothing outside IPython (a plain ``python``
    that executes a setup cell has no magics and no ``%%gpu`` cells)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None:
        shell.register_magic_function(gpu, magic_kind="cell", magic_name="gpu")
