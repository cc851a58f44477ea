"""MoE kernels (kernels_cu/moe.cu) against the PyTorch reference on the GPU (``pytest -m gpu``).

Tolerances.
* Router: the kernel's softmax differs from PyTorch's only in the order of the fp32 sum over the E
  exponentials (a few fp32 ulps), so the ids are equal (random logits have no near-ties within
  1e-6, and exact ties follow the same rule in both) and the weights agree to 1e-6 relative.
* Alignment: integers, exactly equal.
* Experts: kernel and reference round at the same points (gate|up output, SwiGLU output, down
  output, the fp32 weighted sum, the shared add), and differ only in the order of the fp32 sums
  inside the GEMMs (cuBLAS vs ours). Such a difference can flip the rounding of an intermediate by
  one ulp of its dtype; after the down projection and the weighted sum that is at most a couple of
  output ulps of the output's scale. So |kernel - reference| <= 4 * ulp * max|reference| per row
  (ulp = 2^-8 for bf16, 2^-11 for fp16; fp32: 2e-5 relative to the row's scale covers K = 2048
  fp32 products summed in another order).
"""
import dataclasses

import pytest
import torch

from dsv2_lib.core import kernels
from dsv2_lib.core.config import TINY
from dsv2_lib.core.dtypes import default_dtype
from dsv2_lib.model import moe
from dsv2_lib.model.moe import MoE
from dsv2_lib.ops import moe_experts as experts_op
from dsv2_lib.ops import moe_routing
from dsv2_lib.ops.activation import silu_and_mul_reference
from dsv2_lib.ops.moe_experts import MoETuning, moe_experts, routed_experts
from dsv2_lib.ops.moe_routing import moe_align, moe_align_reference, route, topk_softmax

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_on")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REL = {torch.float32: 2e-5, torch.float16: 4 * 2**-11, torch.bfloat16: 4 * 2**-8}
LITE = dict(e=64, k=6, h=2048, i=1408)
SMALL = dict(e=16, k=2, h=256, i=96)
DEFAULT = MoETuning()
EVERYTHING = 10**9
FORCE = {  # tunings under which every token count takes the path
    "gemv": MoETuning(gemv_max_tokens=EVERYTHING, skinny_max_tokens=0, grouped_mm_min_tokens=EVERYTHING),
    "skinny": MoETuning(gemv_max_tokens=0, skinny_max_tokens=EVERYTHING, grouped_mm_min_tokens=EVERYTHING),
    "mma": MoETuning(gemv_max_tokens=0, skinny_max_tokens=0, grouped_mm_min_tokens=EVERYTHING),
    "grouped_mm": MoETuning(gemv_max_tokens=0, skinny_max_tokens=0, grouped_mm_min_tokens=1),
}


def close(got, want, dtype):
    scale = want.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-3)
    return bool(((got.float() - want.float()).abs() <= REL[dtype] * scale).all())


