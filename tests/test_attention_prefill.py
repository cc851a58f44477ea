"""Prefill attention on the CPU: the packed reference, the checks on ``cu_seqlens``, the tile
schedule, the backend rule, and an emulation of the tensor-core kernel's fragment mapping.

The emulation replays ``attention_prefill_mma`` (kernels_cu/attention_prefill.cuh) lane by lane in
NumPy: ldmatrix and mma.sync are implemented from the PTX ISA's fragment layouts (written down
in the kernel's comments), and the kernel's own index expressions decide which addresses each
lane reads. If those expressions were wrong (a swapped matrix, a transposed B, a P register in
the wrong place) the emulated output would not match the reference.
"""
import numpy as np
import pytest
import torch

from dsv2_lib.lessons import attention_prefill as lesson
from dsv2_lib.ops import attention
from dsv2_lib.ops.attention import (
    AttentionTuning,
    causal_attention,
    kernel_variant,
    prefill_attention,
    prefill_attention_reference,
    prefill_backend,
    seqlens,
    tile_schedule,
)

SCALE = 0.114721


def make(lens_q, starts, h=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens_k = [s + n for s, n in zip(starts, lens_q)]
    Tq, Tk = sum(lens_q), sum(lens_k)
    q = torch.randn(Tq, h, 192, generator=g).to(dtype)
    kv = torch.randn(Tk, h, 256, generator=g).to(dtype)  # [k_nope | v] as kv_b_proj produces them
    k_pe = torch.randn(Tk, 64, generator=g).to(dtype)
    cu_q = torch.tensor([0, *np.cumsum(lens_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *np.cumsum(lens_k)], dtype=torch.int32)
    return q, kv[..., :128], k_pe, kv[..., 128:], cu_q, cu_k


def test_reference_is_causal_attention_per_sequence():
    lens, starts = [5, 1, 9], [0, 7, 3]
    q, k_nope, k_pe, v, cu_q, cu_k = make(lens, starts)
    out = prefill_attention_reference(q, k_nope, k_pe, v, cu_q, cu_k, SCALE)
    assert out.shape == (15, 2, 128) and out.dtype == q.dtype
    # sequence 2 by hand: queries 6..14; keys after 5 + 8 of the first two: 13 .. 24; start 3
    k = torch.cat([k_nope[13:25], k_pe[13:25, None].expand(-1, 2, -1)], -1)
    assert torch.allclose(out[6:], causal_attention(q[6:], k, v[13:25], 3, SCALE), atol=1e-6)
    # the first query of a sequence with nothing cached sees only itself: its own value
    assert torch.allclose(out[0], v[0], atol=1e-6)


def test_cpu_dispatch_takes_the_reference():
    q, k_nope, k_pe, v, cu_q, cu_k = make([4, 3], [2, 0])
    assert torch.equal(prefill_attention(q, k_nope, k_pe, v, cu_q, cu_k, SCALE),
                       prefill_attention_reference(q, k_nope, k_pe, v, cu_q, cu_k, SCALE))


@pytest.mark.parametrize("cu_q, cu_k, msg", [
    ([0, 3, 2], [0, 3, 5], "prefix sums decrease"),
    ([1, 3, 5], [0, 3, 5], r"want prefix sums \[0, ...\]"),
    ([0], [0], "length B \\+ 1 >= 2"),
    ([0, 3, 6], [0, 3, 5], "cu_seqlens_q: ends at 6 but there are 5 rows"),
    ([0, 3, 5], [0, 3, 9], "cu_seqlens_k: ends at 9 but there are 5 rows"),
    ([0, 5], [0, 2, 5], "cu_seqlens_q has 1 sequences, cu_seqlens_k 2"),
    ([0, 4, 5], [0, 3, 5], "sequence 0: 4 queries but only 3 keys"),
])
def test_ill_formed_seqlens_are_refused(cu_q, cu_k, msg):
    with pytest.raises(ValueError, match=msg):
        seqlens(torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), 5, 5)


def test_seqlens_refuses_non_integer_tensors_and_accepts_lists():
    with pytest.raises(ValueError, match="1-D int32"):
        seqlens(torch.tensor([0.0, 2.0]), [0, 2], 2, 2)
    assert seqlens([0, 2, 2], [0, 3, 4], 2, 4) == ([0, 2, 2], [0, 3, 4])


def test_bad_shapes_and_versions_are_refused():
    q, k_nope, k_pe, v, cu_q, cu_k = make([3], [0])
    with pytest.raises(ValueError, match="inconsistent shapes"):
        prefill_attention(q[:, :, :100], k_nope, k_pe, v, cu_q, cu_k, SCALE)
    with pytest.raises(ValueError, match="version must be one of"):
        prefill_attention(q, k_nope, k_pe, v, cu_q, cu_k, SCALE, version="fast")
    with pytest.raises(ValueError, match="on cpu"):  # a forced kernel version needs CUDA tensors
        prefill_attention(q, k_nope, k_pe, v, cu_q, cu_k, SCALE, version=attention.TUNING.kernel_variant)
    with pytest.raises(ValueError, match="version must be one of"):  # the lesson versions are not the engine's
        prefill_attention(q, k_nope, k_pe, v, cu_q, cu_k, SCALE, version="naive")
    for version in ("naive", "mma", "tiled"):
        with pytest.raises(ValueError, match="on cpu"):
            lesson.prefill_attention_version(q, k_nope, k_pe, v, cu_q, cu_k, SCALE, version=version)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        lesson.prefill_attention_version(q[:, :, :100], k_nope, k_pe, v, cu_q, cu_k, SCALE, version="naive")


def test_tile_schedule_covers_every_query_once_heaviest_first():
    cu_q, cu_k = [0, 100, 101, 229], [0, 100, 151, 279]  # lengths 100, 1 (start 50), 128
    tiles = tile_schedule(cu_q, cu_k, 64)
    assert sorted(tiles) == [(0, 0), (0, 64), (1, 0), (2, 0), (2, 64)]
    work = [cu_k[b + 1] - cu_k[b] - (cu_q[b + 1] - cu_q[b]) + min(q0 + 64, cu_q[b + 1] - cu_q[b]) for b, q0 in tiles]
    assert work == sorted(work, reverse=True) and tiles[0] == (2, 64)


def test_backend_rule_uses_the_tuning_record():
    tuning = AttentionTuning(sdpa_min_tokens=1000, sdpa_min_max_len=500)
    assert prefill_backend(999, 999, tuning=tuning) == "kernel"
    assert prefill_backend(1000, 500, tuning=tuning) == "sdpa"
    assert prefill_backend(4000, 100, tuning=tuning) == "kernel"
    assert prefill_backend(4000, 1000, num_calls=tuning.sdpa_max_calls + 1, tuning=tuning) == "kernel"
    assert prefill_backend(1000, 1000) == "kernel" and prefill_backend(1024, 1024) == "sdpa"  # the H200 record


def test_kernel_variant_uses_the_tuning_record():
    tuning = AttentionTuning(kernel_variant="mma_w4_st2", small_kernel_variant="mma_w8_st2", small_tiles=10)
    assert kernel_variant(9, tuning) == "mma_w8_st2" and kernel_variant(10, tuning) == "mma_w4_st2"
    assert kernel_variant(attention.TUNING.small_tiles - 1) == attention.TUNING.small_kernel_variant
    assert kernel_variant(attention.TUNING.small_tiles) == attention.TUNING.kernel_variant
    with pytest.raises(ValueError, match="not one of the engine's variants"):  # the engine launches only its own
        AttentionTuning(kernel_variant="mma")


def test_mma_variants_are_declared_and_fit_an_sm():
    """Every tensor-core variant, the engine's and the lesson's, is compiled (declared by its module's kernel
    file) for both 16-bit types, and MINB blocks of it fit the H200's 228 KB of shared memory per SM (1 KB
    reserved per block) and 64 K registers."""
    for kernel_file, variants in ((attention.ATTENTION_CU, attention.MMA_VARIANTS),
                                  (lesson.ATTENTION_LESSON_CU, lesson.MMA_VARIANTS)):
        for v, variant in variants.items():
            for t in ("__half", "__nv_bfloat16"):
                assert variant.kernel_name(t) in kernel_file.names
            assert variant.min_blocks * (variant.shared_bytes() + 1024) <= 228 * 1024, v
            assert variant.shared_bytes() <= 227 * 1024
    assert lesson.MMA_VARIANTS["mma"].shared_bytes() == 2 * 64 * (200 + 136)
    assert not set(lesson.MMA_VARIANTS) & set(attention.MMA_VARIANTS)  # each instantiated in one file
    assert set(attention.VERSIONS) < set(lesson.VERSIONS) and set(lesson.ALL_MMA_VARIANTS) < set(lesson.VERSIONS)
    assert {attention.TUNING.kernel_variant, attention.TUNING.small_kernel_variant} <= set(attention.MMA_VARIANTS)


# ---- emulation of attention_prefill_mma (one block, lane by lane) -------------------------------------
BK, K_STRIDE, V_STRIDE = 64, 200, 136


def bf16(x):
    return torch.as_tensor(x, dtype=torch.float32).to(torch.bfloat16).float().numpy()


def mma(c, a, b):
    """D = A B + C for one warp, each operand given per lane in its PTX fragment layout.

    a [32, 4, 2]: registers a0..a3, two halves each; b [32, 2, 2]; c [32, 4] fp32."""
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for e in range(2):
            A[g, 2 * t + e], A[g + 8, 2 * t + e] = a[lane, 0, e], a[lane, 1, e]
            A[g, 2 * t + 8 + e], A[g + 8, 2 * t + 8 + e] = a[lane, 2, e], a[lane, 3, e]
            B[2 * t + e, g], B[2 * t + 8 + e, g] = b[lane, 0, e], b[lane, 1, e]
            C[g, 2 * t + e], C[g + 8, 2 * t + e] = c[lane, e], c[lane, 2 + e]
    D = A @ B + C
    out = np.empty((32, 4))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        out[lane] = [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]
    return out


def ldmatrix_x4(smem, addr, trans):
    """smem: flat array; addr[lane] = element offset of row lane % 8 of matrix lane // 8 -> regs [32, 4, 2]."""
    mats = [np.stack([smem[addr[8 * i + r] : addr[8 * i + r] + 8] for r in range(8)]) for i in range(4)]
    regs = np.empty((32, 4, 2))
    for lane in range(32):
        for i in range(4):
            for e in range(2):
                regs[lane, i, e] = mats[i][2 * (lane % 4) + e, lane // 4] if trans else mats[i][lane // 4, 2 * (lane % 4) + e]
    return regs


def emulate_mma_block(q, k, v, start, q0, scale, nw=4, qs=False):
    """Output rows q0 .. q0+16nw-1 (those that exist) of one head, computed as attention_prefill_mma<T, nw, qs, ..>
    does (the number of K/V buffers changes only where a tile lives, not which lane reads what).

    q [nq, 192], k [nk, 192], v [nk, 128] (bf16-representable), start = nk - nq."""
    nq = q.shape[0]
    BQ = 16 * nw
    rows = min(BQ, nq - q0)
    n_keys = start + q0 + rows
    scale_log2 = np.float32(scale * np.log2(np.e))
    out = np.zeros((rows, 128))
    sQ = np.zeros(BQ * K_STRIDE)  # the Q tile as the QS variants stage it (rows past the sequence: zeros)
    for i in range(rows):
        sQ[i * K_STRIDE : i * K_STRIDE + 192] = q[q0 + i]
    for warp in range(nw):
        lanes = np.arange(32)
        g, t = lanes // 4, lanes % 4
        r0, r1 = 16 * warp + g, 16 * warp + g + 8
        pos0, pos1 = start + q0 + r0, start + q0 + r1
        qf = np.zeros((12, 32, 4, 2))
        for ks in range(12):
            col = 16 * ks + 2 * t
            for lane in range(32):
                for e in range(2):
                    row0, row1 = q0 + r0[lane], q0 + r1[lane]
                    qf[ks, lane, 0, e] = q[row0, col[lane] + e] if r0[lane] < rows else 0
                    qf[ks, lane, 1, e] = q[row1, col[lane] + e] if r1[lane] < rows else 0
                    qf[ks, lane, 2, e] = q[row0, col[lane] + 8 + e] if r0[lane] < rows else 0
                    qf[ks, lane, 3, e] = q[row1, col[lane] + 8 + e] if r1[lane] < rows else 0
        o = np.zeros((16, 32, 4))
        m0, m1 = np.full(32, -np.inf), np.full(32, -np.inf)
        l0, l1 = np.zeros(32), np.zeros(32)
        mi, mr = lanes // 8, lanes % 8
        for k0 in range(0, n_keys, BK):
            sK = np.zeros(BK * K_STRIDE)
            sV = np.zeros(BK * V_STRIDE)
            for j in range(BK):
                if k0 + j < n_keys:
                    sK[j * K_STRIDE : j * K_STRIDE + 192] = k[k0 + j]
                    sV[j * V_STRIDE : j * V_STRIDE + 128] = v[k0 + j]
            s = np.zeros((8, 32, 4))
            for ks in range(12):
                if qs:
                    qa = ldmatrix_x4(sQ, (16 * warp + 8 * (mi & 1) + mr) * K_STRIDE + 16 * ks + 8 * (mi >> 1), trans=False)
                    assert np.array_equal(qa, qf[ks])  # the same fragments as the register path's loads
                else:
                    qa = qf[ks]
                for n in range(0, 8, 2):
                    bk = ldmatrix_x4(sK, (8 * (n + (mi >> 1)) + mr) * K_STRIDE + 16 * ks + 8 * (mi & 1), trans=False)
                    s[n] = mma(s[n], qa, bk[:, 0:2])
                    s[n + 1] = mma(s[n + 1], qa, bk[:, 2:4])
            key = k0 + 8 * np.arange(8)[:, None, None] + 2 * t[None, :, None] + np.arange(2)[None, None, :]
            x0 = np.where(key > pos0[None, :, None], -np.inf, s[:, :, 0:2])  # raw scores, masked
            x1 = np.where(key > pos1[None, :, None], -np.inf, s[:, :, 2:4])
            mx0 = x0.max(axis=(0, 2)).reshape(8, 4).max(1).repeat(4) * scale_log2  # the shuffles over t = 0..3
            mx1 = x1.max(axis=(0, 2)).reshape(8, 4).max(1).repeat(4) * scale_log2
            mn0, mn1 = np.maximum(m0, mx0), np.maximum(m1, mx1)
            c0, c1 = np.exp2(m0 - mn0), np.exp2(m1 - mn1)
            m0, m1 = mn0, mn1
            p0, p1 = np.exp2(x0 * scale_log2 - mn0[None, :, None]), np.exp2(x1 * scale_log2 - mn1[None, :, None])
            l0, l1 = l0 * c0 + p0.sum(axis=(0, 2)), l1 * c1 + p1.sum(axis=(0, 2))
            o[:, :, 0:2] *= c0[None, :, None]
            o[:, :, 2:4] *= c1[None, :, None]
            p0, p1 = bf16(p0), bf16(p1)
            for kk in range(4):
                pa = np.stack([p0[2 * kk], p1[2 * kk], p0[2 * kk + 1], p1[2 * kk + 1]], axis=1)  # [32, 4, 2]
                for n in range(0, 16, 2):
                    bv = ldmatrix_x4(sV, (16 * kk + 8 * (mi & 1) + mr) * V_STRIDE + 8 * (n + (mi >> 1)), trans=True)
                    o[n] = mma(o[n], pa, bv[:, 0:2])
                    o[n + 1] = mma(o[n + 1], pa, bv[:, 2:4])
        L0 = l0.reshape(8, 4).sum(1).repeat(4)
        L1 = l1.reshape(8, 4).sum(1).repeat(4)
        for lane in range(32):
            for n in range(16):
                d = 8 * n + 2 * t[lane]
                if r0[lane] < rows:
                    out[r0[lane], d : d + 2] = o[n, lane, 0:2] / L0[lane]
                if r1[lane] < rows:
                    out[r1[lane], d : d + 2] = o[n, lane, 2:4] / L1[lane]
    return out


@pytest.mark.parametrize("nq, start, q0, nw, qs", [
    (70, 0, 64, 4, False), (64, 0, 0, 4, False), (20, 50, 0, 4, False), (1, 0, 0, 4, False),
    (70, 0, 64, 4, True), (20, 50, 0, 4, True),        # Q from shared memory (mma_w4_qs*)
    (140, 0, 128, 8, False), (100, 30, 0, 8, False),   # 128 queries, 8 warps (mma_w8*)
    (40, 0, 32, 2, False), (17, 0, 16, 1, False),      # 32 and 16 queries (mma_w2*, mma_w1)
])
def test_emulated_mma_kernel_matches_the_reference(nq, start, q0, nw, qs):
    """Awkward cases: a partial last tile (70 = 64 + 6), a full diagonal tile, a cached prefix that is
    not a multiple of the key tile (start 50, keys 0..69 in two tiles), a single query; for each
    block size of the variants."""
    g = torch.Generator().manual_seed(nq + start)
    nk = start + nq
    q, k, v = (bf16(torch.randn(n, d, generator=g)) for n, d in ((nq, 192), (nk, 192), (nk, 128)))
    got = emulate_mma_block(q, k, v, start, q0, SCALE, nw, qs)
    want = causal_attention(torch.tensor(q)[:, None], torch.tensor(k)[:, None], torch.tensor(v)[:, None],
                            start, SCALE)[q0 : q0 + 16 * nw, 0].double().numpy()
    # P is rounded to bf16 before P V (as on the GPU): |error| <= 2^-8 relative per weight, and the
    # weights sum to 1, so the output moves by at most 2^-8 * max|v| < 0.02 for |v| < 5.
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 2e-2


@pytest.mark.parametrize("lens, starts", [([5, 0, 9, 1], [0, 7, 3, 0]), ([6, 6, 6], [0, 0, 0]), ([4, 4], [0, 2])])
def test_sdpa_path_matches_the_reference(lens, starts):
    """The SDPA route (per sequence with a bottom-right causal mask, or one batched call when all
    lengths are equal and nothing is cached) computes the same attention; it runs on the CPU too."""
    q, k_nope, k_pe, v, cu_q, cu_k = make(lens, starts)
    ref = prefill_attention_reference(q, k_nope, k_pe, v, cu_q, cu_k, SCALE)
    got = attention.prefill_attention_sdpa(q, k_nope, k_pe, v, *seqlens(cu_q, cu_k, len(q), len(k_nope)), SCALE)
    assert torch.allclose(got, ref, atol=1e-5)
