"""The latent decode kernel against its reference on the GPU (``pytest -m gpu``).

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
from dsv2_lib.core import kernels
from dsv2_lib.model.cache import SequenceBatch
from dsv2_lib.model.mla import MLA
from dsv2_lib.ops import mla_decode as mla_decode_mod
from dsv2_lib.ops.mla_decode import (
    STAGES,
    mla_decode,
    mla_decode_counters,
    mla_decode_query_dtype,
    mla_decode_reference,
    mla_decode_workspace,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_on")]

U = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LITE = (16, 512, 64)  # heads, kv_lora_rank, rope dim of DeepSeek-V2-Lite
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


def scrambled_slots(B, num_slots):
    return [(7 * b + 3) % num_slots for b in range(B)]  # not in order; distinct while B <= num_slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda l: "-".join(map(str, l)))
def test_matches_reference_lite_shape(lengths, dtype):
    B = len(lengths)
    q, cache = make_inputs(B, *LITE, dtype, num_slots=11)
    slots = scrambled_slots(B, 11)
    want = mla_decode_reference(q, cache, slots, lengths, 0.1147, 512)
    assert close(mla_decode(q, cache, slots, lengths, 0.1147, 512), want, cache, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,dl,dr", [(4, 64, 16), (128, 512, 64), (20, 512, 64)])
def test_matches_reference_other_shapes(heads, dl, dr, dtype):
    """The tiny model's rows (80 wide), V2's 128 heads (8 head groups), and a last partial head group."""
    lengths = [1, 17, 300, 1000]
    q, cache = make_inputs(len(lengths), heads, dl, dr, dtype, num_slots=5)
    slots = scrambled_slots(len(lengths), 5)
    want = mla_decode_reference(q, cache, slots, lengths, 0.2, dl)
    assert close(mla_decode(q, cache, slots, lengths, 0.2, dl), want, cache, dtype)


@pytest.mark.parametrize("fused", [False, True], ids=["combine-kernel", "fused-combine"])
@pytest.mark.parametrize("stages", STAGES)
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 32, 100])
def test_any_split_count_pipeline_depth_and_combine(num_splits, stages, fused):
    """Forced split counts (100 > the 32 tiles of 1000 rows: clamped), every pipeline depth, the
    combine kernel or the fused combine: the same answer, and the tickets are left at zero."""
    lengths = [1000, 999, 31, 1]
    q, cache = make_inputs(len(lengths), *LITE, torch.bfloat16, num_slots=4)
    slots = [3, 0, 2, 1]
    want = mla_decode_reference(q, cache, slots, lengths, 0.1147, 512)
    counters = mla_decode_counters(len(lengths), 16, "cuda")
    for _ in range(2):  # a second call reuses the tickets the first left at zero
        got = mla_decode(q, cache, slots, lengths, 0.1147, 512, num_splits=num_splits, stages=stages,
                         fused=fused, counters=counters)
        assert close(got, want, cache, torch.bfloat16)
        assert not counters.any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("stages", STAGES)
def test_fused_combine_other_shapes_is_deterministic(stages, dtype):
    """The tiny model's rows and 20 heads (a partial second head group) through the fused combine;
    repeated launches give bit-identical results (the merge order does not depend on which block
    finished last)."""
    for heads, dl, dr in [(4, 64, 16), (20, 512, 64)]:
        lengths = [1, 17, 300, 1000]
        q, cache = make_inputs(len(lengths), heads, dl, dr, dtype, num_slots=5)
        slots = scrambled_slots(len(lengths), 5)
        want = mla_decode_reference(q, cache, slots, lengths, 0.2, dl)
        first = mla_decode(q, cache, slots, lengths, 0.2, dl, num_splits=9, stages=stages, fused=True)
        assert close(first, want, cache, dtype)
        for _ in range(3):
            again = mla_decode(q, cache, slots, lengths, 0.2, dl, num_splits=9, stages=stages, fused=True)
            assert torch.equal(again, first)


@pytest.mark.parametrize("config", [{}, {"num_splits": 128, "stages": 5, "fused": False},
                                    {"num_splits": 128, "stages": 4, "fused": True}], ids=["default", "s5", "s4-fused"])
@pytest.mark.heavy
def test_long_context_batch_one(config):
    """Batch 1 × 32768 rows: ~128-256 splits merged by the combine kernel or the fused combine."""
    q, cache = make_inputs(1, *LITE, torch.bfloat16, num_slots=1, max_len=32768)
    want = mla_decode_reference(q, cache, [0], [32768], 0.1147, 512)
    assert close(mla_decode(q, cache, [0], [32768], 0.1147, 512, **config), want, cache, torch.bfloat16)


def test_device_lengths_are_clamped_and_bad_slots_give_zeros():
    """Device tensors cannot be checked on the host: the kernel clamps a length to max_length and
    attends over nothing (zeros) for a slot out of range or a length <= 0."""
    q, cache = make_inputs(5, *LITE, torch.bfloat16, num_slots=3, max_len=256)
    slots = torch.tensor([0, 1, 7, -1, 2], dtype=torch.int32, device="cuda")
    lengths = torch.tensor([300, 40, 10, 10, 0], dtype=torch.int32, device="cuda")
    got = mla_decode(q, cache, slots, lengths, 0.1147, 512, max_length=100)
    want = mla_decode_reference(q[:2], cache, [0, 1], [100, 40], 0.1147, 512)
    assert close(got[:2], want, cache, torch.bfloat16)
    assert torch.equal(got[2:], torch.zeros_like(got[2:]))


def test_preallocated_out_and_workspace():
    lengths = [700, 3]
    q, cache = make_inputs(2, *LITE, torch.bfloat16, num_slots=2)
    out = torch.full((2, 16, 512), float("nan"), device="cuda")
    ws = mla_decode_workspace(2, 16, 8, 512, "cuda")
    got = mla_decode(q, cache, [1, 0], lengths, 0.1147, 512, out=out, workspace=ws, num_splits=8)
    assert got.data_ptr() == out.data_ptr()
    assert close(out, mla_decode_reference(q, cache, [1, 0], lengths, 0.1147, 512), cache, torch.bfloat16)


def test_bad_inputs_are_refused_before_launch():
    q, cache = make_inputs(2, *LITE, torch.bfloat16, num_slots=3, max_len=64)
    with pytest.raises(IndexError, match=r"slot 3 out of range: the cache has 3 slots"):
        mla_decode(q, cache, [0, 3], [5, 5], 0.1, 512)
    with pytest.raises(IndexError, match=r"slot -1 out of range"):
        mla_decode(q, cache, [0, -1], [5, 5], 0.1, 512)
    with pytest.raises(ValueError, match=r"length 65 outside 1..64"):
        mla_decode(q, cache, [0, 1], [5, 65], 0.1, 512)
    with pytest.raises(ValueError, match=r"length 0 outside 1..64"):
        mla_decode(q, cache, [0, 1], [0, 5], 0.1, 512)
    with pytest.raises(ValueError, match=r"2 slots and 1 lengths for a batch of 2"):
        mla_decode(q, cache, [0, 1], [5], 0.1, 512)
    with pytest.raises(TypeError, match=r"mla_decode query: dtype torch.float16, expected torch.bfloat16"):
        mla_decode(q.half(), cache, [0, 1], [5, 5], 0.1, 512)
    with pytest.raises(ValueError, match=r"mla_decode query: shape \[2, 16, 575\], expected \[2, 16, 576\]"):
        mla_decode(q[..., 1:].contiguous(), cache, [0, 1], [5, 5], 0.1, 512)
    dev = torch.zeros(2, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"need max_length"):
        mla_decode(q, cache, dev, dev + 1, 0.1, 512)
    with pytest.raises(ValueError, match=r"max_length 65 outside 1..64"):
        mla_decode(q, cache, dev, dev + 1, 0.1, 512, max_length=65)
    with pytest.raises(TypeError, match=r"mla_decode slots: dtype torch.int64, expected torch.int32"):
        mla_decode(q, cache, dev.long(), dev + 1, 0.1, 512, max_length=8)
    with pytest.raises(ValueError, match=r"workspace: 10 values, this call needs"):
        mla_decode(q, cache, [0, 1], [64, 64], 0.1, 512, num_splits=2,
                   workspace=torch.empty(10, device="cuda"))
    with pytest.raises(ValueError, match=r"16-byte boundaries"):
        mla_decode(_misaligned(q), cache, [0, 1], [5, 5], 0.1, 512)


def _misaligned(q):
    """The same shape, starting 2 bytes past a 16-byte boundary."""
    base = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)
    v = base[1:].view(q.shape)
    v.copy_(q)
    return v


@pytest.mark.cuda_graph
def test_cuda_graph_capture_and_replay_on_new_inputs():
    """Everything preallocated, lengths on the device: a captured graph replays the split kernel and
    the combine on new queries, cache rows and lengths (all <= max_length)."""
    B, max_length = 3, 900
    q, cache = make_inputs(B, *LITE, torch.bfloat16, num_slots=4)
    slots = torch.tensor([2, 0, 3], dtype=torch.int32, device="cuda")
    lengths = torch.tensor([900, 5, 300], dtype=torch.int32, device="cuda")
    out = torch.empty(B, 16, 512, device="cuda")
    ws = mla_decode_workspace(B, 16, 64, 512, "cuda")
    counters = mla_decode_counters(B, 16, "cuda")
    out2 = torch.empty_like(out)
    kw = dict(max_length=max_length, workspace=ws, num_splits=6)
    mla_decode(q, cache, slots, lengths, 0.1147, 512, out=out, fused=False, **kw)
    mla_decode(q, cache, slots, lengths, 0.1147, 512, out=out2, fused=True, counters=counters, stages=4, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(q, cache, slots, lengths, 0.1147, 512, out=out, fused=False, **kw)
        mla_decode(q, cache, slots, lengths, 0.1147, 512, out=out2, fused=True, counters=counters, stages=4, **kw)
    for step in range(3):
        q.copy_(torch.randn_like(q, dtype=torch.float32).mul_(0.1).to(q.dtype))
        cache[:, : max_length].copy_(torch.randn(4, max_length, 576, device="cuda").to(cache.dtype))
        lengths.copy_(torch.tensor([900 - step, 5 + 100 * step, 1 + step], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = mla_decode_reference(q, cache, slots.tolist(), lengths.tolist(), 0.1147, 512)
        assert close(out, want, cache, torch.bfloat16)
        assert close(out2, want, cache, torch.bfloat16) and not counters.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_engine_decode_attention_uses_the_kernel(dtype, monkeypatch):
    """MLA.decode_attention on CUDA tensors runs the kernel (query in the model dtype) and agrees
    with the fp32 reference path. The kernel path rounds three times to the model dtype (the
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
    calls = []
    launch = kernels.launch
    monkeypatch.setattr(kernels, "launch", lambda k, *a, **kw: (calls.append(k), launch(k, *a, **kw)))
    got = attn.decode_attention(q_nope, q_pe, batch, cache)
    assert calls, "the decode path did not launch the kernel"
    monkeypatch.setenv("DSV2_BACKEND", "torch")
    want = attn.decode_attention(q_nope, q_pe, batch, cache)
    assert got.dtype == dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 16 * U[dtype] * want.float().abs().max().item()


# ---- the paged kernel (chapter 13): PAGED = true reads rows through a block table ---------------------
from dsv2_lib.ops.mla_decode import mla_decode_paged, mla_decode_paged_reference  # noqa: E402


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda l: "-".join(map(str, l)))
def test_paged_equals_contiguous_kernel_on_the_same_rows(lengths, block_size, dtype):
    q, pool, table, contiguous = paged_inputs(lengths, block_size, dtype)
    B = len(lengths)
    want = mla_decode_reference(q, contiguous, range(B), lengths, 0.1147, 512)
    for num_splits, stages, fused in ((1, 2, False), (3, 2, False), (3, 4, True), (None, None, None)):
        kw = dict(num_splits=num_splits, stages=stages, fused=fused)
        got = mla_decode_paged(q, pool, table, lengths, block_size, 0.1147, 512, schedule="uniform", **kw)
        same = mla_decode(q, contiguous, list(range(B)), lengths, 0.1147, 512, **kw)
        if num_splits is not None:  # same splits and depth: the same arithmetic on the same rows
            assert torch.equal(got, same), (num_splits, stages, fused)
        assert close(got, want, pool, dtype)
    for stages in STAGES:  # the balanced schedule (the default)
        assert close(mla_decode_paged(q, pool, table, lengths, block_size, 0.1147, 512, stages=stages), want, pool, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_other_shapes_and_reference(dtype):
    lengths = [1, 15, 16, 17, 100]
    q, pool, table, contiguous = paged_inputs(lengths, 16, dtype, heads=20, dl=64, dr=16)
    got = mla_decode_paged(q, pool, table, lengths, 16, 0.3, 64, num_splits=2, schedule="uniform")
    want = mla_decode_paged_reference(q, pool, table, lengths, 16, 0.3, 64)
    assert close(got, want, pool, dtype)
    assert close(mla_decode_paged(q, pool, table, lengths, 16, 0.3, 64), want, pool, dtype)
    assert torch.equal(got, mla_decode(q, contiguous, list(range(5)), lengths, 0.3, 64, num_splits=2))


def test_paged_bad_table_entries_read_zero_rows_and_bad_inputs_are_refused():
    q, pool, table, _ = paged_inputs([40, 20], 16, torch.bfloat16)
    table[0, 1] = -1                      # a hole inside a context
    table[1, 0] = pool.shape[0] // 16 + 5  # a block past the pool
    want = mla_decode_paged_reference(q, pool, table, [40, 20], 16, 0.1147, 512)
    for kw in (dict(num_splits=2, schedule="uniform"), {}):
        assert close(mla_decode_paged(q, pool, table, [40, 20], 16, 0.1147, 512, **kw), want, pool, torch.bfloat16)
    with pytest.raises(ValueError, match="for schedule='uniform'"):
        mla_decode_paged(q, pool, table, [40, 20], 16, 0.1147, 512, num_splits=2)
    with pytest.raises(ValueError, match="schedule must be one of"):
        mla_decode_paged(q, pool, table, [40, 20], 16, 0.1147, 512, schedule="even")
    with pytest.raises(ValueError, match="length 49 outside 1..48"):
        mla_decode_paged(q, pool, table, [49, 20], 16, 0.1147, 512)
    with pytest.raises(TypeError):
        mla_decode_paged(q, pool, table.long(), [40, 20], 16, 0.1147, 512)
    with pytest.raises(ValueError, match="need max_length"):
        mla_decode_paged(q, pool, table, torch.tensor([40, 20], dtype=torch.int32, device="cuda"), 16, 0.1, 512)
    lengths = torch.tensor([400, 20], dtype=torch.int32, device="cuda")  # clamped to max_length on the device
    for kw in (dict(num_splits=1, schedule="uniform"), {}):
        assert close(mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512, max_length=40, **kw), want, pool,
                     torch.bfloat16)


