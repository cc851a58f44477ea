"""The dense feed-forward block: SwiGLU, ``down(silu(gate(x)) * up(x))``."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .weights import Linear


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: ``silu(gate) * up`` elementwise."""
    return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU MLP ``hidden -> intermediate -> hidden``: layer 0 of V2-Lite (10944) and the shared experts."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden] -> [T, hidden]``."""
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))
