"""RMSNorm: ``y = x / sqrt(mean(x²) + eps) * weight``, reduced in fp32.

The normalised value is rounded to the input dtype *before* the weight multiplies it, exactly as
transformers' ``DeepseekV2RMSNorm`` does, so bf16 results match the oracle bit for bit on the CPU.
"""
from __future__ import annotations

import torch
from torch import nn

from .weights import empty_param, upcast


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dimension of ``x [..., d]`` and scale by ``weight [d]``."""
    xf = upcast(x)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    """An RMSNorm layer: the learned scale ``weight [dim]`` and its epsilon."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = empty_param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
