"""The engine's latent decode kernel (the paged cache, the balanced schedule) against its reference on
the GPU (``pytest -m gpu``); chapter 10's uniform split kernel has ``test_mla_decode_split_gpu.py``.

Tolerance. Kernel and reference see the same query and cache values (the reference upcasts them
to fp32); the scores are exact products summed in fp32 on both sides (they differ by fp32
rounding only, ~D·2^-24 relative). The one real difference: the kernel rounds each probability
p_t to the cache dtype before the P·V product (and sums the rounded values for the normaliser),
a relative error of at most u = 2^-8 (bf16) or 2^-11 (fp16) per weight. The normalised weights
then err by at most 2u relative, so each output, a convex combination of latents, errs by at most
2u · max_t |latent_t|. Allowing for exp2f's few-ulp error, fp16's subnormal probabilities (below
2^-14, absolute error 2^-25 each) and the combine's fp32 sums, the tests use 4u · max|latent|.
fp32 caches take the reference, so there the results are equal.
"""
import dataclasses

import pytest
import torch

from dsv2_lib import TINY
from dsv2_lib.model.cache import SequenceBatch
from dsv2_lib.model.mla import MLA
from dsv2_lib.ops.mla_decode import (
    COMBINE_WIDTHS,
    STAGES,
    DecodeTuning,
    balanced_schedule,
    mla_decode_paged,
    mla_decode_paged_reference,
    mla_decode_query_dtype,
    mla_decode_reference,
    mla_decode_schedule,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_on")]

U = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LENGTHS = [[1], [15], [16], [17], [1000], [1, 15, 16, 17, 1000, 33, 64, 2]]


def make_inputs(B, heads, dl, dr, dtype, num_slots=None, max_len=1024, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    num_slots = num_slots or B + 2
    cache = torch.randn(num_slots, max_len, dl + dr, device="cuda", generator=g).to(dtype)
    q = (torch.randn(B, heads, dl + dr, device="cuda", generator=g) * 0.1).to(dtype)
    return q, cache


def close(got, want, cache, dtype):
    if dtype == torch.float32:
        return torch.equal(got, want)
    tol = 4 * U[dtype] * cache.float().abs().max().item()
    return got.dtype == torch.float32 and bool(((got - want).abs() <= tol).all())


def reference_on_cpu(query, cache, slots, lengths, scale, kv_lora_rank):
    """:func:`mla_decode_reference` computed on the CPU, returned on the GPU. Its hundreds of small kernels
    per call (einsum, softmax and matmul per entry) would otherwise dominate the tests' racecheck run, which
    instruments every kernel on the GPU, PyTorch's and cuBLAS's too."""
    return mla_decode_reference(query.cpu(), cache.cpu(), slots, lengths, scale, kv_lora_rank).cuda()


def paged_inputs(lengths, block_size, dtype, heads=16, dl=512, dr=64, spare=3, seed=0):
    """A pool of blocks in random order: every entry's table is drawn from one permutation of the pool
    (padded with -1 to the widest), and the same rows gathered into a contiguous [B, max_len, D] cache."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lengths]
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[perm.pop() for _ in range(k)] for k in need]
    width = max(need)
    table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda")
    q, _ = make_inputs(len(lengths), heads, dl, dr, dtype, num_slots=1, max_len=1, seed=seed)
    pool = torch.randn(num_blocks * block_size, dl + dr, generator=g).to(dtype).cuda()
    contiguous = torch.zeros(len(lengths), width * block_size, dl + dr, dtype=dtype, device="cuda")
    for b, (t, n) in enumerate(zip(tables, lengths)):
        pos = torch.arange(n)
        rows = torch.tensor(t, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size
        contiguous[b, :n] = pool[rows.cuda()]
    return q, pool, table, contiguous


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda l: "-".join(map(str, l)))
def test_paged_matches_reference_lite_shape(lengths, dtype):
    """V2-Lite's rows over a pool in random order, at every pipeline depth; fp32 takes the reference."""
    q, pool, table, _ = paged_inputs(lengths, 16, dtype)
    want = mla_decode_paged_reference(q, pool, table, lengths, 16, 0.1147, 512)
    for stages in STAGES:
        got = mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512, tuning=DecodeTuning(stages=stages))
        assert close(got, want, pool, dtype), stages


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda l: "-".join(map(str, l)))
def test_paged_block_sizes_every_depth(lengths, block_size, dtype):
    q, pool, table, contiguous = paged_inputs(lengths, block_size, dtype)
    want = mla_decode_reference(q, contiguous, range(len(lengths)), lengths, 0.1147, 512)
    for stages in STAGES:
        got = mla_decode_paged(q, pool, table, lengths, block_size, 0.1147, 512, tuning=DecodeTuning(stages=stages))
        assert close(got, want, pool, dtype), stages


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_other_shapes_every_depth(dtype):
    """The tiny model's rows (64 + 16) with 20 heads (a partial second head group), and V2's 128 heads."""
    lengths = [1, 15, 16, 17, 100]
    q, pool, table, _ = paged_inputs(lengths, 16, dtype, heads=20, dl=64, dr=16)
    want = mla_decode_paged_reference(q, pool, table, lengths, 16, 0.3, 64)
    for stages in STAGES:
        got = mla_decode_paged(q, pool, table, lengths, 16, 0.3, 64, tuning=DecodeTuning(stages=stages))
        assert close(got, want, pool, dtype), stages
    q, pool, table, _ = paged_inputs([1, 300, 1000], 16, dtype, heads=128)
    want = mla_decode_paged_reference(q, pool, table, [1, 300, 1000], 16, 0.1147, 512)
    assert close(mla_decode_paged(q, pool, table, [1, 300, 1000], 16, 0.1147, 512), want, pool, dtype)


