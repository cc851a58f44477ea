"""DeepSeekMoE: an fp32 softmax router picks ``k`` of ``E`` routed experts per token; two shared
experts see every token.

The layer holds the weights and picks the ops (``ops/moe_routing.py``: router and alignment;
``ops/moe_experts.py``: the experts' kernels, the combine, and the :class:`MoETuning` thresholds that
choose among them): ``moe_few`` for a few tokens, else the router (one launch up to
``tuning.router_few_max_tokens`` tokens, beyond it the fp32 GEMM and ``topk_softmax``) and
``moe_experts``, the shared MLP on a side stream up to ``tuning.shared_stream_max_tokens`` tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv2_lib.core import kernels, streams
from dsv2_lib.core.config import ModelConfig
from dsv2_lib.core.dtypes import empty_param, upcast
from dsv2_lib.model.mlp import MLP
from dsv2_lib.ops.gemv import GEMV_MAX_TOKENS, SKINNY_MAX_TOKENS
from dsv2_lib.ops.moe_experts import MoETuning, few_applies, moe_experts, moe_few
from dsv2_lib.ops.moe_routing import router_few, router_few_applies, topk_softmax


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
    """A DeepSeekMoE layer: routed experts (top-k of E) plus always-on shared experts. ``tuning``: the
    token counts at which it changes kernels (the H200's by default); ``gemv_max_tokens``,
    ``skinny_max_tokens``: the shared experts' projections' kernel thresholds (:class:`~dsv2_lib.model.layers.Linear`)."""

    def __init__(self, cfg: ModelConfig, tuning: MoETuning = MoETuning(), gemv_max_tokens: int = GEMV_MAX_TOKENS,
                 skinny_max_tokens: int = SKINNY_MAX_TOKENS):
        super().__init__()
        self.cfg, self.tuning = cfg, tuning
        self.gate = Router(cfg.n_routed_experts, cfg.hidden_size)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, gemv_max_tokens,
                                   skinny_max_tokens)
                               if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H] -> [T, H]``: router, routed experts, shared experts (kernels for CUDA tensors)."""
        sh = self.shared_experts
        shared_w = None if sh is None else (sh.gate_up_proj.weight, sh.down_proj.weight)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        if few_applies(x, self.cfg, self.gate.weight, gate_up, down, shared_w, self.tuning):
            return moe_few(x, self.gate.weight, self.cfg, gate_up, down, shared_w)
        one_launch = x.shape[0] <= self.tuning.router_few_max_tokens and router_few_applies(x, self.gate.weight,
                                                                                             self.cfg)
        if one_launch:
            weights, ids = router_few(x, self.gate.weight, self.cfg)
        else:
            logits = F.linear(upcast(x), self.gate.weight)
        shared, shared_ready = None, None
        if sh is not None:
            # Tens of tokens: the shared experts do not depend on the routing, so they run on the side
            # stream while the router and the routed experts run on this one; the combine waits for them.
            side = kernels.use_kernels(x) and x.shape[0] <= self.tuning.shared_stream_max_tokens
            with streams.fork(x.device, side) as shared_ready:
                shared = sh(x)
        if not one_launch:
            weights, ids = topk_softmax(logits, self.cfg)
        return moe_experts(x, weights, ids, gate_up, down, shared, shared_ready, self.tuning)
