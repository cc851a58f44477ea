"""Chapter 08's grouped expert GEMV (dsv2_lib/lessons/moe_grouped.py, kernels_cu/lessons/moe_grouped.cu):
its work items and index mappings emulated on the CPU, against the references."""
import pytest
import torch
import torch.nn.functional as F

from dsv2_lib.lessons import moe_grouped
from dsv2_lib.ops.moe_experts import routed_experts


def emulate_build_items(ids: torch.Tensor, e: int, tb: int = moe_grouped.GEMV_TB):
    """build_items as the block runs it: counts, warp 0's two scans over experts in 32-lane chunks,
    the stable scatter by rank (earlier choices of the same expert), the items of each expert."""
    flat = [x if 0 <= x < e else -1 for x in ids.flatten().tolist()]
    n = len(flat)
    cnt = [0] * e
    for x in flat:
        if x >= 0:
            cnt[x] += 1
    start, istart, run_c, run_i = [0] * e, [0] * e, 0, 0
    for e0 in range(0, e, 32):
        lanes = range(e0, min(e, e0 + 32))
        c = [cnt[x] for x in lanes]
        it = [-(-v // tb) for v in c]
        for l, x in enumerate(lanes):  # inclusive shuffle-up scan, minus the lane's own value
            start[x] = run_c + sum(c[: l + 1]) - c[l]
            istart[x] = run_i + sum(it[: l + 1]) - it[l]
        run_c, run_i = run_c + sum(c), run_i + sum(it)
    sorted_ = [None] * sum(cnt)
    for i, x in enumerate(flat):
        if x >= 0:
            sorted_[start[x] + sum(1 for j in range(i) if flat[j] == x)] = i
    items = [None] * run_i
    for x in range(e):
        for q in range(-(-cnt[x] // tb)):
            items[istart[x] + q] = (x, start[x] + q * tb, min(tb, cnt[x] - q * tb))
    assert run_i <= moe_grouped._gemv_max_items(n, e, tb)
    return torch.tensor(sorted_, dtype=torch.int32), torch.tensor(items, dtype=torch.int32).view(-1, 3)


@pytest.mark.parametrize("t,k,e", [(1, 6, 64), (3, 6, 64), (32, 6, 64), (64, 6, 64), (40, 6, 70), (20, 2, 4), (9, 1, 1)])
def test_build_items_matches_reference(t, k, e):
    torch.manual_seed(t)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    ids[: t // 2, 0] = 0  # a busy expert: more than one item
    if t > 2:
        ids[1, -1] = e + 5  # dropped
    got = emulate_build_items(ids, e)
    want = moe_grouped.gemv_items_reference(ids, e)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    srt, items = want  # every valid choice is in exactly one item, of its own expert
    seen = torch.cat([srt[s : s + c] for _, s, c in items.tolist()])
    assert torch.equal(seen.sort().values, srt.sort().values)
    assert all((ids.flatten()[srt[s : s + c].long()] == x).all() for x, s, c in items.tolist())


def emulate_gemv_grouped(x, w, ids, gate_up, down, shared_w=None, nw=3, cpw=2, tb=moe_grouped.GEMV_TB, in_router=False):
    """moe_route_gemv / moe_gemv_grouped / moe_combine, unit by unit: which slot and column chunk computes
    which output, each output written exactly once; the arithmetic as the reference rounds it."""
    t, k = ids.shape
    e, i2, h = gate_up.shape
    i = i2 // 2
    srt, items = moe_grouped.gemv_items_reference(ids, e, tb)
    srt, items = srt.tolist(), items.tolist()
    max_items = moe_grouped._gemv_max_items(t * k, e, tb)
    n_chunks = -(-t // tb)
    s_parts = 0 if shared_w is None else shared_w[0].shape[0] // i2
    hid, y = {}, {}
    h_sh, y_sh = {}, {}
    rnd = lambda v: v.to(x.dtype).double()

    def unit(slot, chunk, gate_up_pass, nwarps, max_items):
        if slot < max_items:
            if slot >= len(items):
                return
            ex, s, cnt = items[slot]
            choices = srt[s : s + cnt]
            rows = [(c // k if gate_up_pass else c, c) for c in choices]
            if gate_up_pass:
                wg, wu, dst, ncol = gate_up[ex][:i], gate_up[ex][i:], hid, i
            else:
                wd, dst, ncol = down[ex], y, h
        else:
            p = slot - max_items
            part, q = (p // n_chunks, p % n_chunks) if gate_up_pass else (0, p)
            if shared_w is None or part >= s_parts or q >= n_chunks:
                return
            cnt = min(tb, t - q * tb)
            rows = [(q * tb + j, q * tb + j) for j in range(cnt)]
            if gate_up_pass:
                gu = shared_w[0]
                wg, wu = gu[part * i : part * i + i], gu[s_parts * i + part * i : s_parts * i + part * i + i]
                dst, ncol = h_sh, i
            else:
                wd, dst, ncol = shared_w[1], y_sh, h
        for r in range(cpw):
            for warp in range(nwarps):
                n = (chunk * cpw + r) * nwarps + warp
                if n >= ncol:
                    continue
                for arow, orow in rows:
                    if gate_up_pass:
                        a = x[arow].double()
                        g, u = rnd(wg[n].double() @ a), rnd(wu[n].double() @ a)
                        key = (orow, n if slot < max_items else (slot - max_items) // n_chunks * i + n)
                        assert key not in dst
                        dst[key] = rnd(F.silu(g) * u)
                    else:
                        if slot < max_items:
                            a = torch.stack([hid[(arow, c)] for c in range(i)])
                        else:
                            a = torch.stack([h_sh[(arow, c)] for c in range(s_parts * i)])
                        assert (orow, n) not in dst
                        dst[(orow, n)] = rnd(wd[n].double() @ a)

    if shared_w is not None and in_router:  # blocks 1.. of moe_route_gemv: nw = 8 warps, no routed slots
        n_cols = -(-i // (8 * cpw))
        for u in range(s_parts * n_chunks * n_cols):
            unit(u // n_cols, u % n_cols, True, 8, 0)
        gu_slots = 0
    else:
        gu_slots = s_parts * n_chunks if shared_w is not None else 0
    for slot in range(max_items + gu_slots):
        for chunk in range(-(-i // (nw * cpw))):
            unit(slot, chunk, True, nw, max_items)
    for slot in range(max_items + (n_chunks if shared_w is not None else 0)):
        for chunk in range(-(-h // (nw * cpw))):
            unit(slot, chunk, False, nw, max_items)
    out = torch.zeros(t, h, dtype=torch.float64)
    for tt in range(t):
        for n in range(h):
            acc = 0.0
            for j in range(k):
                c = tt * k + j
                if 0 <= int(ids[tt, j]) < e:
                    acc += float(w[tt, j]) * float(y[(c, n)])
            r = float(rnd(torch.tensor(acc)))
            if shared_w is not None:
                r += float(y_sh[(tt, n)])
            out[tt, n] = r
    return out.to(x.dtype)


@pytest.mark.parametrize("in_router", [False, True])
def test_grouped_gemv_mapping_computes_every_output_once(in_router):
    torch.manual_seed(0)
    t, k, e, h, i, s = 10, 2, 5, 24, 16, 2
    x = torch.randn(t, h, dtype=torch.float64)
    gate_up, down = torch.randn(e, 2 * i, h, dtype=torch.float64) / 5, torch.randn(e, h, i, dtype=torch.float64) / 4
    w, ids = torch.rand(t, k, dtype=torch.float64), torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    ids[:9, 0] = 3  # 9 tokens on expert 3: two items
    ids[4, 1] = 7   # dropped
    sgu, sdn = torch.randn(2 * s * i, h, dtype=torch.float64) / 5, torch.randn(h, s * i, dtype=torch.float64) / 5
    got = emulate_gemv_grouped(x, w, ids, gate_up, down, (sgu, sdn), in_router=in_router)
    keep = (ids >= 0) & (ids < e)
    want = routed_experts(x, w * keep, ids.clamp(max=e - 1), gate_up, down)
    shared = F.linear(F.silu(F.linear(x, sgu[: s * i])) * F.linear(x, sgu[s * i :]), sdn)
    torch.testing.assert_close(got, want + shared)
