"""DeepSeekMoE reference: routing rules and the sorted-by-expert computation, against direct per-token math.

transformers ignores ``norm_topk_prob`` (it always multiplies by ``routed_scaling_factor``), so the
renormalising branch is checked here against DeepSeek's rule written out token by token.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dsv2_lib.config import TINY
from dsv2_lib.moe import MoE, route
from dsv2_lib.weights import default_dtype


def direct_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """One token at a time: softmax, (group-limited) top-k, DeepSeek's weight rule, experts, shared experts."""
    cfg, out = moe.cfg, []
    for t in range(x.shape[0]):
        probs = F.softmax(moe.gate.weight @ x[t], dim=-1)
        allowed = torch.ones_like(probs, dtype=torch.bool)
        if cfg.topk_method == "group_limited_greedy":
            per_group = probs.view(cfg.n_group, -1)
            best = sorted(range(cfg.n_group), key=lambda g: -per_group[g].max().item())[: cfg.topk_group]
            allowed = torch.zeros(cfg.n_group, per_group.shape[1], dtype=torch.bool)
            allowed[best] = True
            allowed = allowed.flatten()
        chosen = sorted(torch.nonzero(allowed).flatten().tolist(), key=lambda e: -probs[e].item())[: cfg.num_experts_per_tok]
        w = probs[chosen]
        w = w / w.sum() if cfg.norm_topk_prob and len(chosen) > 1 else w * cfg.routed_scaling_factor
        y = moe.shared_experts(x[t : t + 1])[0]
        for e, we in zip(chosen, w):
            g, u = moe.experts.gate_up_proj[e].chunk(2)  # [2I, H]: gate rows, then up rows
            d = moe.experts.down_proj[e]
            y = y + we * (d @ (F.silu(g @ x[t]) * (u @ x[t])))
        out.append(y)
    return torch.stack(out)


def random_moe(cfg, seed=0):
    torch.manual_seed(seed)
    with default_dtype(torch.float64):
        moe = MoE(cfg)
    for p in moe.parameters():
        p.copy_(torch.randn_like(p) * 0.3)
    moe.gate.weight.data = moe.gate.weight.double()  # fp64 test: router in fp64 too
    return moe


CASES = {
    "greedy": TINY,
    "norm_topk_prob": dataclasses.replace(TINY, norm_topk_prob=True, num_experts_per_tok=3),
    "scaled": dataclasses.replace(TINY, routed_scaling_factor=16.0),
    "group_limited": dataclasses.replace(TINY, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                         num_experts_per_tok=3, routed_scaling_factor=2.0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_layer_equals_direct_computation(name):
    moe = random_moe(CASES[name])
    x = torch.randn(37, TINY.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(moe(x), direct_moe(moe, x), atol=1e-10, rtol=1e-10)


def test_norm_topk_prob_weights_sum_to_one_and_ignore_scaling():
    cfg = dataclasses.replace(TINY, norm_topk_prob=True, num_experts_per_tok=3, routed_scaling_factor=7.0)
    w, ids = route(torch.randn(50, cfg.n_routed_experts), cfg)
    torch.testing.assert_close(w.sum(-1), torch.ones(50))
    assert ids.shape == (50, 3) and (ids.sort(-1).values.diff(dim=-1) > 0).all()  # distinct experts


def test_top1_never_renormalised():
    """DeepSeek's rule renormalises only when k > 1: with k = 1 the weight is prob × scaling factor."""
    cfg = dataclasses.replace(TINY, norm_topk_prob=True, num_experts_per_tok=1, routed_scaling_factor=3.0)
    logits = torch.randn(20, cfg.n_routed_experts)
    w, ids = route(logits, cfg)
    torch.testing.assert_close(w[:, 0], logits.softmax(-1).amax(-1) * 3.0)


def test_group_limited_routing_stays_inside_best_groups():
    cfg = CASES["group_limited"]
    logits = torch.randn(200, cfg.n_routed_experts)
    _, ids = route(logits, cfg)
    group_best = logits.softmax(-1).view(200, cfg.n_group, -1).amax(-1)
    top_groups = group_best.topk(cfg.topk_group, dim=-1).indices
    group_of = ids // (cfg.n_routed_experts // cfg.n_group)
    assert (group_of[..., None] == top_groups[:, None, :]).any(-1).all()
