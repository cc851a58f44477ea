"""Chapter 10's uniform split-KV kernel (``dsv2_lib/lessons/mla_decode_split.py``) against the reference on
the GPU (``pytest -m gpu``): over a contiguous cache, and (``PAGED = true``) over the paged one, where on the
same rows, splits and depth it must equal the contiguous kernel bit for bit. The tolerance is
``test_mla_decode_gpu.py``'s (4u · max|latent|; fp32 caches take the reference and are equal).
"""
import pytest
import torch
from test_mla_decode_gpu import DTYPES, LENGTHS, close, make_inputs, paged_inputs

from dsv2_lib.lessons.mla_decode_split import (
    mla_decode,
    mla_decode_counters,
    mla_decode_paged_uniform,
    mla_decode_workspace,
)
from dsv2_lib.ops.mla_decode import STAGES, mla_decode_paged_reference, mla_decode_reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_on")]

LITE = (16, 512, 64)  # heads, kv_lora_rank, rope dim of DeepSeek-V2-Lite


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


# ---- the same kernel over the paged cache (PAGED = true): chapter 13's uniform splits -----------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda l: "-".join(map(str, l)))
def test_paged_equals_contiguous_kernel_on_the_same_rows(lengths, block_size, dtype):
    q, pool, table, contiguous = paged_inputs(lengths, block_size, dtype)
    B = len(lengths)
    want = mla_decode_reference(q, contiguous, range(B), lengths, 0.1147, 512)
    for num_splits, stages, fused in ((1, 2, False), (3, 3, False), (3, 4, True), (2, 5, True), (None, None, None)):
        kw = dict(num_splits=num_splits, stages=stages, fused=fused)
        got = mla_decode_paged_uniform(q, pool, table, lengths, block_size, 0.1147, 512, **kw)
        same = mla_decode(q, contiguous, list(range(B)), lengths, 0.1147, 512, **kw)
        if num_splits is not None:  # same splits and depth: the same arithmetic on the same rows
            assert torch.equal(got, same), (num_splits, stages, fused)
        assert close(got, want, pool, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("stages", STAGES)
def test_paged_other_shapes_and_reference(stages, dtype):
    lengths = [1, 15, 16, 17, 100]
    q, pool, table, contiguous = paged_inputs(lengths, 16, dtype, heads=20, dl=64, dr=16)
    got = mla_decode_paged_uniform(q, pool, table, lengths, 16, 0.3, 64, num_splits=2, stages=stages)
    want = mla_decode_paged_reference(q, pool, table, lengths, 16, 0.3, 64)
    assert close(got, want, pool, dtype)
    assert torch.equal(got, mla_decode(q, contiguous, list(range(5)), lengths, 0.3, 64, num_splits=2, stages=stages))


def test_paged_bad_table_entries_read_zero_rows():
    q, pool, table, _ = paged_inputs([40, 20], 16, torch.bfloat16)
    table[0, 1] = -1                      # a hole inside a context
    table[1, 0] = pool.shape[0] // 16 + 5  # a block past the pool
    want = mla_decode_paged_reference(q, pool, table, [40, 20], 16, 0.1147, 512)
    got = mla_decode_paged_uniform(q, pool, table, [40, 20], 16, 0.1147, 512, num_splits=2)
    assert close(got, want, pool, torch.bfloat16)
    with pytest.raises(ValueError, match="length 49 outside 1..48"):
        mla_decode_paged_uniform(q, pool, table, [49, 20], 16, 0.1147, 512)
    lengths = torch.tensor([400, 20], dtype=torch.int32, device="cuda")  # clamped to max_length on the device
    got = mla_decode_paged_uniform(q, pool, table, lengths, 16, 0.1147, 512, max_length=40, num_splits=1)
    assert close(got, want, pool, torch.bfloat16)


@pytest.mark.cuda_graph
def test_paged_cuda_graph_capture_and_replay():
    q, pool, table, _ = paged_inputs([900, 5, 300], 16, torch.bfloat16)
    lengths = torch.tensor([900, 5, 300], dtype=torch.int32, device="cuda")
    out = torch.empty(3, 16, 512, device="cuda")
    kw = dict(max_length=900, workspace=mla_decode_workspace(3, 16, 64, 512, "cuda"), num_splits=6,
              counters=mla_decode_counters(3, 16, "cuda"), fused=True, stages=4, out=out)
    mla_decode_paged_uniform(q, pool, table, lengths, 16, 0.1147, 512, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode_paged_uniform(q, pool, table, lengths, 16, 0.1147, 512, **kw)
    for step in range(3):
        pool.copy_(torch.randn(pool.shape, device="cuda").to(pool.dtype))
        table.copy_(table[:, torch.randperm(table.shape[1], device="cuda")].roll(1, 0))  # new tables, same pool
        lengths.copy_(torch.tensor([900 - step, 5 + 100 * step, 1 + step], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = mla_decode_paged_reference(q, pool, table, lengths, 16, 0.1147, 512)
        assert close(out, want, pool, torch.bfloat16)
