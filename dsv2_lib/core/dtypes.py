"""Parameters and precisions shared by every layer: empty frozen parameters (the checkpoint fills
them), building a model directly in its storage dtype, and the fp32 accumulation precision."""
from __future__ import annotations

import contextlib

import torch
from torch import nn


def empty_param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    """An uninitialised, frozen parameter; created on the default device (set by ``torch.device(...)``)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Create parameters directly in ``dtype`` (a full-size model must not pass through fp32)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the accumulation precision: fp32 for 16-bit inputs, unchanged for fp32/fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