def experts(e, h, i, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = (torch.randn(e, 2 * i, h, device="cuda", generator=g) * h**-0.5).to(dtype)
    down = (torch.randn(e, h, i, device="cuda", generator=g) * i**-0.5).to(dtype)
    return gate_up, down


def random_choice(t, k, e, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(t, e, device="cuda", generator=g).argsort(-1)[:, :k].contiguous()
    w = torch.rand(t, k, device="cuda", generator=g)
    return w, ids


# ---- router ---------------------------------------------------------------------------------------
ROUTER_CASES = {
    "lite": dataclasses.replace(TINY, n_routed_experts=64, num_experts_per_tok=6),
    "renorm": dataclasses.replace(TINY, norm_topk_prob=True, num_experts_per_tok=3),
    "top1": dataclasses.replace(TINY, norm_topk_prob=True, num_experts_per_tok=1, routed_scaling_factor=3.0),
    "group_limited": dataclasses.replace(TINY, n_routed_experts=160, num_experts_per_tok=6, topk_method="group_limited_greedy",
                                         n_group=8, topk_group=3, routed_scaling_factor=16.0),
    "odd": dataclasses.replace(TINY, n_routed_experts=37, num_experts_per_tok=5),
}


@pytest.mark.parametrize("name", sorted(ROUTER_CASES))
@pytest.mark.parametrize("t", [1, 3, 17, 300])
def test_topk_softmax_matches_route(name, t):
    cfg = ROUTER_CASES[name]
    logits = torch.randn(t, cfg.n_routed_experts, device="cuda") * 2
    w, ids = topk_softmax(logits, cfg)
    rw, rids = route(logits, cfg)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(ROUTER_CASES))
def test_topk_softmax_ties_lowest_id_first(name):
    """Integer logits in a small range: many exact ties; the kernel follows the reference's rule."""
    cfg = ROUTER_CASES[name]
    logits = torch.randint(0, 3, (64, cfg.n_routed_experts), device="cuda").float()
    logits[0] = 0  # all equal: experts 0..k-1
    w, ids = topk_softmax(logits, cfg)
    rw, rids = route(logits, cfg)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)


def test_topk_softmax_refuses_bad_input():
    cfg = ROUTER_CASES["lite"]
    with pytest.raises(ValueError, match=r"topk_softmax logits: shape \[4, 63\], expected \[\*, 64\]"):
        topk_softmax(torch.randn(4, 63, device="cuda"), cfg)
    with pytest.raises(ValueError, match=r"E <= 256"):
        topk_softmax(torch.randn(4, 300, device="cuda"), dataclasses.replace(cfg, n_routed_experts=300))


# ---- alignment ------------------------------------------------------------------------------------
@pytest.mark.parametrize("t,k,e,block", [(1, 6, 64, 64), (3, 6, 64, 64), (17, 6, 64, 64), (300, 6, 64, 64),
                                         (4096, 6, 64, 64), (4096, 6, 64, 8), (5000, 6, 64, 16), (100, 2, 16, 1),
                                         (33, 6, 160, 64), (3000, 8, 256, 16), (342, 6, 64, 8)])
def test_moe_align_matches_reference(t, k, e, block):
    """One block (up to ALIGN_CHOICES choices) and several (from 342 x 6 = 2052: two blocks)."""
    _, ids = random_choice(t, k, e, seed=t)
    for a, b in zip(moe_align(ids, e, block), moe_align_reference(ids, e, block)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("t", [500, 5000])  # one block, three
def test_moe_align_one_expert_takes_everything_and_drops_bad_ids(t):
    ids = torch.zeros(t, 1, dtype=torch.int64, device="cuda")
    for a, b in zip(moe_align(ids, 64, 64), moe_align_reference(ids, 64, 64)):
        assert torch.equal(a, b)
    ids[7, 0] = 64  # out of range: dropped, never written anywhere
    ids[t - 9, 0] = -3
    sorted_rows, slot_of, tile_expert, offsets = moe_align(ids, 64, 64)
    assert slot_of[7] == -1 and slot_of[t - 9] == -1 and int((sorted_rows >= 0).sum()) == t - 2
    assert offsets[-1] == -(-(t - 2) // 64) * 64 and torch.equal(sorted_rows[: t - 2].cpu(), torch.tensor(
        [i for i in range(t) if i not in (7, t - 9)], dtype=torch.int32))


# ---- experts --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 3, 17, pytest.param(300, marks=pytest.mark.heavy)])
@pytest.mark.parametrize("shape", ["small", pytest.param("lite", marks=pytest.mark.large_reference)])
def test_moe_experts_matches_reference(t, dtype, shape):
    s = SMALL if shape == "small" else LITE
    if dtype == torch.float32 and t > DEFAULT.fp32_gemv_max_tokens:
        pytest.skip("fp32 beyond fp32_gemv_max_tokens takes the reference itself")
    gate_up, down = experts(s["e"], s["h"], s["i"], dtype)
    x = torch.randn(t, s["h"], device="cuda").to(dtype)
    w, ids = random_choice(t, s["k"], s["e"], seed=t)
    shared = torch.randn(t, s["h"], device="cuda").to(dtype)
    want = routed_experts(x, w, ids, gate_up, down) + shared
    assert close(moe_experts(x, w, ids, gate_up, down, shared), want, dtype)
    assert close(moe_experts(x, w, ids, gate_up, down), routed_experts(x, w, ids, gate_up, down), dtype)


