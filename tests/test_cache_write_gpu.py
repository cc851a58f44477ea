"""The cache-write kernel against its reference on the GPU (``pytest -m gpu``): a copy, so equality."""
import pytest
import torch

from dsv2_lib.core import kernels
from dsv2_lib.model.cache import PagedBatch
from dsv2_lib.model.mla import write_latent_cache
from dsv2_lib.ops.cache_write import write_cache_rows, write_cache_rows_reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_on")]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def inputs(R, T, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(R, generator=g)[:T]
    slots[torch.randperm(T, generator=g)[: T // 4]] = -1  # a quarter skipped
    rows = torch.randn(T, D, generator=g).to(dtype).cuda()
    cache = torch.randn(R, D, generator=g).to(dtype).cuda()
    return cache, rows, slots.cuda()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [576, 80])
@pytest.mark.parametrize("T", [1, 5, 1000])
def test_matches_reference(D, T, dtype):
    cache, rows, slots = inputs(1200, T, D, dtype)
    want = cache.clone()
    write_cache_rows_reference(want, rows, slots)
    write_cache_rows(cache, rows, slots)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_and_odd_widths_take_the_element_variant(dtype, monkeypatch):
    names = []
    launch = kernels.KernelFile.launch
    monkeypatch.setattr(kernels.KernelFile, "launch", lambda self, n, *a, **kw: (names.append(n), launch(self, n, *a, **kw)))
    for D, offset in ((7, 0), (576, 1)):  # rows not whole vectors; a cache view starting off a 16-byte boundary
        base, rows, slots = inputs(300, 40, D + offset, dtype, seed=D)
        cache, rows = base[:, offset:], rows[:, offset:]
        want = cache.clone()
        write_cache_rows_reference(want, rows, slots)
        write_cache_rows(cache, rows, slots)
        assert torch.equal(cache, want)
    assert names and all(n.endswith("false>") for n in names)


def test_out_of_range_slots():
    cache, rows, slots = inputs(64, 8, 576, torch.bfloat16)
    with pytest.raises(IndexError, match="slot 64 out of range"):
        write_cache_rows(cache, rows, slots, host_slots=[64] + [-1] * 7)
    with pytest.raises(IndexError, match="slot 64 out of range"):
        write_cache_rows(cache, rows, slots, max_slot=64)  # the largest slot, as a PagedBatch knows it
    with pytest.raises(IndexError, match="out of range"):
        write_cache_rows(cache, rows, torch.tensor([70] + [-1] * 7))  # a host slot_mapping is checked too
    before = cache.clone()
    write_cache_rows(cache, rows, torch.tensor([64, 1000, -1, -5, 2**40, -1, -1, -1], device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(cache, before)  # unknown to the host: the kernel skips them all


def test_write_latent_cache_uses_the_kernel(kernel_launches):
    cache = torch.zeros(8, 576, dtype=torch.bfloat16, device="cuda")
    batch = PagedBatch((0, 0), (2, 1), ((1,), (0,)), 4, (5, -1, 2), device="cuda")
    rows = torch.randn(3, 576, device="cuda").to(torch.bfloat16)
    write_latent_cache(cache, batch, rows)
    assert kernel_launches and torch.equal(cache[5], rows[0]) and torch.equal(cache[2], rows[2])
    untouched = [r for r in range(8) if r not in (5, 2)]
    assert not cache[untouched].any()  # slot -1 wrote nothing, and no other row was written


@pytest.mark.cuda_graph
def test_cuda_graph_capture_and_replay():
    cache, rows, slots = inputs(500, 64, 576, torch.bfloat16)
    write_cache_rows(cache, rows, slots)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_cache_rows(cache, rows, slots)
    for step in range(3):
        rows.copy_(torch.randn_like(rows, dtype=torch.float32).to(rows.dtype))
        slots.copy_(torch.randperm(500, device="cuda")[:64])
        slots[step::7] = -1
        want = cache.clone()
        write_cache_rows_reference(want, rows, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache, want)
