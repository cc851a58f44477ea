"""The fused latent-rows kernel against the three kernels it replaces, on the GPU (``pytest -m gpu``).

Tolerance: none. ``latent_rows`` normalises with rmsnorm.cuh's helpers over one warp, as ``rms_norm``'s
32-thread block does, rotates with rope.cuh's ``rotate_vec``, and copies: every stored value must be
bit-identical to ``rms_norm`` (in place) + ``apply_rope_`` + ``write_cache_rows``.
"""
import pytest
import torch

from dsv2_lib.core.config import DEEPSEEK_V2_LITE
from dsv2_lib.model.cache import PagedBatch
from dsv2_lib.ops.cache_write import write_cache_rows
from dsv2_lib.ops.latent_rows import fused_applies, latent_rows_
from dsv2_lib.ops.norm import rms_norm
from dsv2_lib.ops.rope import apply_rope_, rope_cos_sin_cache

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_on")]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
P = 4096


@pytest.fixture(scope="module")
def table():
    return rope_cos_sin_cache(DEEPSEEK_V2_LITE, P, "cuda")


def case(T, h, R, d, dtype, rows=600, seed=0):
    """q [T, h, 128 + d] (q_pe a view, as in MLA.forward), kv [T, R + d], a norm weight, positions, a cache
    and slots (a quarter -1), like one layer of one step."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, h, 128 + d, generator=g) * 4).to(dtype).cuda()
    kv = (torch.randn(T, R + d, generator=g) * 3).to(dtype).cuda()
    w = (1 + 0.2 * torch.randn(R, generator=g)).to(dtype).cuda()
    pos = torch.randint(0, P, (T,), generator=g)
    if T >= 2:
        pos[:2] = torch.tensor([P - 1, 0])
    slots = torch.randperm(rows, generator=g)[:T]
    slots[torch.randperm(T, generator=g)[: T // 4]] = -1
    cache = torch.randn(rows, R + d, generator=g).to(dtype).cuda()
    return q, kv, w, pos.cuda(), cache, slots.cuda()


def three_kernels(q_pe, kv, w, pos, table, cache, slots, R):
    rms_norm(kv[:, :R], w, 1e-6, in_place=True)
    apply_rope_(q_pe, kv[:, R:], pos, table, max_position=P - 1)
    write_cache_rows(cache, kv, slots, max_slot=cache.shape[0] - 1)


SHAPES = [(1, 16, 512), (5, 16, 512), (300, 16, 512), (3, 1, 512), (7, 3, 64)]


@pytest.mark.parametrize("T, h, R, dtype", [(*s, t) for s in SHAPES for t in DTYPES]
                         + [(2, 16, 1024, t) for t in (torch.float16, torch.bfloat16)])  # the widest latent one warp holds
def test_bit_identical_to_the_three_kernels(T, h, R, dtype, table):
    d = 64
    q, kv, w, pos, cache, slots = case(T, h, R, d, dtype, seed=T + h)
    want_q, want_kv, want_cache = q.clone(), kv.clone(), cache.clone()
    three_kernels(want_q[..., 128:], want_kv, w, pos, table, want_cache, slots, R)
    assert fused_applies(kv, q[..., 128:], w, cache)
    latent_rows_(kv, q[..., 128:], w, 1e-6, pos, table, cache, slots, max_position=P - 1, max_slot=cache.shape[0] - 1)
    assert torch.equal(kv, want_kv) and torch.equal(q, want_q) and torch.equal(cache, want_cache)
    assert not torch.equal(cache, case(T, h, R, d, dtype, seed=T + h)[4])  # rows were written


@pytest.mark.parametrize("dtype", DTYPES)
def test_positions_and_slots_the_host_did_not_check(dtype, table):
    """As in a CUDA graph: a position outside the table gives NaN rows (as rope does) and a slot < 0 or
    past the cache writes nothing (as write_cache_rows does); nothing is read or written outside."""
    q, kv, w, pos, cache, slots = case(4, 16, 512, 64, dtype, rows=64)
    pos[:] = torch.tensor([P, -1, 5, 6])
    slots[:] = torch.tensor([64, -1, 3, 2**40])
    before = cache.clone()
    latent_rows_(kv, q[..., 128:], w, 1e-6, pos, table, cache, slots, max_position=0, max_slot=0)
    torch.cuda.synchronize()
    assert q[:2, :, 128:].isnan().all() and kv[:2, 512:].isnan().all() and not q[2:].isnan().any()
    changed = (cache != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [3] and torch.equal(cache[3], kv[2])


def test_what_the_kernel_refuses(table):
    q, kv, w, pos, cache, slots = case(4, 16, 512, 64, torch.bfloat16, rows=64)
    with pytest.raises(IndexError, match=f"positions up to {P}"):
        latent_rows_(kv, q[..., 128:], w, 1e-6, pos, table, cache, slots, max_position=P, max_slot=63)
    with pytest.raises(IndexError, match="slot 64 out of range: the cache has 64 rows"):
        latent_rows_(kv, q[..., 128:], w, 1e-6, pos, table, cache, slots, max_position=P - 1, max_slot=64)
    with pytest.raises(TypeError, match="latent_rows positions: dtype torch.int32"):
        latent_rows_(kv, q[..., 128:], w, 1e-6, pos.int(), table, cache, slots, max_position=P - 1, max_slot=63)
    # what one warp cannot hold, or 16-byte vectors cannot read, is left to the three ops
    for dtype, R in ((torch.bfloat16, 2048), (torch.float32, 1024)):  # 256 vectors: more than 32 lanes x ROW_VECS
        q32, kv32, w32, _, cache32, _ = case(4, 16, R, 64, dtype, rows=8)
        assert not fused_applies(kv32, q32[..., 128:], w32, cache32)
    odd = torch.zeros(4, 577, dtype=torch.bfloat16, device="cuda")[:, 1:]
    assert not fused_applies(odd, q[..., 128:], w, cache)
    assert not fused_applies(kv, q[..., 128:], w.float(), cache)
    with pytest.raises(ValueError, match="need the three separate ops"):
        latent_rows_(odd, q[..., 128:], w, 1e-6, pos, table, cache, slots, max_position=P - 1, max_slot=63)


def test_the_model_takes_one_launch_per_layer(kernel_launches):
    """MLA.cache_rows on a paged bf16 cache: one kernel launch, and the rows the three ops would write."""
    from dsv2_lib.core.config import TINY
    from dsv2_lib.core.dtypes import default_dtype
    from dsv2_lib.model.mla import MLA

    with default_dtype(torch.bfloat16):
        mla = MLA(TINY).cuda()
    torch.nn.init.normal_(mla.kv_a_layernorm.weight, 1.0, 0.1)
    batch = PagedBatch((0, 5), (2, 1), ((1,), (0,)), 8, (8, 9, 5), device="cuda")
    kv = torch.randn(3, TINY.cache_row_dim, device="cuda").to(torch.bfloat16)
    q_pe = torch.randn(3, TINY.num_attention_heads, TINY.qk_rope_head_dim, device="cuda").to(torch.bfloat16)
    cache = torch.zeros(16, TINY.cache_row_dim, dtype=torch.bfloat16, device="cuda")
    want_kv, want_q, want_cache = kv.clone(), q_pe.clone(), cache.clone()
    R, table = TINY.kv_lora_rank, rope_cos_sin_cache(TINY, 16, "cuda")
    rms_norm(want_kv[:, :R], mla.kv_a_layernorm.weight, 1e-6, in_place=True)
    apply_rope_(want_q, want_kv[:, R:], batch.positions("cuda"), table, max_position=5)
    write_cache_rows(want_cache, want_kv, batch.slot_mapping, max_slot=9)
    kernel_launches.clear()
    mla.cache_rows(kv, q_pe, batch.positions("cuda"), table, batch, cache)
    assert len(kernel_launches) == 1
    assert torch.equal(kv, want_kv) and torch.equal(q_pe, want_q) and torch.equal(cache, want_cache)