def test_paged_bad_table_entries_read_zero_rows_and_bad_inputs_are_refused():
    q, pool, table, _ = paged_inputs([40, 20], 16, torch.bfloat16)
    table[0, 1] = -1                      # a hole inside a context
    table[1, 0] = pool.shape[0] // 16 + 5  # a block past the pool
    want = mla_decode_paged_reference(q, pool, table, [40, 20], 16, 0.1147, 512)
    assert close(mla_decode_paged(q, pool, table, [40, 20], 16, 0.1147, 512), want, pool, torch.bfloat16)
    with pytest.raises(ValueError, match="length 49 outside 1..48"):
        mla_decode_paged(q, pool, table, [49, 20], 16, 0.1147, 512)
    with pytest.raises(TypeError):
        mla_decode_paged(q, pool, table.long(), [40, 20], 16, 0.1147, 512)
    with pytest.raises(ValueError, match="need max_length"):
        mla_decode_paged(q, pool, table, torch.tensor([40, 20], dtype=torch.int32, device="cuda"), 16, 0.1, 512)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        mla_decode_paged(q, pool, table, [40, 20], 0, 0.1147, 512)
    with pytest.raises(ValueError, match=r"mla_decode_paged query: shape \[2, 16, 575\], expected \[2, 16, 576\]"):
        mla_decode_paged(q[..., 1:].contiguous(), pool, table, [40, 20], 16, 0.1147, 512)
    with pytest.raises(ValueError, match=r"workspace: 10 values, the balanced schedule needs"):
        mla_decode_paged(q, pool, table, [40, 20], 16, 0.1147, 512, workspace=torch.empty(10, device="cuda"))
    lengths = torch.tensor([400, 20], dtype=torch.int32, device="cuda")  # clamped to max_length on the device
    assert close(mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512, max_length=40), want, pool,
                 torch.bfloat16)