@pytest.mark.cuda_graph
def test_paged_cuda_graph_capture_and_replay():
    q, pool, table, _ = paged_inputs([900, 5, 300], 16, torch.bfloat16)
    lengths = torch.tensor([900, 5, 300], dtype=torch.int32, device="cuda")
    out = torch.empty(3, 16, 512, device="cuda")
    kw = dict(max_length=900, workspace=mla_decode_workspace(3, 16, 64, 512, "cuda"), num_splits=6,
              counters=mla_decode_counters(3, 16, "cuda"), fused=True, stages=4, out=out, schedule="uniform")
    mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512, **kw)
    for step in range(3):
        pool.copy_(torch.randn(pool.shape, device="cuda").to(pool.dtype))
        table.copy_(table[:, torch.randperm(table.shape[1], device="cuda")].roll(1, 0))  # new tables, same pool
        lengths.copy_(torch.tensor([900 - step, 5 + 100 * step, 1 + step], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = mla_decode_paged_reference(q, pool, table, lengths, 16, 0.1147, 512)
        assert close(out, want, pool, torch.bfloat16)


# ---- the balanced schedule -------------------------------------------------------------------------
from dsv2_lib.ops.mla_decode import balanced_schedule, mla_decode_schedule  # noqa: E402


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
    want = mla_decode_reference(q, contiguous, range(len(lengths)), lengths, 0.1147, 512)
    got = mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512)
    assert close(got, want, pool, dtype)
    assert torch.equal(got, mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512))  # deterministic
    for workers in (1, 7, 66):  # one worker walks every entry; a few workers cross many entries each
        assert close(mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512, workers=workers), want, pool, dtype)
    for min_tiles in (1, 2, 9):  # one tile per worker (more partials than tiles of some entries) .. deep workers
        assert close(mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512, min_tiles=min_tiles), want, pool, dtype)
    with pytest.raises(ValueError, match="workers must be an int >= 1"):
        mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512, workers=0)
    with pytest.raises(ValueError, match="min_tiles must be an int >= 1"):
        mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512, min_tiles=0)
    with pytest.raises(ValueError, match="workers and min_tiles are for schedule='balanced'"):
        mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512, workers=4, schedule="uniform")


