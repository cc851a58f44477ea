"""Weight holders. Parameters are created empty (no random init: the checkpoint fills them) and
never need gradients; their names are the checkpoint's names, so the loader can check every tensor."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .embedding import embedding
from .gemv import linear


def empty_param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    """An uninitialised, frozen parameter; created on the default device (set by ``torch.device(...)``)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """``y = x @ weight.T`` with ``weight [out, in]`` (HF layout, no bias: DeepSeek-V2 has none): a GEMV
    kernel for one or two tokens on a GPU (:func:`~dsv2_lib.gemv.linear`), else ``F.linear``."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = empty_param(out_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class Embedding(nn.Module):
    """Token embedding table ``weight [vocab, H]``; ``ids [T] -> [T, H]``."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.weight = empty_param(vocab, hidden)

    def forward(self, ids: torch.Tensor, check: bool = True) -> torch.Tensor:
        """Rows of the table for ``ids``; ``check=False`` skips the range check's host sync (CUDA graphs)."""
        return embedding(ids, self.weight, check=check)


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
