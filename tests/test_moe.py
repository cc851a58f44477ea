"""DeepSeekMoE reference: routing rules and the sorted-by-expert computation, against direct per-token math.

transformers ignores ``norm_topk_prob`` (it always multiplies by ``routed_scaling_factor``), so the
renormalising branch is checked here against DeepSeek's rule written out token by token.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dsv2_lib.core.config import TINY
from dsv2_lib.core.dtypes import default_dtype
from dsv2_lib.model.moe import MoE
from dsv2_lib.ops.moe_experts import MoETuning, choose_path, moe_experts, routed_experts, skinny_experts
from dsv2_lib.ops.moe_routing import ALIGN_CHOICES, moe_align, moe_align_reference, route, topk_softmax


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


# ---- ties, alignment, and CPU emulations of the kernels' index mappings (kernels_cu/moe.cu) -------


def test_ties_pick_the_lowest_expert_id_first():
    """Equal scores: the lowest expert id wins, in the greedy top-k and in the choice of groups."""
    cfg = dataclasses.replace(TINY, num_experts_per_tok=3)  # 16 experts
    logits = torch.zeros(2, 16)
    logits[0, [3, 7, 9, 12]] = 1.0  # four equal best experts: 3, 7, 9 picked, in that order
    w, ids = route(logits, cfg)
    assert ids[0].tolist() == [3, 7, 9] and ids[1].tolist() == [0, 1, 2]
    assert torch.equal(w[0], w[0][:1].expand(3))
    g = dataclasses.replace(cfg, topk_method="group_limited_greedy", n_group=4, topk_group=2)
    logits = torch.zeros(1, 16)
    logits[0, [5, 9, 13]] = 2.0  # groups 1, 2, 3 tie for best: groups 1 and 2 kept
    logits[0, 1] = 1.0           # group 0 second best only
    _, ids = route(logits, g)
    assert ids[0].tolist() == [5, 9, 4]  # then the lowest id among the kept groups' equal rest


def emulate_topk_softmax(logits: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """The router kernel's algorithm in Python: repeated (score desc, id asc) argmax, taken -> -1."""
    p = logits.double().softmax(-1)
    k, ws, ids = cfg.num_experts_per_tok, [], []
    for row in p:
        row = row.clone()
        if cfg.topk_method == "group_limited_greedy":
            gbest = row.view(cfg.n_group, -1).amax(-1).tolist()
            keep = set()
            for _ in range(cfg.topk_group):
                gsel = min((g for g in range(cfg.n_group) if g not in keep), key=lambda g: (-gbest[g], g))
                keep.add(gsel)
            gsize = row.numel() // cfg.n_group
            for e in range(row.numel()):
                if e // gsize not in keep:
                    row[e] = 0.0
        picks = []
        for _ in range(k):
            e = min(range(row.numel()), key=lambda e: (-row[e].item(), e))
            picks.append((row[e].item(), e))
            row[e] = -1.0
        w = torch.tensor([v for v, _ in picks], dtype=torch.float64)
        w = w / (w.sum() + 1e-20) if (k > 1 and cfg.norm_topk_prob) else w * cfg.routed_scaling_factor
        ws.append(w)
        ids.append([e for _, e in picks])
    return torch.stack(ws), torch.tensor(ids)


@pytest.mark.parametrize("name", sorted(CASES))
def test_router_kernel_algorithm_matches_route(name):
    cfg = CASES[name]
    logits = torch.randn(40, cfg.n_routed_experts, dtype=torch.float64)
    logits[:5] = logits[:5].round()  # plenty of exact ties
    w, ids = route(logits, cfg)
    ew, eids = emulate_topk_softmax(logits, cfg)
    assert torch.equal(ids, eids)
    torch.testing.assert_close(w, ew)


@pytest.mark.parametrize("t,k,e,block", [(1, 6, 64, 64), (3, 2, 16, 8), (17, 6, 64, 64), (300, 6, 64, 64),
                                         (50, 3, 16, 1), (8, 4, 5, 16)])
