"""Sizing the paged KV cache from the GPU's memory (``gpu_memory_utilization``), tested on the CPU with
torch.cuda's memory queries replaced: the byte count, the activation reserve, whole blocks, and the
clear errors (too small a pool, the CPU, together with kv_cache_mib, no token budget, bad fractions)."""
import re

import pytest
import torch

from dsv2_lib import LLM
from dsv2_lib.core.config import DEEPSEEK_V2_LITE, TINY
from dsv2_lib.model.cache import PagedLatentCache, block_bytes

MIB = 2**20


def test_pool_bytes():
    assert PagedLatentCache.pool_bytes(1000, 900, 300, 0.9, 100) == 500  # 0.9 x 1000 - 300 - 100
    assert PagedLatentCache.pool_bytes(1000, 400, 300, 0.9, 100) == 300  # another process holds memory
    assert PagedLatentCache.pool_bytes(1000, 900, 300, 0.3, 100) == -100  # nothing left


def test_activation_reserve_grows_with_the_budget():
    r = PagedLatentCache.activation_reserve
    assert r(TINY, torch.float32, 16, 64) < r(TINY, torch.float32, 32, 64) < r(TINY, torch.float32, 32, 128)
    # V2-Lite, bf16, the default budget and the full context: about 7.9 GiB, most of it the logits
    lite = r(DEEPSEEK_V2_LITE, torch.bfloat16, 8192, 163840)
    assert 7.8 * 2**30 < lite < 8.0 * 2**30
    assert 8192 * DEEPSEEK_V2_LITE.vocab_size * 6 > lite / 2


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU of 1 GiB total, 900 MiB free, torch holding 100 MiB."""
    class Props:
        total_memory = 1024 * MIB
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (900 * MIB, 1024 * MIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 100 * MIB)


def test_from_gpu_memory_rounds_down_to_whole_blocks(fake_gpu):
    reserve = PagedLatentCache.activation_reserve(TINY, torch.float32, 64, 256)
    pool = int(0.5 * 1024 * MIB) - 100 * MIB - reserve
    cache = PagedLatentCache.from_gpu_memory(TINY, torch.float32, "cpu", 16, 256, 0.5, 64)
    assert cache.num_blocks == pool // block_bytes(TINY, torch.float32, 16) > 0
    assert cache.max_len == 256 and cache.rows.shape[1] == cache.num_blocks * 16


def test_too_small_a_pool_is_a_clear_error(fake_gpu):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.1 leaves the KV cache -?\d+\.\d MiB = 0 blocks "
                                         r"of 16 tokens .*one request of max_model_len 256 tokens needs 16 blocks"):
        PagedLatentCache.from_gpu_memory(TINY, torch.float32, "cpu", 16, 256, 0.1, 64)


@pytest.mark.parametrize("kwargs, message", [
    (dict(gpu_memory_utilization=0.9), "gpu_memory_utilization sizes the KV cache from a GPU's memory, but the "
                                       "device is cpu; use kv_cache_mib there"),
    (dict(gpu_memory_utilization=0.9, kv_cache_mib=4.0), "give kv_cache_mib (4.0) or gpu_memory_utilization (0.9), "
                                                         "not both"),
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization must be a fraction in (0, 1], got 0.0"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be a fraction in (0, 1], got 1.5"),
    (dict(gpu_memory_utilization="0.9"), "gpu_memory_utilization must be a fraction in (0, 1], got '0.9'"),
])
def test_bad_uses_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM("tiny", device="cpu", **kwargs)


def test_no_budget_is_refused():
    with pytest.raises(ValueError, match="gpu_memory_utilization needs max_num_batched_tokens"):
        LLM("tiny", device="cuda", gpu_memory_utilization=0.9, max_num_batched_tokens=None)