@pytest.mark.large_reference
@pytest.mark.parametrize("path", sorted(FORCE))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_path_matches_reference(path, dtype):
    """Force each regime at the same sizes (a tuning that sends every size there), including experts with no tokens."""
    if path == "grouped_mm" and (dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm")):
        pytest.skip("torch._grouped_mm: bf16 only")
    gate_up, down = experts(64, 2048, 1408, dtype)
    for t in (5, 40):
        x = torch.randn(t, 2048, device="cuda").to(dtype)
        w, ids = random_choice(t, 6, 64, seed=t)
        ids[:, :] = torch.arange(6, device="cuda") * 3  # only 6 of 64 experts get tokens
        got = moe_experts(x, w, ids, gate_up, down, tuning=FORCE[path])
        assert close(got, routed_experts(x, w, ids, gate_up, down), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path,t", [("mma", 300), ("skinny", 100)])
def test_one_expert_takes_all_tokens(path, t, dtype):
    # 300 rows of one expert in 64-row tiles; 100 in 7 tiles of 16, the last partly padding
    gate_up, down = experts(16, 256, 128, dtype)
    x = torch.randn(t, 256, device="cuda").to(dtype)
    ids = torch.full((t, 1), 11, dtype=torch.int64, device="cuda")
    w = torch.rand(t, 1, device="cuda")
    got = moe_experts(x, w, ids, gate_up, down, tuning=FORCE[path])
    assert close(got, routed_experts(x, w, ids, gate_up, down), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_skinny_tile_height_changes_no_bit(dtype):
    """Every compiled tile height (8, 16, 32 rows) sums a token's products in the same order: the same
    bits for every choice, and the reference's values. 40 tokens x 6 of 16 experts give each expert about
    15 choices: tiles of 8 split every expert, tiles of 16 and 32 carry padding."""
    gate_up, down = experts(16, 256, 128, dtype, seed=3)
    x = torch.randn(40, 256, device="cuda").to(dtype)
    w, ids = random_choice(40, 6, 16, seed=3)
    got = {}
    for rows in moe_routing.SKINNY_ROWS_COMPILED:
        y, slot_of = experts_op.skinny_experts(x, ids, gate_up, down, rows=rows)
        got[rows] = y[slot_of.long()]  # choice order
    first = got[moe_routing.SKINNY_ROWS_COMPILED[0]]
    assert all(torch.equal(first, y) for y in got.values())
    combined = experts_op.combine(first, w, None, None)
    assert close(combined, routed_experts(x, w, ids, gate_up, down), dtype)


def few_layer(name, shared, dtype):
    cfg = dataclasses.replace(ROUTER_CASES[name], hidden_size=256, moe_intermediate_size=96, n_shared_experts=shared)
    torch.manual_seed(0)
    with default_dtype(dtype):
        layer = MoE(cfg).cuda()
    for p in layer.parameters():
        p.data.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    return cfg, layer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,shared", [("lite", 2), ("lite", 1), ("lite", 0), ("group_limited", 2), ("renorm", 1)])
def test_few_token_layer_matches_the_router_kernel_and_the_mlp(name, shared, dtype, monkeypatch):
    """At a few tokens MoE.forward runs moe_few: the router in one launch, with the shared experts'
    gate|up beside it, the shared experts as P more GEMV choices. Against topk_softmax on cuBLAS's
    logits + moe_experts with the shared MLP's output: the same picks (the logits differ in the order of
    their fp32 sums only; random data has no near-ties), the routed part the same kernels in the same
    order, the shared part summed in fp32 and rounded once as the MLP does, in another order: ``close``,
    and the same bits on every call, with the arrival counters back at zero."""
    cfg, layer = few_layer(name, shared, dtype)
    calls = []
    monkeypatch.setattr(moe, "moe_few", lambda *a, f=moe.moe_few: calls.append(1) or f(*a))
    sizes = (1, 3, DEFAULT.gemv_max_tokens) + ((33,) if dtype == torch.float32 else ())
    for t in sizes:
        x = torch.randn(t, 256, device="cuda").to(dtype)
        got = layer(x)
        w, ids = topk_softmax(torch.nn.functional.linear(x.float(), layer.gate.weight), cfg)
        mlp = None if layer.shared_experts is None else layer.shared_experts(x)
        want = moe_experts(x, w, ids, layer.experts.gate_up_proj, layer.experts.down_proj, mlp)
        assert close(got, want, dtype), t
        assert torch.equal(layer(x), got), t
        assert not moe_routing._COUNTERS[0].any()
    assert len(calls) == 2 * len(sizes)  # two layer calls per size


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["lite", "group_limited", "odd"])
def test_route_few_gives_topk_softmax_picks_and_the_shared_rows(name, dtype):
    """moe_route_few's logits are x W_r^T in fp32 (within 1e-5 of the row's scale of fp64: H products
    summed in another order), its picks are topk_softmax's on those very logits, bit for bit, and the
    rows after the T·k routed ones are the shared MLP's SwiGLU output, part p = its columns [p·I, (p+1)·I)."""
    cfg, layer = few_layer(name, 2, dtype)
    sh, i, k = layer.shared_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    for t in (1, 2, DEFAULT.gemv_max_tokens):
        x = torch.randn(t, 256, device="cuda").to(dtype)
        weights, ids, logits, hid = moe_routing.route_few(x, layer.gate.weight, cfg, sh.gate_up_proj.weight)
        exact = x.double() @ layer.gate.weight.double().T
        assert ((logits.double() - exact).abs() <= 1e-5 * exact.abs().amax(-1, keepdim=True)).all(), t
        w2, ids2 = topk_softmax(logits, cfg)
        assert torch.equal(ids, ids2) and torch.equal(weights, w2), t
        hidden = silu_and_mul_reference(torch.nn.functional.linear(x, sh.gate_up_proj.weight))  # [t, 2I]: part 0 | part 1
        assert close(hid[t * k:], hidden.reshape(2 * t, i), dtype), t
        assert not moe_routing._COUNTERS[0].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["lite", "group_limited"])
def test_router_few_is_route_few_without_the_shared_experts(name, dtype):
    """Tens of tokens, the router alone: the picks and weights route_few gives (the same launch without the
    shared blocks), and topk_softmax's ids on cuBLAS's fp32 logits (random data: no near-ties); at 5, 33
    and 128 tokens, past the arrival counters of a few-token step, which it leaves at zero."""
    cfg, layer = few_layer(name, 2, dtype)
    for t in (5, 33, 128):
        x = torch.randn(t, 256, device="cuda").to(dtype)
        assert moe_routing.router_few_applies(x, layer.gate.weight, cfg), t
        weights, ids = moe_routing.router_few(x, layer.gate.weight, cfg)
        w2, ids2, _, _ = moe_routing.route_few(x, layer.gate.weight, cfg)
        assert torch.equal(ids, ids2) and torch.equal(weights, w2), t
        w3, ids3 = topk_softmax(torch.nn.functional.linear(x.float(), layer.gate.weight), cfg)
        assert torch.equal(ids, ids3) and torch.allclose(weights, w3, rtol=1e-5, atol=1e-7), t
        assert not moe_routing._COUNTERS[0].any()


def test_the_layer_routes_in_one_launch_up_to_its_threshold(monkeypatch):
    """MoE.forward past the few-token path: the router is router_few up to router_few_max_tokens tokens,
    the fp32 GEMM and topk_softmax beyond; the two give the same picks here, so outputs agree to the
    rounding of their weights (``close``)."""
    cfg, layer = few_layer("lite", 2, torch.bfloat16)
    used = []
    for name in ("router_few", "topk_softmax"):
        real = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, real=real, name=name: (used.append(name), real(*a))[1])
    layer.tuning = MoETuning(router_few_max_tokens=8)
    x = torch.randn(8, 256, device="cuda").to(torch.bfloat16)
    one = layer(x)
    assert used == ["router_few"]
    used.clear()
    layer.tuning = MoETuning(router_few_max_tokens=7)
    two = layer(x)
    assert used == ["topk_softmax"]
    assert close(one, two, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_combine_is_deterministic(dtype):
    """The per-choice GEMV's down launch also combines: one block per (token, column slab) computes all
    of its token's choices and sums them in pick order, so every run gives the same bits. 33 tokens: more
    than one block row; H = 264: a width that is not a power of two."""
    gemv = FORCE["gemv"]
    for h in (256, 264):
        gate_up, down = experts(16, h, 96, dtype)
        for t in (1, 4, 33):
            x = torch.randn(t, h, device="cuda").to(dtype)
            w, ids = random_choice(t, 3, 16, seed=t)
            ids[0, 1] = 99  # a dropped choice
            shared = torch.randn(t, h, device="cuda").to(dtype)
            first = moe_experts(x, w, ids, gate_up, down, shared, tuning=gemv)
            keep = ids.clone().masked_fill_(ids >= 16, 0)
            want = routed_experts(x, w.masked_fill(ids >= 16, 0.0), keep, gate_up, down) + shared
            assert close(first, want, dtype), (h, t)
            for _ in range(5):
                assert torch.equal(moe_experts(x, w, ids, gate_up, down, shared, tuning=gemv), first)


@pytest.mark.cuda_graph
def test_router_counters_are_not_grown_inside_a_capture(monkeypatch):
    cfg, layer = few_layer("lite", 2, torch.bfloat16)
    x = torch.randn(2, 256, device="cuda").to(torch.bfloat16)
    args = (x, layer.gate.weight, cfg, layer.shared_experts.gate_up_proj.weight)
    moe_routing.route_few(*args)  # compiles the kernel; the counters exist now
    monkeypatch.setattr(moe_routing, "_COUNTERS", {})
    with pytest.raises(RuntimeError, match="run the step once eagerly"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            moe_routing.route_few(*args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h,i", [(256, 128), (128, 64), (512, 192)])
@pytest.mark.parametrize("t", [1, 7, 17, 64])
def test_skinny_gemm_matches_reference(t, h, i, dtype, monkeypatch):
    """The skinny grouped GEMM at sizes around its tile (8 rows), one or more 64-column slabs, K a
    multiple of 64, with shared experts; other h, i fall back (the next test)."""
    gate_up, down = experts(16, h, i, dtype, seed=t)
    x = torch.randn(t, h, device="cuda").to(dtype)
    w, ids = random_choice(t, 3, 16, seed=t)
    shared = torch.randn(t, h, device="cuda").to(dtype)
    calls = []
    monkeypatch.setattr(experts_op, "skinny_experts", lambda *a, f=experts_op.skinny_experts: calls.append(1) or f(*a))
    got = moe_experts(x, w, ids, gate_up, down, shared, tuning=FORCE["skinny"])
    assert close(got, routed_experts(x, w, ids, gate_up, down) + shared, dtype)
    assert calls == [1]


def test_skinny_gemm_needs_multiples_of_64(monkeypatch):
    calls = []
    monkeypatch.setattr(experts_op, "skinny_experts", lambda *a: calls.append(1))
    gate_up, down = experts(16, 256, 96, torch.bfloat16)  # I = 96: a multiple of 32, not of 64
    x = torch.randn(9, 256, device="cuda").to(torch.bfloat16)
    w, ids = random_choice(9, 2, 16)
    got = moe_experts(x, w, ids, gate_up, down, tuning=FORCE["skinny"])
    assert close(got, routed_experts(x, w, ids, gate_up, down), torch.bfloat16)
    assert calls == []


@pytest.mark.large_reference
def test_combine_is_deterministic():
    gate_up, down = experts(64, 2048, 1408, torch.bfloat16)
    x = torch.randn(512, 2048, device="cuda").to(torch.bfloat16)
    w, ids = random_choice(512, 6, 64)
    first = moe_experts(x, w, ids, gate_up, down)
    for _ in range(3):
        assert torch.equal(moe_experts(x, w, ids, gate_up, down), first)


def test_moe_experts_refuses_bad_input():
    gate_up, down = experts(16, 256, 96, torch.bfloat16)
    x = torch.randn(4, 256, device="cuda").to(torch.bfloat16)
    w, ids = random_choice(4, 2, 16)
    with pytest.raises(ValueError, match=r"moe_experts x: shape \[4, 128\], expected \[\*, 256\]"):
        moe_experts(x[:, :128].contiguous(), w, ids, gate_up, down)
    with pytest.raises(TypeError, match=r"moe_experts ids: dtype torch.int32, expected torch.int64"):
        moe_experts(x, w, ids.int(), gate_up, down)
    with pytest.raises(ValueError, match=r"moe_experts weights: shape \[4, 3\], expected \[4, 2\]"):
        moe_experts(x, torch.rand(4, 3, device="cuda"), ids, gate_up, down)
    with pytest.raises(ValueError, match=r"moe_experts down_proj: shape \[16, 256, 95\], expected \[16, 256, 96\]"):
        moe_experts(x, w, ids, gate_up, down[..., :95].contiguous())
    with pytest.raises(TypeError, match=r"moe_experts gate_up_proj: dtype torch.float16"):
        moe_experts(x, w, ids, gate_up.half(), down)
    with pytest.raises(ValueError, match=r"moe_experts ids: shape \[3, 2\], expected \[4, \*\]"):
        moe_experts(x, w, ids[:3].contiguous(), gate_up, down)
    with pytest.raises(ValueError, match=r"moe_align ids: not contiguous"):
        moe_align(ids.t(), 16, 64)


def test_bad_ids_are_dropped_not_read():
    """Ids outside [0, E) cannot be refused without a host sync: every path skips them (no OOB read)."""
    gate_up, down = experts(16, 256, 128, torch.bfloat16)  # I = 128: every path takes it, skinny included
    for path in ("gemv", "skinny", "mma"):
        x = torch.randn(8, 256, device="cuda").to(torch.bfloat16)
        w, ids = random_choice(8, 2, 16)
        bad = ids.clone()
        bad[:, 1] = 1000
        want = routed_experts(x, w[:, :1].contiguous(), ids[:, :1].contiguous(), gate_up, down)
        assert close(moe_experts(x, w, bad, gate_up, down, tuning=FORCE[path]), want, torch.bfloat16)


# ---- the layer ------------------------------------------------------------------------------------
@pytest.mark.large_reference
def test_few_token_layer_is_deterministic():
    cfg = dataclasses.replace(TINY, n_routed_experts=64, num_experts_per_tok=6, hidden_size=2048, moe_intermediate_size=1408)
    torch.manual_seed(0)
    with default_dtype(torch.bfloat16):
        layer = MoE(cfg).cuda()
    for p in layer.parameters():
        p.data.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    x = torch.randn(4, 2048, device="cuda").to(torch.bfloat16)
    first = layer(x)
    for _ in range(3):
        assert torch.equal(layer(x), first)


@pytest.mark.large_reference
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_layer_kernels_match_reference(dtype, monkeypatch):
    cfg = dataclasses.replace(TINY, n_routed_experts=64, num_experts_per_tok=6, hidden_size=512, moe_intermediate_size=128)
    torch.manual_seed(0)
    with default_dtype(dtype):
        layer = MoE(cfg).cuda()
    for p in layer.parameters():
        p.data.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    for t in (1, 3, 17, 300):
        x = torch.randn(t, 512, device="cuda").to(dtype)
        got = layer(x)
        monkeypatch.setenv("DSV2_BACKEND", "torch")
        want = layer(x)
        monkeypatch.setenv("DSV2_BACKEND", "cuda")
        assert close(got, want, dtype)


@pytest.mark.cuda_graph
def test_decode_moe_layer_in_a_cuda_graph():
    """Every path of the layer (router, GEMV, combine, shared MLP) has no host sync: capture, replay on new x."""
    cfg = dataclasses.replace(TINY, n_routed_experts=64, num_experts_per_tok=6, hidden_size=2048, moe_intermediate_size=1408)
    with default_dtype(torch.bfloat16):
        layer = MoE(cfg).cuda()
    for p in layer.parameters():
        p.data.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    for t in (1, 32, 100, 200):  # the GEMV path, the skinny and the grouped GEMMs (moe_align on the GPU)
        x = torch.randn(t, 2048, device="cuda").to(torch.bfloat16)
        layer(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            assert close(out, layer(x), torch.bfloat16)


@pytest.mark.parametrize("graph", [False, pytest.param(True, marks=pytest.mark.cuda_graph)])
def test_shared_experts_on_a_side_stream_give_the_same_bits(graph, monkeypatch):
    """Beyond the GEMV path (whose launches run the shared experts as choices) and up to
    tuning.shared_stream_max_tokens tokens the shared MLP runs on a side stream: same bits as on one stream,
    and the combine waits for it. The side stream is held up ~5 ms before the shared MLP, so a
    combine that did not wait would add a buffer not yet written."""
    cfg = dataclasses.replace(TINY, n_routed_experts=16, num_experts_per_tok=2, hidden_size=256, moe_intermediate_size=96)
    torch.manual_seed(0)
    with default_dtype(torch.bfloat16):
        layer = MoE(cfg).cuda()
    for p in layer.parameters():
        p.data.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    streams, real = [], layer.shared_experts.forward

    def slow_shared(x):
        streams.append(torch.cuda.current_stream())
        torch.cuda._sleep(10**7)
        return real(x)

    for t in (DEFAULT.gemv_max_tokens + 1, 16):
        x = torch.randn(t, 256, device="cuda").to(torch.bfloat16)
        layer.tuning = MoETuning(shared_stream_max_tokens=0)
        want = layer(x)
        layer.tuning = MoETuning(shared_stream_max_tokens=16)
        monkeypatch.setattr(layer.shared_experts, "forward", slow_shared)
        got = layer(x)
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                got = layer(x)
            got.zero_()
            g.replay()
        torch.cuda.synchronize()
        monkeypatch.setattr(layer.shared_experts, "forward", real)
        assert streams[-1] != torch.cuda.current_stream()
        assert torch.equal(got, want)


def test_auto_backend_uses_the_kernels(monkeypatch):
    monkeypatch.setenv("DSV2_BACKEND", "auto")
    assert kernels.use_kernels(torch.empty(1, device="cuda"))
    calls = []
    real = experts_op.gemv_down_combine  # 2 tokens: the GEMV path, whose down launch also combines
    monkeypatch.setattr(experts_op, "gemv_down_combine", lambda *a: calls.append(1) or real(*a))
    gate_up, down = experts(16, 256, 96, torch.bfloat16)
    x = torch.randn(2, 256, device="cuda").to(torch.bfloat16)
    w, ids = random_choice(2, 2, 16)
    moe_experts(x, w, ids, gate_up, down)
    assert calls == [1]
