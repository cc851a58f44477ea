"""The two weight-holding modules every layer uses: ``Linear`` and ``Embedding``. Parameters are created
empty (no random init: the checkpoint fills them) and never need gradients; their names are the
checkpoint's names, so the loader can check every tensor."""
from __future__ import annotations

import torch
from torch import nn

from dsv2_lib.core.dtypes import empty_param
from dsv2_lib.ops.embedding import embedding
from dsv2_lib.ops.gemv import GEMV_MAX_TOKENS, SKINNY_MAX_TOKENS, linear


class Linear(nn.Module):
    """``y = x @ weight.T`` with ``weight [out, in]`` (HF layout, no bias: DeepSeek-V2 has none): on a GPU a
    GEMV kernel for up to ``gemv_max_tokens`` tokens, the skinny GEMM for up to ``skinny_max_tokens``
    (:func:`~dsv2_lib.ops.gemv.linear`), else ``F.linear``."""

    def __init__(self, in_features: int, out_features: int, gemv_max_tokens: int = GEMV_MAX_TOKENS,
                 skinny_max_tokens: int = SKINNY_MAX_TOKENS):
        super().__init__()
        self.weight = empty_param(out_features, in_features)
        self.gemv_max_tokens, self.skinny_max_tokens = gemv_max_tokens, skinny_max_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.gemv_max_tokens, self.skinny_max_tokens)


class Embedding(nn.Module):
    """Token embedding table ``weight [vocab, H]``; ``ids [T] -> [T, H]``."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.weight = empty_param(vocab, hidden)

    def forward(self, ids: torch.Tensor, check: bool = True) -> torch.Tensor:
        """Rows of the table for ``ids``; ``check=False`` skips the range check's host sync (CUDA graphs)."""
        return embedding(ids, self.weight, check=check)
