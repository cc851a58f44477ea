"""The dense feed-forward block, SwiGLU: ``down(silu(gate(x)) * up(x))``, with gate and up fused
into one GEMM.

``gate_up_proj.weight [2I, H]`` stacks the gate rows (``0..I-1``) over the up rows (``I..2I-1``),
so one GEMM gives ``[T, 2I] = [gate | up]`` and :func:`silu_and_mul` turns that into ``[T, I]``.
The checkpoint keeps ``gate_proj`` and ``up_proj`` separate; the loader fills the two halves.
The CUDA kernel is ``kernels_cu/activation.cu``.
"""
from __future__ import annotations

import torch
from torch import nn

from dsv2_lib.model.layers import Linear
from dsv2_lib.ops.activation import silu_and_mul
from dsv2_lib.ops.gemv import GEMV_MAX_TOKENS, SKINNY_MAX_TOKENS


class MLP(nn.Module):
    """SwiGLU MLP ``hidden -> intermediate -> hidden``: layer 0 of V2-Lite (10944) and the shared experts.

    ``gate_up_proj.weight [2I, H]`` (gate rows, then up rows), ``down_proj.weight [H, I]``;
    ``gemv_max_tokens``, ``skinny_max_tokens``: the projections' kernel thresholds
    (:class:`~dsv2_lib.model.layers.Linear`).
    """

    def __init__(self, hidden: int, intermediate: int, gemv_max_tokens: int = GEMV_MAX_TOKENS,
                 skinny_max_tokens: int = SKINNY_MAX_TOKENS):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, gemv_max_tokens, skinny_max_tokens)
        self.down_proj = Linear(intermediate, hidden, gemv_max_tokens, skinny_max_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden] -> [T, hidden]``: one GEMM to ``[T, 2I]``, the activation to ``[T, I]``, one GEMM back."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