# ---- the balanced schedule -------------------------------------------------------------------------
@pytest.mark.parametrize("workers,min_tiles", [(1, 1), (7, 1), (132, 4), (264, 4)])
def test_schedule_kernel_equals_its_host_mirror(workers, min_tiles):
    g = torch.Generator().manual_seed(workers)
    for B in (1, 5, 1023, 1024, 1025, 3000):  # one chunk of the block-wide scan, several
        lengths = torch.randint(-3, 5000, (B,), generator=g, dtype=torch.int32)
        got = mla_decode_schedule(lengths.cuda(), 4000, workers, min_tiles).tolist()
        per, first = balanced_schedule([min(max(n, 0), 4000) for n in lengths.tolist()], workers, min_tiles)
        assert got == [per, *first], B


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_balanced_many_mixed_entries(dtype):
    """130 entries of 1 .. 700 rows (tile edges included): every segment boundary case at once."""
    g = torch.Generator().manual_seed(5)
    lengths = [1, 15, 16, 17, 31, 32, 33] + torch.randint(1, 700, (123,), generator=g).tolist()
    q, pool, table, contiguous = paged_inputs(lengths, 16, dtype, seed=5)
    want = reference_on_cpu(q, contiguous, range(len(lengths)), lengths, 0.1147, 512)
    got = mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512)
    assert close(got, want, pool, dtype)
    assert torch.equal(got, mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512))  # deterministic
    for workers in (1, 7, 66):  # one worker walks every entry; a few workers cross many entries each
        got = mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512, tuning=DecodeTuning(workers=workers))
        assert close(got, want, pool, dtype), workers
    for min_tiles in (1, 2, 9):  # one tile per worker (more partials than tiles of some entries) .. deep workers
        got = mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512, tuning=DecodeTuning(min_tiles=min_tiles))
        assert close(got, want, pool, dtype), min_tiles


