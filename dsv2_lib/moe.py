"""DeepSeekMoE: an fp32 softmax router picks ``k`` of ``E`` routed experts per token; two shared
experts see every token. This is the reference (sort by expert, one matmul pair per expert)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .mlp import MLP, silu_and_mul
from .weights import empty_param, upcast


def route(logits: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: fp32 gate logits ``[T, E]`` -> (weights ``[T, k]`` fp32, expert ids ``[T, k]`` int64).

    Softmax over all experts, then top-k: ``greedy`` over all experts, or ``group_limited_greedy``
    (keep the ``topk_group`` groups with the best single expert, pick top-k inside them). Then, as
    DeepSeek's own modelling code does it: renormalise the k weights when ``norm_topk_prob`` and
    k > 1, otherwise multiply them by ``routed_scaling_factor``.
    """
    scores = upcast(logits).softmax(dim=-1)
    k = cfg.num_experts_per_tok
    if cfg.topk_method == "group_limited_greedy":
        t, e = scores.shape
        groups = scores.view(t, cfg.n_group, e // cfg.n_group)
        best_groups = groups.amax(dim=-1).topk(cfg.topk_group, dim=-1).indices
        keep = torch.zeros(t, cfg.n_group, dtype=torch.bool, device=scores.device)
        keep.scatter_(1, best_groups, True)
        scores = (groups * keep[..., None]).view(t, e)
    weights, ids = scores.topk(k, dim=-1)
    if k > 1 and cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """``Σ_j weights[t, j] · expert_{ids[t, j]}(x[t])`` for ``x [T, H]``; experts stacked as
    ``gate_up_proj [E, 2I, H]`` (each expert's gate rows, then its up rows) and ``down_proj [E, H, I]``.
    Accumulates in fp32 (or wider).

    Reference algorithm: flatten the T·k (token, expert) choices, sort them by expert so each
    expert's tokens are contiguous, run each expert once on its rows, scatter-add back.
    """
    t, k = ids.shape
    flat_ids = ids.flatten()
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up_proj.shape[0]).tolist()
    token_of = order // k
    out = torch.zeros(t, x.shape[1], dtype=upcast(x).dtype, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = order[start : start + n]
        tokens = token_of[start : start + n]
        h = silu_and_mul(F.linear(x[tokens], gate_up_proj[expert]))  # [n, 2I] -> [n, I]
        y = upcast(F.linear(h, down_proj[expert])) * weights.flatten()[rows, None]
        out.index_add_(0, tokens, y)
        start += n
    return out.to(x.dtype)


class Experts(nn.Module):
    """The routed experts' weights, stacked: ``gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and
    ``down_proj [E, H, I]`` (transformers 5 stores them the same way)."""

    def __init__(self, n: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = empty_param(n, 2 * intermediate, hidden)
        self.down_proj = empty_param(n, hidden, intermediate)


class Router(nn.Module):
    """The gate ``weight [E, H]``, kept in fp32 whatever the model dtype (routing is precision-sensitive)."""

    def __init__(self, n: int, hidden: int):
        super().__init__()
        self.weight = empty_param(n, hidden, dtype=torch.float32)


class MoE(nn.Module):
    """A DeepSeekMoE layer: routed experts (top-k of E) plus always-on shared experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg.n_routed_experts, cfg.hidden_size)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H] -> [T, H]``."""
        weights, ids = route(F.linear(upcast(x), self.gate.weight), self.cfg)
        e = self.experts
        out = routed_experts(x, weights, ids, e.gate_up_proj, e.down_proj)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
