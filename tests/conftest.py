"""Shared pytest configuration: tests marked ``gpu`` skip themselves where CUDA is absent, and the
skipped tests are summed up in one line at the end of the run. The GPU gate (``gate/``) and the
benchmarks (``benchmarks/``) are scripts, not packages; their tests import them from there."""
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "gate"), str(ROOT / "benchmarks")]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False); run with -m gpu on the GPU machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """One line for the skipped tests instead of one per reason: on a CPU nearly all of them (the
    kernel tests, the notebooks' ``gpu`` cells) need a CUDA GPU, which is expected, not a failure;
    any other reason is named."""
    reasons = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reasons["gpu" if "CUDA GPU" in reason else reason.removeprefix("Skipped: ")] += 1
    if not reasons:
        return
    parts = [f"{reasons.pop('gpu')} need a CUDA GPU (expected on a CPU; `pytest -m gpu` runs them on a GPU)"] \
        if "gpu" in reasons else []
    parts += [f"{n} {reason}" for reason, n in sorted(reasons.items())]
    terminalreporter.write_line(f"skipped: {'; '.join(parts)}")


@pytest.fixture
def kernels_on(monkeypatch):
    """``DSV2_BACKEND=cuda`` for the test: every op must take its CUDA kernel, and an op that cannot
    (no CuPy, a CPU tensor) fails instead of quietly testing the PyTorch reference. The kernel test
    files use it for every test (``pytest.mark.usefixtures("kernels_on")``)."""
    monkeypatch.setenv("DSV2_BACKEND", "cuda")


@pytest.fixture
def kernel_launches(monkeypatch):
    """The kernel functions launched while the test runs, in order: both launch paths are spied on
    (ordinary, or dependent on a Hopper GPU), and each launch still happens."""
    from dsv2_lib.core import kernels

    calls = []
    for name in ("launch", "launch_dependent"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda k, *a, real=real, **kw: (calls.append(k), real(k, *a, **kw)))
    return calls
