"""Shared pytest configuration: tests marked ``gpu`` skip themselves where CUDA is absent."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False); run with -m gpu on the GPU machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def kernels_on(monkeypatch):
    """``DSV2_BACKEND=cuda`` for the test: every op must take its CUDA kernel, and an op that cannot
    (no CuPy, a CPU tensor) fails instead of quietly testing the PyTorch reference. The kernel test
    files use it for every test (``pytest.mark.usefixtures("kernels_on")``)."""
    monkeypatch.setenv("DSV2_BACKEND", "cuda")
