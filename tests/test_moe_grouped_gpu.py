"""Chapter 08's grouped expert GEMV (kernels_cu/lessons/moe_grouped.cu, dsv2_lib/lessons/moe_grouped.py)
against the PyTorch reference on the GPU (``pytest -m gpu``); tolerances as in test_moe_gpu.py."""
import dataclasses

import pytest
import torch
from test_moe_gpu import (
    DTYPES,
    LITE,
    ROUTER_CASES,
    SMALL,
    close,
    experts,
    random_choice,
)

from dsv2_lib.core.config import TINY
from dsv2_lib.core.dtypes import default_dtype
from dsv2_lib.lessons.moe_grouped import (
    _decode_applies,
    gemv_items_reference,
    grouped_experts,
    moe_decode,
    moe_gemv_items,
)
from dsv2_lib.model.moe import MoE
from dsv2_lib.ops.moe_experts import routed_experts
from dsv2_lib.ops.moe_routing import topk_softmax

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_on")]


@pytest.mark.parametrize("t,k,e", [(1, 6, 64), (3, 6, 64), (32, 6, 64), (64, 6, 64), (17, 6, 160), (40, 2, 16)])
def test_moe_gemv_items_match_reference(t, k, e):
    _, ids = random_choice(t, k, e, seed=t)
    ids[: t // 2, 0] = 1  # a busy expert: several items
    if t > 2:
        ids[2, -1] = -4  # dropped
        ids[0, -1] = e
    srt, items, n_items, max_items = moe_gemv_items(ids, e)
    want_srt, want_items = gemv_items_reference(ids, e)
    n = int(n_items)
    assert n == want_items.shape[0] <= max_items
    assert torch.equal(srt[: want_srt.numel()], want_srt)
    assert torch.equal(items[: 3 * n].view(-1, 3), want_items)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 9, 33])
def test_grouped_experts_match_reference(t, dtype):
    gate_up, down = experts(SMALL["e"], SMALL["h"], SMALL["i"], dtype)
    x = torch.randn(t, SMALL["h"], device="cuda").to(dtype)
    w, ids = random_choice(t, SMALL["k"], SMALL["e"], seed=t)
    ids[: t // 2, 0] = 0  # an expert with more than GEMV_TB tokens
    shared = torch.randn(t, SMALL["h"], device="cuda").to(dtype)
    want = routed_experts(x, w, ids, gate_up, down)
    assert close(grouped_experts(x, w, ids, gate_up, down, shared), want + shared, dtype)
    assert close(grouped_experts(x, w, ids, gate_up, down), want, dtype)


@pytest.mark.large_reference
@pytest.mark.parametrize("warps,cols", [(8, 1), (4, 1), (8, 2), (4, 4), (3, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_gemv_variants_match_reference(warps, cols, dtype):
    for s in (LITE, SMALL):
        gate_up, down = experts(s["e"], s["h"], s["i"], dtype)
        for t in (1, 9, 33):
            x = torch.randn(t, s["h"], device="cuda").to(dtype)
            w, ids = random_choice(t, s["k"], s["e"], seed=t)
            ids[: t // 2, 0] = 0  # an expert with more than GEMV_TB tokens
            shared = torch.randn(t, s["h"], device="cuda").to(dtype)
            want = routed_experts(x, w, ids, gate_up, down) + shared
            assert close(grouped_experts(x, w, ids, gate_up, down, shared, warps=warps, cols_per_warp=cols), want, dtype)


def test_bad_ids_are_dropped_not_read():
    gate_up, down = experts(16, 256, 128, torch.bfloat16)
    x = torch.randn(8, 256, device="cuda").to(torch.bfloat16)
    w, ids = random_choice(8, 2, 16)
    bad = ids.clone()
    bad[:, 1] = 1000
    want = routed_experts(x, w[:, :1].contiguous(), ids[:, :1].contiguous(), gate_up, down)
    assert close(grouped_experts(x, w, bad, gate_up, down), want, torch.bfloat16)


def lite_layer(dtype, h=2048, i=1408, **kw):
    cfg = dataclasses.replace(TINY, n_routed_experts=64, num_experts_per_tok=6, hidden_size=h, moe_intermediate_size=i, **kw)
    torch.manual_seed(0)
    with default_dtype(dtype):
        layer = MoE(cfg).cuda()
    for p in layer.parameters():
        p.data.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    return layer


def decode(layer, x, **kw):
    """moe_decode on the layer's weights (router GEMM by cuBLAS, then the four launches)."""
    sh = layer.shared_experts
    shared_w = None if sh is None else (sh.gate_up_proj.weight, sh.down_proj.weight)
    logits = torch.nn.functional.linear(x.float(), layer.gate.weight)
    return moe_decode(x, logits, layer.cfg, layer.experts.gate_up_proj, layer.experts.down_proj, shared_w, **kw)


@pytest.mark.parametrize("size", [pytest.param("lite", marks=pytest.mark.large_reference), "small"])
@pytest.mark.parametrize("in_router", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_decode_matches_unfused_layer(size, in_router, dtype):
    """moe_decode (router + items + shared experts inside the GEMV launches) == router, experts, shared MLP
    computed separately (the reference experts); the routing itself is bit-identical to topk_softmax."""
    layer = lite_layer(dtype) if size == "lite" else lite_layer(dtype, h=512, i=96, n_shared_experts=3)
    sh = layer.shared_experts
    for t in (1, 5, 32, 64):
        x = torch.randn(t, layer.cfg.hidden_size, device="cuda").to(dtype)
        assert _decode_applies(x, layer.cfg, (sh.gate_up_proj.weight, sh.down_proj.weight))
        got = decode(layer, x, shared_in_router=in_router)
        w, ids = topk_softmax(torch.nn.functional.linear(x.float(), layer.gate.weight), layer.cfg)
        want = routed_experts(x, w, ids, layer.experts.gate_up_proj, layer.experts.down_proj) + sh(x)
        assert close(got, want, dtype)


def test_moe_decode_group_limited_and_no_shared_experts(monkeypatch):
    cfg = dataclasses.replace(ROUTER_CASES["group_limited"], hidden_size=256, moe_intermediate_size=64, n_shared_experts=0)
    torch.manual_seed(0)
    with default_dtype(torch.bfloat16):
        layer = MoE(cfg).cuda()
    for p in layer.parameters():
        p.data.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    for t in (1, 4):
        x = torch.randn(t, 256, device="cuda").to(torch.bfloat16)
        assert _decode_applies(x, cfg)
        got = decode(layer, x)
        monkeypatch.setenv("DSV2_BACKEND", "torch")
        want = layer(x)
        monkeypatch.setenv("DSV2_BACKEND", "cuda")
        assert close(got, want, torch.bfloat16)


@pytest.mark.large_reference
def test_moe_decode_is_deterministic():
    layer = lite_layer(torch.bfloat16)
    x = torch.randn(4, 2048, device="cuda").to(torch.bfloat16)
    first = decode(layer, x)
    for _ in range(3):
        assert torch.equal(decode(layer, x), first)


@pytest.mark.cuda_graph
def test_moe_decode_in_a_cuda_graph():
    """The grouped path has no host sync: capture, replay on new x."""
    layer = lite_layer(torch.bfloat16)
    for t in (1, 32):
        x = torch.randn(t, 2048, device="cuda").to(torch.bfloat16)
        decode(layer, x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode(layer, x)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            assert close(out, decode(layer, x), torch.bfloat16)