def test_balanced_device_lengths_with_empty_entries_give_zeros():
    q, pool, table, contiguous = paged_inputs([300, 40, 90], 16, torch.bfloat16)
    lengths = torch.tensor([300, 0, 90], dtype=torch.int32, device="cuda")
    got = mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512, max_length=300)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    want = mla_decode_reference(q[[0, 2]], contiguous, [0, 2], [300, 90], 0.1147, 512)
    assert close(got[[0, 2]], want, pool, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_balanced_combine_gives_the_same_bits_at_every_width(dtype):
    """mla_decode_combine_balanced<V> for every V of COMBINE_WIDTHS (64 .. 512 columns a block), forced:
    the same sums in the same order, so the same bits as V = 2; empty entries zero, single-segment
    entries untouched; the tiny model's kv_lora_rank 64 at its only width."""
    lengths = [300, 0, 1, 17, 90, 700, 33] * 6
    q, pool, table, contiguous = paged_inputs(lengths, 16, dtype, seed=3)
    on_device = torch.tensor(lengths, dtype=torch.int32, device="cuda")  # empty entries: device lengths only
    full = [b for b, n in enumerate(lengths) if n]
    want = reference_on_cpu(q[full], contiguous, full, [lengths[b] for b in full], 0.1147, 512)
    results = {}
    for v in COMBINE_WIDTHS:
        for workers in (5, 264):  # deep workers (few partials per entry) and a wave (many)
            results[v, workers] = mla_decode_paged(q, pool, table, on_device, 16, 0.1147, 512, max_length=700,
                                                   tuning=DecodeTuning(workers=workers, combine_width=v))
    for (v, workers), got in results.items():
        assert torch.equal(got, results[2, workers]), f"V = {v}, {workers} workers"
        assert close(got[full], want, pool, dtype)
        assert torch.equal(got[1], torch.zeros_like(got[1]))
    q, pool, table, contiguous = paged_inputs([40, 0, 9], 16, dtype, heads=4, dl=64, dr=16)
    want = mla_decode_reference(q[[0, 2]], contiguous, [0, 2], [40, 9], 0.3, 64)
    got = mla_decode_paged(q, pool, table, torch.tensor([40, 0, 9], dtype=torch.int32, device="cuda"), 16, 0.3, 64,
                           max_length=40, tuning=DecodeTuning(workers=7))
    assert close(got[[0, 2]], want, pool, dtype) and torch.equal(got[1], torch.zeros_like(got[1]))


@pytest.mark.cuda_graph
def test_balanced_cuda_graph_replays_with_new_lengths():
    """Captured once with the table's capacity as the bound; each replay takes new lengths and tables,
    and the schedule follows them (computed on the GPU inside the graph)."""
    q, pool, table, _ = paged_inputs([900, 5, 300], 16, torch.bfloat16)
    lengths = torch.tensor([900, 5, 300], dtype=torch.int32, device="cuda")
    out = torch.empty(3, 16, 512, device="cuda")
    bound = table.shape[1] * 16
    mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512, max_length=bound, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512, max_length=bound, out=out)
    for step in range(3):
        pool.copy_(torch.randn(pool.shape, device="cuda").to(pool.dtype))
        table.copy_(table[:, torch.randperm(table.shape[1], device="cuda")].roll(1, 0))
        lengths.copy_(torch.tensor([900 - step, 5 + 100 * step, 1 + step], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = mla_decode_paged_reference(q, pool, table, lengths, 16, 0.1147, 512)
        assert close(out, want, pool, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_engine_decode_attention_uses_the_kernel(dtype, monkeypatch, kernel_launches):
    """MLA.decode_attention on a contiguous cache of CUDA tensors runs the kernel (query in the model
    dtype) and agrees with the fp32 reference path. The kernel path rounds three times to the model dtype (the
    absorbed query, the latent sum, the W_v product: u relative each), and the query's rounding
    moves the scores and so the softmax weights a little more; 16u of the largest output covers it."""
    cfg = dataclasses.replace(TINY, num_hidden_layers=1)
    torch.manual_seed(0)
    attn = MLA(cfg).to(device="cuda", dtype=dtype)
    for p in attn.parameters():
        p.copy_(torch.randn(p.shape, device="cuda") / p.shape[-1] ** 0.5)
    cache = torch.randn(3, 128, cfg.cache_row_dim, device="cuda").to(dtype)
    batch = SequenceBatch((2, 0, 1), (100, 7, 0), (1, 1, 1), decode=True)
    h = cfg.num_attention_heads
    q_nope = torch.randn(3, h, cfg.qk_nope_head_dim, device="cuda").to(dtype)
    q_pe = torch.randn(3, h, cfg.qk_rope_head_dim, device="cuda").to(dtype)
    assert mla_decode_query_dtype(cache, cfg.kv_lora_rank) == dtype
    got = attn.decode_attention(q_nope, q_pe, batch, cache)
    assert kernel_launches, "the decode path did not launch the kernel"
    monkeypatch.setenv("DSV2_BACKEND", "torch")
    want = attn.decode_attention(q_nope, q_pe, batch, cache)
    assert got.dtype == dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 16 * U[dtype] * want.float().abs().max().item()


@pytest.mark.parametrize("block_size", [1, 16])
def test_engine_decode_attention_uses_the_paged_kernel(block_size, monkeypatch):
    """MLA.decode_attention over a paged cache with permuted tables runs mla_decode_paged (no gather) and
    agrees with the reference path (16u, as test_engine_decode_attention_uses_the_kernel explains)."""
    from dsv2_lib.model import mla as mla_mod
    from dsv2_lib.model.cache import PagedBatch
    dtype = torch.bfloat16
    cfg = dataclasses.replace(TINY, num_hidden_layers=1)
    torch.manual_seed(0)
    attn = MLA(cfg).to(device="cuda", dtype=dtype)
    for p in attn.parameters():
        p.copy_(torch.randn(p.shape, device="cuda") / p.shape[-1] ** 0.5)
    starts, lens = (100, 7, 0), (1, 3, 1)
    ctx = [s + n for s, n in zip(starts, lens)]
    perm = torch.randperm(sum(-(-n // block_size) for n in ctx) + 2).tolist()
    tables = tuple(tuple(perm.pop() for _ in range(-(-n // block_size))) for n in ctx)
    slots = tuple(t[p // block_size] * block_size + p % block_size for t, a, n in zip(tables, starts, lens)
                  for p in range(a, a + n))
    batch = PagedBatch(starts, lens, tables, block_size, slots, decode=True, device="cuda")
    cache = torch.randn((len(perm) + sum(map(len, tables))) * block_size, cfg.cache_row_dim, device="cuda").to(dtype)
    h, T = cfg.num_attention_heads, sum(lens)
    q_nope = torch.randn(T, h, cfg.qk_nope_head_dim, device="cuda").to(dtype)
    q_pe = torch.randn(T, h, cfg.qk_rope_head_dim, device="cuda").to(dtype)
    calls = []
    real = mla_mod.mla_decode_paged
    monkeypatch.setattr(mla_mod, "mla_decode_paged", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    got = attn.decode_attention(q_nope, q_pe, batch, cache)
    assert calls
    monkeypatch.setenv("DSV2_BACKEND", "torch")
    want = attn.decode_attention(q_nope, q_pe, batch, cache)
    err = (got.float() - want.float()).abs().max().item()
    assert got.shape == want.shape and err <= 16 * U[dtype] * want.float().abs().max().item()
