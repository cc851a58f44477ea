"""MLA decode attention on the latent cache, on the CPU: the absorption identities, the reference,
the split policy, the tuning record, bad input, and a lane-by-lane emulation of the CUDA kernels' index mapping.

The emulation (``emulate_kernel``: chapter 10's split kernel, ``kernels_cu/lessons/mla_decode_split.cu``;
``emulate_balanced``: the engine's balanced schedule, ``kernels_cu/mla_decode.cu``) replays their shared
block body (``attend_rows``, ``kernels_cu/mla_decode.cuh``) with the same index
expressions, building every MMA operand register by register as the kernel does and handing the
MMA only what the PTX fragment layouts (copied into ``A_FRAG``/``B_FRAG``/``C_FRAG`` from the PTX
ISA) say each lane holds. A wrong lane, row or column anywhere would scramble a matrix; run in
float64 without rounding, the emulation must then match the reference to 1e-12.
"""
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv2_lib import TINY
from dsv2_lib.lessons.mla_decode_split import mla_decode, mla_decode_splits, mla_decode_workspace
from dsv2_lib.model.cache import LatentCache, SequenceBatch
from dsv2_lib.model.mla import MLA
from dsv2_lib.ops.attention import causal_attention
from dsv2_lib.ops.mla_decode import (
    COMBINE_WIDTHS,
    STAGES,
    TILE,
    WARPS,
    DecodeTuning,
    balanced_schedule,
    balanced_segments,
    combine_width,
    mla_decode_paged,
    mla_decode_paged_reference,
    mla_decode_query_dtype,
    mla_decode_reference,
)

# ---- the identities --------------------------------------------------------------------------------


def test_absorption_identities_hold_in_float64():
    torch.manual_seed(0)
    h, dn, dl, n = 16, 128, 512, 37
    w_k, w_v = torch.randn(h, dn, dl, dtype=torch.float64), torch.randn(h, dn, dl, dtype=torch.float64)
    q_nope, c = torch.randn(h, dn, dtype=torch.float64), torch.randn(n, dl, dtype=torch.float64)
    k = torch.einsum("hdc,tc->thd", w_k, c)  # decompressed keys [n, h, 128]
    lhs = torch.einsum("hd,thd->ht", q_nope, k)
    rhs = torch.einsum("hc,tc->ht", torch.einsum("hd,hdc->hc", q_nope, w_k), c)
    assert torch.allclose(lhs, rhs, rtol=0, atol=1e-12 * lhs.abs().max().item())
    a = torch.rand(h, n, dtype=torch.float64).softmax(-1)
    v = torch.einsum("hdc,tc->thd", w_v, c)
    lhs = torch.einsum("ht,thd->hd", a, v)
    rhs = torch.einsum("hdc,hc->hd", w_v, a @ c)
    assert torch.allclose(lhs, rhs, rtol=0, atol=1e-12 * lhs.abs().max().item())