def test_moe_align_reference_layout(t, k, e, block):
    torch.manual_seed(t)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    sorted_rows, slot_of, tile_expert, offsets = moe_align_reference(ids, e, block)
    n, max_tiles = t * k, (t * k + e * (block - 1)) // block
    assert sorted_rows.shape == (max_tiles * block,) and tile_expert.shape == (max_tiles,) and offsets.shape == (e + 1,)
    counts = torch.bincount(ids.flatten(), minlength=e)
    assert torch.equal(offsets.diff().long(), (counts + block - 1) // block * block) and offsets[0] == 0
    flat = ids.flatten()
    for x in range(e):  # each segment: the expert's choices in increasing choice (= token) order, then -1s
        seg = sorted_rows[offsets[x] : offsets[x + 1]].long()
        real = seg[: counts[x]]
        assert torch.equal(real, torch.nonzero(flat == x).flatten()) and (seg[counts[x] :] == -1).all()
        assert (tile_expert[offsets[x] // block : offsets[x + 1] // block] == x).all()
    assert (sorted_rows[offsets[-1] :] == -1).all() and (tile_expert[offsets[-1] // block :] == -1).all()
    assert torch.equal(sorted_rows[slot_of.long()].long(), torch.arange(n))


def emulate_moe_align(ids: torch.Tensor, e: int, block: int, choices_per_block: int = ALIGN_CHOICES, nwarps: int = 32):
    """moe_align's passes, block by block, warp by warp, lane by lane (match_any = same expert among the 32)."""
    flat = ids.flatten().tolist()
    n = len(flat)
    max_tiles = (n + e * (block - 1)) // block
    sorted_rows, slot_of, tile_expert = [-1] * (max_tiles * block), [None] * n, [-1] * max_tiles
    G = max(1, -(-n // choices_per_block))
    C = -(-n // G)
    L = -(-C // nwarps)
    ranges = [[(min(n, g * C + w * L), min(n, g * C + C, g * C + w * L + L)) for w in range(nwarps)] for g in range(G)]
    cnt = [[[0] * e for _ in range(nwarps)] for _ in range(G)]  # pass 1, and moe_align_count's counts
    for g in range(G):
        for w, (lo, hi) in enumerate(ranges[g]):
            for i in range(lo, hi):
                cnt[g][w][flat[i]] += 1
    counts = [[sum(cnt[g][w][x] for w in range(nwarps)) for x in range(e)] for g in range(G)]
    tot = [sum(counts[g][x] for g in range(G)) for x in range(e)]
    seg, acc = [], 0
    for x in range(e):
        seg.append(acc)
        acc += -(-tot[x] // block) * block
    seg.append(acc)
    for x in range(e):
        for tt in range(seg[x] // block, seg[x + 1] // block):
            tile_expert[tt] = x
    for g in range(G):
        before = [sum(counts[h][x] for h in range(g)) for x in range(e)]
        for x in range(e):  # pass 2: exclusive over warps
            c = 0
            for w in range(nwarps):
                cnt[g][w][x], c = c, c + cnt[g][w][x]
        for w, (lo, hi) in enumerate(ranges[g]):
            for base in range(lo, hi, 32):
                lanes = [(base + l, flat[base + l]) for l in range(32) if base + l < hi]
                for lane, (i, x) in enumerate(lanes):
                    rank = sum(1 for j, (_, y) in enumerate(lanes) if j < lane and y == x)
                    pos = seg[x] + before[x] + cnt[g][w][x] + rank
                    sorted_rows[pos], slot_of[i] = i, pos
                for x in {x for _, x in lanes}:
                    cnt[g][w][x] += sum(1 for _, y in lanes if y == x)
    return [torch.tensor(v, dtype=torch.int32) for v in (sorted_rows, slot_of, tile_expert, seg)]


@pytest.mark.parametrize("t,k,e,block,per_block", [(1, 6, 64, 64, ALIGN_CHOICES), (17, 6, 64, 64, ALIGN_CHOICES),
                                                   (300, 6, 64, 64, ALIGN_CHOICES), (200, 2, 16, 8, ALIGN_CHOICES),
                                                   (5, 2, 4, 1, ALIGN_CHOICES), (400, 6, 64, 8, ALIGN_CHOICES),
                                                   (300, 6, 64, 16, 100), (97, 3, 8, 4, 7)])
def test_moe_align_kernel_algorithm_matches_reference(t, k, e, block, per_block):
    """The kernels' algorithm, one block or several (per_block: choices per block, small to get many)."""
    torch.manual_seed(1)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    ids[: t // 3, 0] = 0  # one busy expert
    ids[: t // 3, 1:] = torch.arange(1, k)
    for a, b in zip(emulate_moe_align(ids, e, block, per_block), moe_align_reference(ids, e, block)):
        assert torch.equal(a, b)


def test_moe_align_refuses_bad_ids_on_cpu():
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 4\)"):
        moe_align_reference(torch.tensor([[0, 4]]), 4, 8)
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 4\)"):
        moe_align(torch.tensor([[-1, 2]]), 4, 8)


def emulate_mma_block(a_tile: torch.Tensor, w: torch.Tensor, n0: int, gate_up: bool, n_out: int) -> torch.Tensor:
    """One block of moe_gemm, index by index: B-tile rows from the weight-row mapping, the warps' 2 x 8
    mma tiles, each lane's C fragment (rows g / g+8, columns 2q / 2q+1), and the epilogue's (row, column)
    formula. Returns the block's output
    [64, 64] (gate_up: silu(gate) * up) or [64, 128] (down), as fp64 without the rounding."""
    K = a_tile.shape[1]
    b_tile = torch.zeros(128, K, dtype=torch.float64)
    for r in range(128):
        if gate_up:
            col = n0 + (r >> 6) * 32 + (r & 31)
            wrow = n_out + col if (r >> 5) & 1 else col
        else:
            col = wrow = n0 + r
        if col < n_out:
            b_tile[r] = w[wrow]
    acc = torch.zeros(2, 2, 2, 8, 32, 4, dtype=torch.float64)  # [wm, wn, mi, nj, lane, c]
    for wm in range(2):
        for wn in range(2):
            for mi in range(2):
                for nj in range(8):
                    for kk in range(0, K, 16):
                        A = a_tile[wm * 32 + mi * 16 : wm * 32 + mi * 16 + 16, kk : kk + 16]
                        B = b_tile[wn * 64 + nj * 8 : wn * 64 + nj * 8 + 8, kk : kk + 16].T  # [k, n]
                        D = A @ B  # what mma computes (its fragments: test_mma_fragment_layouts_...)
                        for lane in range(32):
                            g, q = lane >> 2, lane & 3
                            for c in range(4):
                                acc[wm, wn, mi, nj, lane, c] += D[g + 8 * (c >> 1), 2 * q + (c & 1)]
    out = torch.full((64, 64 if gate_up else 128), float("nan"), dtype=torch.float64)
    for wm in range(2):
        for wn in range(2):
            for mi in range(2):
                for lane in range(32):
                    g, q = lane >> 2, lane & 3
                    for c in range(4):
                        row = wm * 32 + mi * 16 + g + 8 * (c >> 1)
                        if gate_up:
                            for nj in range(4):
                                col = wn * 32 + nj * 8 + 2 * q + (c & 1)
                                gt, up = acc[wm, wn, mi, nj, lane, c], acc[wm, wn, mi, nj + 4, lane, c]
                                out[row, col] = F.silu(gt) * up
                        else:
                            for nj in range(8):
                                out[row, wn * 64 + nj * 8 + 2 * q + (c & 1)] = acc[wm, wn, mi, nj, lane, c]
    return out


def test_mma_fragment_layouts_rebuild_the_product():
    """The A/B fragment registers each lane loads (moe.cu) cover a 16x16 and a 16x8 tile exactly once, and
    the lanes of a quad (same g) hold whole rows of A and whole columns of B: the PTX layouts, checked by counting."""
    A = torch.randn(16, 16, dtype=torch.float64)
    B = torch.randn(16, 8, dtype=torch.float64)
    seen_a, seen_b = torch.zeros(16, 16), torch.zeros(16, 8)
    D = torch.zeros(16, 8, dtype=torch.float64)
    frag_a, frag_b = {}, {}
    for lane in range(32):
        g, q = lane >> 2, lane & 3
        frag_a[lane] = [(g, 2 * q), (g + 8, 2 * q), (g, 2 * q + 8), (g + 8, 2 * q + 8)]  # (row, first k) per register
        frag_b[lane] = [(2 * q, g), (2 * q + 8, g)]                                       # (first k, column)
        for r, c in frag_a[lane]:
            seen_a[r, c : c + 2] += 1
        for k0, c in frag_b[lane]:
            seen_b[k0 : k0 + 2, c] += 1
    assert (seen_a == 1).all() and (seen_b == 1).all()
    # Rebuild D from the fragments alone: row r of A lives in the quad g = r % 8, column n of B in quad g = n.
    for lane in range(32):
        g, q = lane >> 2, lane & 3
        for c in range(4):
            row, col = g + 8 * (c >> 1), 2 * q + (c & 1)
            a_row = {kk: A[r, kk] for ln in range(32) for (r, k0) in frag_a[ln] if r == row for kk in (k0, k0 + 1)}
            b_col = {kk: B[kk, cc] for ln in range(32) for (k0, cc) in frag_b[ln] if cc == col for kk in (k0, k0 + 1)}
            assert sorted(a_row) == sorted(b_col) == list(range(16))
            D[row, col] = sum(a_row[kk] * b_col[kk] for kk in range(16))
    torch.testing.assert_close(D, A @ B)


@pytest.mark.parametrize("gate_up", [True, False])
def test_grouped_gemm_tile_mapping(gate_up):
    """The B-tile row mapping and the epilogue's (row, column) formula put every output where it belongs,
    including a partial last block of columns (n_out = 80: the block at n0 = 64 has 16 valid columns)."""
    torch.manual_seed(0)
    K, n_out = 32, 80
    a = torch.randn(64, K, dtype=torch.float64)
    w = torch.randn(2 * n_out if gate_up else n_out, K, dtype=torch.float64)
    step = 64 if gate_up else 128
    for n0 in range(0, n_out, step):
        got = emulate_mma_block(a, w, n0, gate_up, n_out)
        width = min(step, n_out - n0)
        if gate_up:
            want = F.silu(a @ w[n0 : n0 + width].T) * (a @ w[n_out + n0 : n_out + n0 + width].T)
        else:
            want = a @ w[n0 : n0 + width].T
        torch.testing.assert_close(got[:, :width], want)


def test_cpu_dispatch_takes_the_references():
    """On the CPU the kernel ops are their references (the MoE layer therefore is unchanged)."""
    cfg = CASES["group_limited"]
    logits = torch.randn(9, cfg.n_routed_experts)
    for a, b in zip(topk_softmax(logits, cfg), route(logits, cfg)):
        assert torch.equal(a, b)
    moe = random_moe(TINY)
    x = torch.randn(5, TINY.hidden_size, dtype=torch.float64)
    w, ids = route(x @ moe.gate.weight.T, TINY)
    e = moe.experts
    shared = moe.shared_experts(x)
    assert torch.equal(moe_experts(x, w, ids, e.gate_up_proj, e.down_proj, shared),
                       routed_experts(x, w, ids, e.gate_up_proj, e.down_proj) + shared)


# ---- the path choice: pure, so every regime is checked here without a GPU ----------------------------
LITE_SHAPE = dict(e=64, h=2048, i=1408)


@pytest.mark.parametrize("t,dtype,path", [
    (1, torch.bfloat16, "gemv"), (4, torch.bfloat16, "gemv"), (5, torch.bfloat16, "skinny"), (128, torch.bfloat16, "skinny"),
    (129, torch.bfloat16, "grouped_mm"), (4096, torch.bfloat16, "grouped_mm"), (5, torch.float16, "skinny"),
    (129, torch.float16, "mma"), (64, torch.float32, "gemv"), (65, torch.float32, "reference"),
    (1, torch.float64, "reference")])
def test_the_default_tuning_picks_the_measured_paths(t, dtype, path):
    assert choose_path(t, dtype, **LITE_SHAPE) == path


def test_shapes_the_kernels_do_not_take_choose_another_path():
    assert choose_path(32, torch.bfloat16, 64, 2048, 96) == "grouped_mm"  # I not a multiple of 64: no skinny GEMM
    assert choose_path(32, torch.float16, 64, 2048, 96) == "mma"
    assert choose_path(200, torch.bfloat16, 64, 2048, 1408, grouped_mm=False) == "mma"  # torch without _grouped_mm
    assert choose_path(1, torch.bfloat16, 257, 2048, 1408) == "reference"  # E > MAX_EXPERTS
    assert choose_path(1, torch.bfloat16, 64, 2044, 1408) == "reference"  # H not a multiple of 8


def test_the_skinny_gemm_refuses_a_tile_height_it_was_not_compiled_for():
    x, ids = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int64)
    gate_up, down = torch.zeros(4, 128, 64, dtype=torch.bfloat16), torch.zeros(4, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"rows must be one of \(8, 16, 32\), got 12"):
        skinny_experts(x, ids, gate_up, down, rows=12)


def test_a_tuning_record_forces_a_path():
    everything = 10**9
    forced = {"gemv": MoETuning(gemv_max_tokens=everything), "skinny": MoETuning(gemv_max_tokens=0, skinny_max_tokens=everything),
              "grouped_mm": MoETuning(gemv_max_tokens=0, skinny_max_tokens=0),
              "mma": MoETuning(gemv_max_tokens=0, skinny_max_tokens=0, grouped_mm_min_tokens=everything)}
    for path, tuning in forced.items():
        assert {choose_path(t, torch.bfloat16, **LITE_SHAPE, tuning=tuning) for t in (1, 40, 300)} == {path}
    with pytest.raises(dataclasses.FrozenInstanceError):
        MoETuning().gemv_max_tokens = 8
