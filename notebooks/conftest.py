"""nbval configuration for the chapters.

* Cells tagged ``gpu`` (kernel launches, benchmarks) are skipped, not executed, when no CUDA GPU
  is present. (They also start with the ``%%gpu`` magic of ``gpu_cells.py``, which skips them in
  JupyterLab the same way.) nbval makes one pytest item per code cell (``nbval.plugin.IPyNbCell``); a skip
  marker added here is honoured by pytest before the cell is sent to the kernel. A ``gpu`` cell
  never defines a name that a later cell needs, so skipping it is safe.
* Only ``text/plain`` (plus streams) is compared in checked cells, not ``text/html``: the HTML of
  a :func:`dsv2_lib.tools.show.show_source` listing is Pygments' rendering of the same text and varies
  with the Pygments version, while the plain text is the source itself.
"""
import pytest
import torch

GPU_TAG = "gpu"


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    try:
        from nbval.plugin import IPyNbCell
    except ImportError:  # nbval not installed: no notebook items to adjust
        return
    cuda = _has_cuda()
    skip_gpu = pytest.mark.skip(reason="cell tagged 'gpu' and no CUDA GPU is available")
    for item in items:
        if not isinstance(item, IPyNbCell):
            continue
        if "text/html" not in item.parent.skip_compare:
            item.parent.skip_compare = (*item.parent.skip_compare, "text/html")
        if not cuda and GPU_TAG in item.cell.metadata.get("tags", []):
            item.add_marker(skip_gpu)