def random_mla(cfg=TINY, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    attn = MLA(cfg).to(dtype)
    for p in attn.parameters():
        p.copy_(torch.randn(p.shape, dtype=dtype) / p.shape[-1] ** 0.5)
    return attn


def test_decode_attention_equals_decompressed_attention():
    """Absorbed decode == decompress every cached latent with kv_b_proj and attend (float64)."""
    attn, c = random_mla(), TINY
    cache = torch.randn(3, 40, c.cache_row_dim, dtype=torch.float64)
    batch = SequenceBatch((2, 0), (17, 30), (1, 3), decode=True)  # 3 tokens of one sequence, too
    T, h = batch.num_tokens, c.num_attention_heads
    q_nope = torch.randn(T, h, c.qk_nope_head_dim, dtype=torch.float64)
    q_pe = torch.randn(T, h, c.qk_rope_head_dim, dtype=torch.float64)
    got = attn.decode_attention(q_nope, q_pe, batch, cache)
    want = _decompressed(attn, q_nope, q_pe, batch, cache)
    assert got.shape == (T, h, c.v_head_dim)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


def _decompressed(attn, q_nope, q_pe, batch, cache):
    c, h = attn.cfg, attn.cfg.num_attention_heads
    q = torch.cat([q_nope, q_pe], -1)
    outs, off = [], 0
    for slot, start, n in zip(batch.slots, batch.starts, batch.lens):
        rows = cache[slot, : start + n]
        kv = attn.kv_b_proj(rows[:, : c.kv_lora_rank]).view(-1, h, c.qk_nope_head_dim + c.v_head_dim)
        k = torch.cat([kv[..., : c.qk_nope_head_dim], rows[:, None, c.kv_lora_rank:].expand(-1, h, -1)], -1)
        outs.append(causal_attention(q[off : off + n], k, kv[..., c.qk_nope_head_dim:], start, c.softmax_scale))
        off += n
    return torch.cat(outs)


def test_reference_one_row_returns_that_latent():
    cache = torch.randn(2, 8, 80)
    q = torch.randn(1, 4, 80)
    out = mla_decode_reference(q, cache, [1], [1], 0.3, 64)
    assert torch.allclose(out, cache[1, 0, :64].expand(1, 4, 64))


def test_reference_is_used_on_the_cpu_and_refuses_nothing_it_can_compute():
    cache = torch.randn(2, 8, 80, dtype=torch.bfloat16)
    q = torch.randn(3, 4, 80)
    assert mla_decode_query_dtype(cache, 64) == torch.float32
    out = mla_decode(q, cache, [1, 0, 1], [3, 8, 1], 0.2, 64)
    assert out.dtype == torch.float32 and out.shape == (3, 4, 64)
    assert torch.equal(out, mla_decode_reference(q, cache, [1, 0, 1], [3, 8, 1], 0.2, 64))


# ---- the split policy ------------------------------------------------------------------------------


@pytest.mark.parametrize("B,heads,L,wave", [(64, 16, 4096, 264), (1, 16, 32768, 264), (1, 16, 32768, 132),
                                            (64, 16, 4096, 132), (300, 16, 100, 264), (1, 4, 1, 264),
                                            (3, 128, 5000, 264), (1, 16, 33, 264), (7, 16, 17, 132)])
def test_splits_cover_the_context_and_fill_about_one_wave(B, heads, L, wave):
    splits, chunk = mla_decode_splits(B, heads, L, wave)
    blocks = B * -(-heads // 16)
    assert chunk % TILE == 0 and splits >= 1
    assert splits * chunk >= L and (splits - 1) * chunk < L  # every split has work
    if blocks < wave and -(-L // TILE) >= 4 * wave // blocks:
        assert splits * blocks <= wave and splits * blocks > wave // 2
    if blocks >= wave:
        assert splits == 1


def test_split_policy_at_the_bars():
    assert mla_decode_splits(64, 16, 4096, 264) == (4, 1024)
    assert mla_decode_splits(1, 16, 32768, 264) == (256, 128)


def test_default_config_and_counters():
    from dsv2_lib.lessons.mla_decode_split import FUSED_MAX_SPLITS, mla_decode_config, mla_decode_counters
    splits, stages, fused = mla_decode_config(64, 16, 4096, 132)
    assert (splits is None or splits >= 1) and stages in STAGES and fused in (None, True, False)
    assert FUSED_MAX_SPLITS >= 1 and 5 in STAGES
    c = mla_decode_counters(3, 20, "cpu")
    assert c.dtype == torch.int32 and c.numel() == 6 and not c.any()


def test_workspace_size():
    assert mla_decode_workspace(2, 16, 3, 512, "cpu").numel() == 2 * 16 * 3 * 513


def test_decode_tuning_is_a_checked_frozen_record():
    """The engine kernel's launch choices: H200 defaults, and a bad record refused where it is made."""
    default = DecodeTuning()
    assert (default.stages, default.min_tiles, default.workers, default.combine_width) == (2, 1, None, None)
    assert default.stages in STAGES
    with pytest.raises(dataclasses.FrozenInstanceError):
        default.stages = 3
    assert DecodeTuning(stages=5, min_tiles=4, workers=8, combine_width=16).workers == 8
    for bad, message in [(dict(stages=6), r"stages must be one of \(2, 3, 4, 5\), got 6"),
                         (dict(min_tiles=0), "min_tiles must be an int >= 1, got 0"),
                         (dict(min_tiles=None), "min_tiles must be an int >= 1, got None"),
                         (dict(workers=0), "workers must be an int >= 1, got 0"),
                         (dict(workers=True), "workers must be an int >= 1, got True"),
                         (dict(combine_width=3), r"combine_width must be one of \(2, 4, 8, 16\), got 3")]:
        with pytest.raises(ValueError, match=message):
            DecodeTuning(**bad)


# ---- lane-level emulation of kernels_cu/mla_decode.cuh and the kernels around it --------------------
# PTX ISA, mma.m16n8k16 (.f16/.bf16), g = lane >> 2, t = lane & 3: (row, col) of each half of each register
def A_FRAG(lane):
    g, t = lane >> 2, lane & 3
    return [[(g, 2 * t), (g, 2 * t + 1)], [(g + 8, 2 * t), (g + 8, 2 * t + 1)],
            [(g, 2 * t + 8), (g, 2 * t + 9)], [(g + 8, 2 * t + 8), (g + 8, 2 * t + 9)]]


def B_FRAG(lane):  # (k, n)
    g, t = lane >> 2, lane & 3
    return [[(2 * t, g), (2 * t + 1, g)], [(2 * t + 8, g), (2 * t + 9, g)]]


def C_FRAG(lane):
    g, t = lane >> 2, lane & 3
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]


def mma(c, a, b):
    """c[lane][4] += A @ B with A, B rebuilt from what each lane holds (a[lane][4][2], b[lane][2][2])."""
    A, B = np.full((16, 16), np.nan), np.full((16, 8), np.nan)
    for lane in range(32):
        for reg, pos in enumerate(A_FRAG(lane)):
            for half, (r, col) in enumerate(pos):
                A[r, col] = a[lane][reg][half]
        for reg, pos in enumerate(B_FRAG(lane)):
            for half, (k, n) in enumerate(pos):
                B[k, n] = b[lane][reg][half]
    assert not np.isnan(A).any() and not np.isnan(B).any()  # every element supplied by some lane
    Dm = A @ B
    for lane in range(32):
        for e, (r, col) in enumerate(C_FRAG(lane)):
            c[lane][e] += Dm[r, col]


def ldmatrix_x4(smem, addr, trans=False):
    """addr(lane) -> (row, col) in smem of row lane%8 of matrix lane//8; returns regs[lane][4][2]."""
    mats = []
    for i in range(4):
        rows = [addr(8 * i + r) for r in range(8)]
        mats.append(np.array([smem[r, c : c + 8] for r, c in rows]))  # 8x8
    out = []
    for lane in range(32):
        regs = []
        for i in range(4):
            m = mats[i].T if trans else mats[i]
            regs.append([m[lane // 4, 2 * (lane % 4)], m[lane // 4, 2 * (lane % 4) + 1]])
        out.append(regs)
    return out


def paged_row(table, block_size, num_rows, tok):
    """The kernel's PAGED address of context position ``tok`` (None: a zero row, nothing read)."""
    blk_i = tok // block_size
    blk = table[blk_i] if blk_i < len(table) else -1
    row = blk * block_size + (tok - blk_i * block_size)
    return row if blk >= 0 and row < num_rows else None


def stage_tile(cache, slot, tok0, t_end, table=None, block_size=None):
    """load_tile's copies of the tile at context position ``tok0``: warp w stages rows w, w + WARPS, ...,
    lane l the row's 8-value vectors l, l + 32, ...; a row past ``t_end`` (or a bad table entry) is the
    cp.async zero-fill. Checks that the copies write every value of the tile exactly once."""
    D = cache.shape[-1]
    tile, writes = np.zeros((TILE, D)), np.zeros((TILE, D), dtype=int)
    for w in range(WARPS):
        for i in range(TILE // WARPS):
            r = w + i * WARPS
            tok = tok0 + r
            row = None
            if tok < t_end:
                row = cache[slot, tok] if table is None else paged_row(table, block_size, cache.shape[0], tok)
                row = cache[row] if table is not None and row is not None else row
            for lane in range(32):
                for j in range(-(-(D // 8) // 32)):
                    c = (lane + 32 * j) * 8
                    if c < D:
                        tile[r, c : c + 8] = 0.0 if row is None else row[c : c + 8]
                        writes[r, c : c + 8] += 1
    assert (writes == 1).all()
    return tile


def emulate_block(q, cache, slot, length, max_length, chunk, split, h0, scale_log2, DL, table=None, block_size=None,
                  t_range=None):
    """One block of mla_decode_split (float64, no rounding): returns (o [H, DL] for heads h0.., lse).
    With ``table`` (PAGED = true) ``cache`` is flat ``[num_rows, D]`` and ``slot`` is unused.
    ``t_range``: the rows ``[t_begin, t_end)`` instead of split ``split`` (a balanced segment)."""
    H, D = q.shape
    KS, QKS, NT_S, COLS = D // 16, -(-(D // 16) // WARPS), TILE // 8, DL // WARPS
    NT_O = COLS // 8
    length = min(length, max_length)
    if table is None and not 0 <= slot < cache.shape[0]:
        length = 0
    t_begin, t_end = t_range or (split * chunk, min(length, split * chunk + chunk))
    ntiles = -(-(t_end - t_begin) // TILE) if t_end > t_begin else 0
    qa = [[None] * QKS for _ in range(WARPS)]
    for w in range(WARPS):
        for i in range(QKS):
            regs = []
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                k0 = (w + i * WARPS) * 16 + 2 * t
                ok = w + i * WARPS < KS

                def pair(h, k):
                    return [q[h, k], q[h, k + 1]] if ok and h < H else [0.0, 0.0]
                regs.append([pair(h0 + g, k0), pair(h0 + g + 8, k0), pair(h0 + g, k0 + 8), pair(h0 + g + 8, k0 + 8)])
            qa[w][i] = regs
    o = np.zeros((WARPS, 32, NT_O, 4))
    m = np.full((WARPS, 32, 2), -np.inf)
    l = np.zeros((WARPS, 32, 2))
    for it in range(ntiles):
        tok0 = t_begin + it * TILE
        tile = stage_tile(cache, slot, tok0, t_end, table, block_size)
        ss = np.zeros((WARPS, 32, NT_S, 4))
        for w in range(WARPS):
            s = [[[0.0] * 4 for _ in range(NT_S)] for _ in range(32)]
            for i in range(QKS):
                ks = w + i * WARPS
                if ks >= KS:
                    continue
                for jp in range(NT_S // 2):
                    def addr(lane, jp=jp, ks=ks):
                        mi, r = lane >> 3, lane & 7
                        return 8 * (2 * jp + (mi >> 1)) + r, ks * 16 + 8 * (mi & 1)
                    bf = ldmatrix_x4(tile, addr)
                    for half, j in ((0, 2 * jp), (1, 2 * jp + 1)):
                        c = [s[lane][j] for lane in range(32)]
                        mma(c, qa[w][i], [[bf[lane][2 * half], bf[lane][2 * half + 1]] for lane in range(32)])
            ss[w] = np.array(s)
        S = ss.sum(axis=0)  # identical in every warp
        for lane in range(32):
            t = lane & 3
            for j in range(NT_S):
                for e in range(4):
                    tok = tok0 + 8 * j + 2 * t + (e & 1)
                    S[lane, j, e] = S[lane, j, e] * scale_log2 if tok < t_end else -np.inf
        for w in range(WARPS):
            pa = [[None] * 32 for _ in range(NT_S // 2)]
            mx = np.stack([S[:, :, :2].max(axis=(1, 2)), S[:, :, 2:].max(axis=(1, 2))], -1)  # [32, 2]
            for lane in range(32):  # quad reduction: lanes 4g..4g+3
                q4 = (lane >> 2) * 4
                new = np.maximum(m[w, lane], mx[q4 : q4 + 4].max(axis=0))
                alpha = np.exp2(m[w, lane] - new)
                m[w, lane] = new
                p = np.exp2(S[lane] - np.array([new[0], new[0], new[1], new[1]]))  # [NT_S, 4]
                l[w, lane] = l[w, lane] * alpha + np.array([p[:, :2].sum(), p[:, 2:].sum()])
                for kk in range(NT_S // 2):
                    pa[kk][lane] = [[p[2 * kk, 0], p[2 * kk, 1]], [p[2 * kk, 2], p[2 * kk, 3]],
                                    [p[2 * kk + 1, 0], p[2 * kk + 1, 1]], [p[2 * kk + 1, 2], p[2 * kk + 1, 3]]]
                o[w, lane, :, :2] *= alpha[0]
                o[w, lane, :, 2:] *= alpha[1]
            for kk in range(TILE // 16):
                for np_ in range(NT_O // 2):
                    def addr(lane, kk=kk, np_=np_, w=w):
                        mi, r = lane >> 3, lane & 7
                        return 16 * kk + 8 * (mi & 1) + r, w * COLS + 16 * np_ + 8 * (mi >> 1)
                    bf = ldmatrix_x4(tile, addr, trans=True)
                    for half, n in ((0, 2 * np_), (1, 2 * np_ + 1)):
                        c = [list(o[w, lane, n]) for lane in range(32)]
                        mma(c, pa[kk], [[bf[lane][2 * half], bf[lane][2 * half + 1]] for lane in range(32)])
                        o[w, :, n] = np.array(c)
    out = np.zeros((16, DL))
    lse = np.full(16, -np.inf)
    for w in range(WARPS):
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            q4 = g * 4
            ltot = l[w, q4 : q4 + 4].sum(axis=0)
            inv = np.where(ltot > 0, 1 / np.where(ltot > 0, ltot, 1), 0)
            for n in range(NT_O):
                col = w * COLS + 8 * n + 2 * t
                out[g, col : col + 2] = o[w, lane, n, :2] * inv[0]
                out[g + 8, col : col + 2] = o[w, lane, n, 2:] * inv[1]
            if w == 0 and t == 0:
                lse[g] = m[w, lane, 0] + np.log2(ltot[0]) if ltot[0] > 0 else -np.inf
                lse[g + 8] = m[w, lane, 1] + np.log2(ltot[1]) if ltot[1] > 0 else -np.inf
    return out, lse


def emulate_fused_combine(part, lse, b, h0, DL, threads=WARPS * 32):
    """The fused combine of the last block of (entry b, heads h0..h0+15), with the kernel's index
    mapping: threads 0..15 reduce one head's lse each, thread x merges float4 items x, x + 128, ..."""
    H, splits = lse.shape[1], lse.shape[2]
    out = np.full((16, DL), np.nan)
    s_max, s_inv = np.zeros(16), np.zeros(16)
    for x in range(16):
        h, M, den = h0 + x, -np.inf, 0.0
        if h < H:
            for s in range(splits):
                M = max(M, lse[b, h, s])
            if M != -np.inf:
                for s in range(splits):
                    den += np.exp2(lse[b, h, s] - M)
        s_max[x], s_inv[x] = M, (1 / den if den > 0 else 0.0)
    V4 = DL // 4
    for x in range(threads):
        for i in range(x, 16 * V4, threads):
            hh, c = i // V4, (i % V4) * 4
            h = h0 + hh
            if h >= H:
                continue
            acc = np.zeros(4)
            if s_max[hh] != -np.inf:
                for s in range(splits):
                    acc += np.exp2(lse[b, h, s] - s_max[hh]) * part[b, h, s, c : c + 4]
            assert np.isnan(out[hh, c : c + 4]).all()  # each output written once
            out[hh, c : c + 4] = acc * s_inv[hh]
    return out


def emulate_kernel(q, cache, slots, lengths, scale, DL, splits, max_length, fused=False, tables=None, block_size=None):
    """mla_decode_split over the grid (splits, B, head groups), then mla_decode_combine (or, fused,
    the last block's merge). ``tables`` (one block table per entry) emulates PAGED = true."""
    B, H, _ = q.shape
    chunk = -(-(-(-max_length // TILE)) // splits) * TILE
    splits = max(1, -(-max_length // chunk))
    part = np.zeros((B, H, splits, DL))
    lse = np.full((B, H, splits), -np.inf)
    for b in range(B):
        for h0 in range(0, H, 16):
            for s in range(splits):
                o, ls = emulate_block(q[b], cache, None if tables else slots[b], lengths[b], max_length, chunk, s, h0,
                                      scale * np.log2(np.e), DL, tables[b] if tables else None, block_size)
                n = min(16, H - h0)
                part[b, h0 : h0 + n, s], lse[b, h0 : h0 + n, s] = o[:n], ls[:n]
    if fused and splits > 1:
        out = np.zeros((B, H, DL))
        for b in range(B):
            for h0 in range(0, H, 16):
                n = min(16, H - h0)
                out[b, h0 : h0 + n] = emulate_fused_combine(part, lse, b, h0, DL)[:n]
        return out
    M = lse.max(axis=2, keepdims=True)
    w = np.where(np.isfinite(M), np.exp2(lse - np.where(np.isfinite(M), M, 0)), 0.0)
    den = w.sum(axis=2)
    return (w[..., None] * part).sum(axis=2) / np.where(den > 0, den, 1)[..., None]


@pytest.mark.parametrize("fused", [False, True], ids=["combine-kernel", "fused-combine"])
@pytest.mark.parametrize("H,DL,DR,lengths,splits", [
    (4, 64, 16, [1, 15, 16, 17, 70], 1),      # the tiny model's shape; lengths around the tile edges
    (4, 64, 16, [70, 33, 5], 3),              # split-KV: three chunks, the last partly empty
    (20, 64, 16, [40, 1], 2),                 # two head groups, the second only 4 heads deep
    (16, 64, 64, [33], 2),                    # a wider rope part: D = 128, 8 k-steps over 4 warps
    (16, 512, 64, [45], 2),                   # DeepSeek-V2-Lite's rows: D = 576, 36 k-steps, 16 n-tiles per warp
])
def test_emulated_kernel_matches_the_reference(H, DL, DR, lengths, splits, fused):
    rng = np.random.default_rng(0)
    D = DL + DR
    cache = rng.standard_normal((3, 80, D))
    B = len(lengths)
    slots = [(2 * b + 1) % 3 for b in range(B)]
    q = rng.standard_normal((B, H, D)) * 0.5
    got = emulate_kernel(q, cache, slots, lengths, 0.3, DL, splits, max(lengths), fused=fused)
    want = mla_decode_reference(torch.from_numpy(q), torch.from_numpy(cache), slots, lengths, 0.3, DL).numpy()
    assert np.abs(got - want).max() < 1e-12


def test_emulated_kernel_gives_zeros_for_a_bad_slot_or_empty_length():
    rng = np.random.default_rng(1)
    cache = rng.standard_normal((2, 40, 80))
    q = rng.standard_normal((3, 4, 80))
    for fused in (False, True):
        got = emulate_kernel(q, cache, [5, 0, -1], [10, 0, 3], 0.3, 64, 2, 40, fused=fused)
        assert np.array_equal(got, np.zeros_like(got))


# ---- the paged address mapping (PAGED = true) ------------------------------------------------------


def random_tables(rng, lengths, block_size, num_blocks, pad=1):
    """Block tables drawn from a random permutation of the pool (no block shared), each padded with
    ``pad`` extra blocks past its context, as a table of a growing sequence is."""
    perm = rng.permutation(num_blocks).tolist()
    tables = []
    for n in lengths:
        k = -(-n // block_size) + pad
        tables.append([perm.pop() for _ in range(k)])
    return tables


@pytest.mark.parametrize("fused", [False, True], ids=["combine-kernel", "fused-combine"])
@pytest.mark.parametrize("H,DL,DR,lengths,splits,block_size", [
    (4, 64, 16, [1, 15, 16, 17, 70], 1, 16),   # lengths around the tile and block edges
    (4, 64, 16, [70, 33, 5], 3, 1),            # blocks of one row: every row looked up on its own
    (4, 64, 16, [70, 33], 2, 64),              # blocks larger than a tile
    (20, 64, 16, [40, 1], 2, 7),               # a block size that divides nothing
    (16, 512, 64, [45], 2, 16),                # DeepSeek-V2-Lite's rows
])
def test_emulated_paged_kernel_matches_the_reference(H, DL, DR, lengths, splits, block_size, fused):
    """Rows scattered over a permuted pool, read through the tables: the contiguous reference of the
    same rows, and the paged reference."""
    rng = np.random.default_rng(2)
    D, B = DL + DR, len(lengths)
    num_blocks = sum(-(-n // block_size) + 1 for n in lengths) + 3
    cache = rng.standard_normal((num_blocks * block_size, D))
    tables = random_tables(rng, lengths, block_size, num_blocks)
    q = rng.standard_normal((B, H, D)) * 0.5
    got = emulate_kernel(q, cache, None, lengths, 0.3, DL, splits, max(lengths), fused=fused, tables=tables,
                         block_size=block_size)
    contiguous = np.zeros((B, max(lengths), D))
    for b, (t, n) in enumerate(zip(tables, lengths)):
        for p in range(n):
            contiguous[b, p] = cache[t[p // block_size] * block_size + p % block_size]
    want = mla_decode_reference(torch.from_numpy(q), torch.from_numpy(contiguous), range(B), lengths, 0.3, DL).numpy()
    assert np.abs(got - want).max() < 1e-12
    ref = mla_decode_paged_reference(torch.from_numpy(q), torch.from_numpy(cache), tables, lengths, block_size, 0.3, DL)
    assert np.abs(ref.numpy() - want).max() < 1e-12


def test_emulated_paged_kernel_reads_zero_rows_for_bad_table_entries():
    """A -1 or out-of-range block inside a context reads as zeros (never as an address), as the paged
    reference says; the paged wrapper falls back to that reference on the CPU."""
    rng = np.random.default_rng(3)
    block_size, D, DL = 4, 80, 64
    cache = rng.standard_normal((6 * block_size, D))
    tables = [[2, -1, 5], [1, 99, 0]]
    lengths = [11, 10]
    q = rng.standard_normal((2, 4, D)) * 0.5
    got = emulate_kernel(q, cache, None, lengths, 0.3, DL, 2, 11, tables=tables, block_size=block_size)
    want = mla_decode_paged_reference(torch.from_numpy(q), torch.from_numpy(cache), tables, lengths, block_size, 0.3, DL)
    assert np.abs(got - want.numpy()).max() < 1e-12
    zero = np.zeros((1, 4, D))  # a context of zero rows only: uniform weights over zero latents
    assert np.array_equal(emulate_kernel(zero, cache, None, [4], 0.3, DL, 1, 4, tables=[[-1]], block_size=4),
                          np.zeros((1, 4, DL)))
    table = torch.tensor([[2, -1, 5], [1, 99, 0]], dtype=torch.int32)
    cpu = mla_decode_paged(torch.from_numpy(q), torch.from_numpy(cache), table, lengths, block_size, 0.3, DL)
    assert torch.equal(cpu, want)


def test_paged_reference_refuses_a_context_longer_than_its_table():
    with pytest.raises(ValueError, match="needs more than the table"):
        mla_decode_paged_reference(torch.zeros(1, 4, 80), torch.zeros(8, 80), [[0]], [5], 4, 0.3, 64)


# ---- the engine keeps its semantics ---------------------------------------------------------------


def test_decode_matches_prefill_on_the_tiny_model():
    """A decode step attends like the last position of a prefill over the same cache (float32)."""
    cfg = dataclasses.replace(TINY, num_hidden_layers=1)
    attn = random_mla(cfg, torch.float32, seed=3)
    cache = LatentCache(cfg, 2, 32, torch.float32, "cpu").layer(0)
    torch.manual_seed(4)
    cache.copy_(torch.randn_like(cache))
    h = cfg.num_attention_heads
    q_nope = torch.randn(9, h, cfg.qk_nope_head_dim)
    q_pe = torch.randn(9, h, cfg.qk_rope_head_dim)
    pre = attn.prefill_attention(q_nope, q_pe, SequenceBatch((1,), (0,), (9,)), cache)
    dec = attn.decode_attention(q_nope[-1:], q_pe[-1:], SequenceBatch((1,), (8,), (1,), decode=True), cache)
    assert torch.allclose(dec, pre[-1:], atol=1e-5, rtol=1e-5)


# ---- the balanced schedule (chapter 13) ------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(0, 300), min_size=1, max_size=12), workers=st.integers(1, 40),
       min_tiles=st.integers(1, 5))
def test_balanced_segments_cover_every_tile_once_and_never_share_a_slot(lengths, workers, min_tiles):
    per, first = balanced_schedule(lengths, workers, min_tiles)
    B = len(lengths)
    assert per >= min_tiles and per * workers >= first[B]  # the workers cover every tile
    segments = balanced_segments(per, first, workers)
    for b, n in enumerate(lengths):
        mine = sorted((t0, t1, i, slot) for i, e, t0, t1, slot in segments if e == b)
        tiles = -(-n // TILE)
        # the entry's tiles, in order, without gap or overlap, each segment within one worker's range
        assert [t for t0, t1, *_ in mine for t in range(t0, t1)] == list(range(tiles))
        workers_of_b = [i for *_, i, _ in mine]
        if tiles:  # exactly the workers the combine kernel merges: first / per .. (last - 1) / per
            assert workers_of_b == list(range(first[b] // per, (first[b + 1] - 1) // per + 1))
        # one segment: it writes the output itself; several: each a slot
        assert all((slot is None) == (len(mine) == 1) for *_, slot in mine)
    slots = [slot for *_, slot in segments if slot is not None]
    assert len(slots) == len(set(slots)) and all(0 <= s < B + workers - 1 for s in slots)


def emulate_balanced(q, cache, tables, lengths, block_size, scale, DL, workers, min_tiles=1):
    """mla_decode_balanced (its segments, each one block's arithmetic) then mla_decode_combine_balanced."""
    B, H, _ = q.shape
    per, first = balanced_schedule(lengths, workers, min_tiles)
    out = np.full((B, H, DL), np.nan)
    part = np.full((B + workers - 1, H, DL), np.nan)
    lse = np.full((B + workers - 1, H), np.nan)
    for i, b, t0, t1, slot in balanced_segments(per, first, workers):
        for h0 in range(0, H, 16):
            n = min(16, H - h0)
            o, ls = emulate_block(q[b], cache, None, lengths[b], max(lengths), None, None, h0, scale * np.log2(np.e),
                                  DL, tables[b], block_size, t_range=(t0 * TILE, min(lengths[b], t1 * TILE)))
            if slot is None:
                out[b, h0 : h0 + n] = o[:n]
            else:
                part[slot, h0 : h0 + n], lse[slot, h0 : h0 + n] = o[:n], ls[:n]
    for b in range(B):
        if first[b] == first[b + 1]:
            out[b] = 0.0
            continue
        i0, i1 = first[b] // per, (first[b + 1] - 1) // per
        if i0 == i1:
            continue
        ls, o = lse[i0 + b : i1 + b + 1], part[i0 + b : i1 + b + 1]  # [k, H], [k, H, DL]
        M = ls.max(axis=0)
        w = np.exp2(ls - M)
        out[b] = (w[..., None] * o).sum(axis=0) / w.sum(axis=0)[:, None]
    return out


@pytest.mark.parametrize("H,DL,DR,lengths,block_size,workers,min_tiles", [
    (4, 64, 16, [1, 15, 16, 17, 70], 16, 3, 1),    # entries split across workers, lengths at tile edges
    (4, 64, 16, [70, 33, 0, 5], 7, 5, 1),          # an empty entry (zeros), a block size that divides nothing
    (4, 64, 16, [200], 16, 4, 1),                  # one long entry over every worker
    (20, 64, 16, [40, 1, 90], 16, 2, 2),           # two head groups; a worker ends mid-entry
    (16, 512, 64, [45, 100], 16, 3, 1),            # DeepSeek-V2-Lite's rows
])
def test_emulated_balanced_kernel_matches_the_reference(H, DL, DR, lengths, block_size, workers, min_tiles):
    rng = np.random.default_rng(3)
    D, B = DL + DR, len(lengths)
    num_blocks = sum(-(-n // block_size) + 1 for n in lengths) + 3
    cache = rng.standard_normal((num_blocks * block_size, D))
    tables = random_tables(rng, [max(n, 1) for n in lengths], block_size, num_blocks)
    q = rng.standard_normal((B, H, D)) * 0.5
    got = emulate_balanced(q, cache, tables, lengths, block_size, 0.3, DL, workers, min_tiles)
    for b, n in enumerate(lengths):
        if n == 0:
            assert np.array_equal(got[b], np.zeros_like(got[b]))
            continue
        want = mla_decode_paged_reference(torch.from_numpy(q[b : b + 1]), torch.from_numpy(cache), [tables[b]], [n],
                                          block_size, 0.3, DL).numpy()[0]
        assert np.abs(got[b] - want).max() < 1e-12


def test_combine_width_takes_the_widest_block_that_keeps_two_per_sm():
    """Batch x 16 heads of V2-Lite's 512 columns on 132 SMs: 64 columns a block up to batch 4 (128 blocks
    at V = 4 would be under 264), then 128, 256 and from batch 32 whole rows; the tiny model's 64 columns
    only ever take V = 2; a kv_lora_rank the widths do not divide takes what divides it."""
    widths = {B: combine_width(B * 16, 512, 132) for B in (1, 4, 8, 16, 32, 256)}
    assert widths == {1: 2, 4: 2, 8: 4, 16: 8, 32: 16, 256: 16}
    assert combine_width(4096, 64, 132) == 2
    assert combine_width(4096, 520, 132) == 8  # 520 = 8 x 65: not a multiple of 16
    assert all(v in COMBINE_WIDTHS for v in widths.values())