def test_balanced_device_lengths_with_empty_entries_give_zeros():
    q, pool, table, contiguous = paged_inputs([300, 40, 90], 16, torch.bfloat16)
    lengths = torch.tensor([300, 0, 90], dtype=torch.int32, device="cuda")
    got = mla_decode_paged(q, pool, table, lengths, 16, 0.1147, 512, max_length=300)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    want = mla_decode_reference(q[[0, 2]], contiguous, [0, 2], [300, 90], 0.1147, 512)
    assert close(got[[0, 2]], want, pool, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_balanced_combine_gives_the_same_bits_at_every_width(dtype, monkeypatch):
    """mla_decode_combine_balanced<V> for every V of COMBINE_WIDTHS (64 .. 512 columns a block), forced:
    the same sums in the same order, so the same bits as V = 2; empty entries zero, single-segment
    entries untouched; the tiny model's kv_lora_rank 64 at its only width."""
    lengths = [300, 0, 1, 17, 90, 700, 33] * 6
    q, pool, table, contiguous = paged_inputs(lengths, 16, dtype, seed=3)
    on_device = torch.tensor(lengths, dtype=torch.int32, device="cuda")  # empty entries: device lengths only
    full = [b for b, n in enumerate(lengths) if n]
    want = mla_decode_reference(q[full], contiguous, full, [lengths[b] for b in full], 0.1147, 512)
    results = {}
    for v in mla_decode_mod.COMBINE_WIDTHS:
        monkeypatch.setattr(mla_decode_mod, "combine_width", lambda rows, dl, sms, v=v: v)
        for workers in (5, 264):  # deep workers (few partials per entry) and a wave (many)
            results[v, workers] = mla_decode_paged(q, pool, table, on_device, 16, 0.1147, 512, max_length=700,
                                                   workers=workers)
    for (v, workers), got in results.items():
        assert torch.equal(got, results[2, workers]), f"V = {v}, {workers} workers"
        assert close(got[full], want, pool, dtype)
        assert torch.equal(got[1], torch.zeros_like(got[1]))
    monkeypatch.undo()
    q, pool, table, contiguous = paged_inputs([40, 0, 9], 16, dtype, heads=4, dl=64, dr=16)
    want = mla_decode_reference(q[[0, 2]], contiguous, [0, 2], [40, 9], 0.3, 64)
    got = mla_decode_paged(q, pool, table, torch.tensor([40, 0, 9], dtype=torch.int32, device="cuda"), 16, 0.3, 64,
                           max_length=40, workers=7)
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
