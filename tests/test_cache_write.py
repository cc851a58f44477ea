"""The cache write (chapter 12) on the CPU: the reference's semantics, the wrapper's fallback, and a
lane-by-lane emulation of ``kernels_cu/cache.cu``'s index mapping (one warp per token, lane i
copying chunks i, i + 32, ... of 16 bytes or of one element)."""
import numpy as np
import pytest
import torch

from dsv2_lib.ops.cache_write import WARPS, write_cache_rows, write_cache_rows_reference


def emulate_write(cache, rows, slot_mapping, vec_elems):
    """The kernel over its grid (ceil(T / WARPS) blocks of WARPS warps) on numpy arrays, in place;
    ``vec_elems`` = values per chunk (16 bytes / itemsize for VEC = true, 1 for VEC = false).
    Returns how often each cache element was written (every kept row's elements exactly once)."""
    T, D = rows.shape
    R = cache.shape[0]
    writes = np.zeros(cache.shape, dtype=int)
    for block in range(-(-T // WARPS)):
        for warp in range(WARPS):
            t = block * WARPS + warp
            if t >= T:
                continue
            slot = slot_mapping[t]
            if slot < 0 or slot >= R:
                continue
            nchunks = D // vec_elems
            for lane in range(32):
                for i in range(lane, nchunks, 32):
                    sl = slice(i * vec_elems, (i + 1) * vec_elems)
                    cache[slot, sl] = rows[t, sl]
                    writes[slot, sl] += 1
    return writes


@pytest.mark.parametrize("D,vec", [(576, 8), (576, 4), (80, 8), (80, 1), (7, 1), (1, 1)])
def test_emulated_kernel_matches_the_reference(D, vec):
    rng = np.random.default_rng(D)
    R, T = 50, 23
    slots = rng.permutation(R)[:T].astype(np.int64)
    slots[[0, 5, 22]] = -1  # skipped tokens, among them the last of a partial block
    rows = rng.standard_normal((T, D))
    want = torch.zeros(R, D, dtype=torch.float64)
    write_cache_rows_reference(want, torch.from_numpy(rows), torch.from_numpy(slots))
    got = np.zeros((R, D))
    writes = emulate_write(got, rows, slots, vec)
    assert np.array_equal(got, want.numpy())
    kept = slots[slots >= 0]
    assert (writes[kept] == 1).all() and writes.sum() == len(kept) * D


def test_emulated_kernel_never_writes_outside_the_cache():
    cache = np.zeros((4, 16))
    writes = emulate_write(cache, np.ones((3, 16)), np.array([4, -1, 100]), 8)
    assert not writes.any() and not cache.any()


def test_cpu_tensors_take_the_reference_and_skip_minus_one():
    cache = torch.zeros(6, 5, dtype=torch.bfloat16)
    rows = torch.arange(15, dtype=torch.bfloat16).view(3, 5)
    write_cache_rows(cache, rows, torch.tensor([4, -1, 0]))
    assert torch.equal(cache[4], rows[0]) and torch.equal(cache[0], rows[2])
    assert cache[1:4].abs().sum() == 0 and cache[5].abs().sum() == 0


def test_reference_refuses_a_slot_past_the_cache():
    with pytest.raises(IndexError):
        write_cache_rows(torch.zeros(4, 3), torch.ones(1, 3), torch.tensor([4]))
