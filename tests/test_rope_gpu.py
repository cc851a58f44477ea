"""The RoPE kernel against the PyTorch reference on the GPU (``pytest -m gpu``).

Tolerance: none; results must be bit-identical. Both read the same fp32 cos/sin values from the
same table, both compute ``a·cos - b·sin`` and ``a·sin + b·cos`` as two fp32 products and one fp32
sum each, rounded to nearest (the kernel uses ``__fmul_rn``/``__fadd_rn``/``__fsub_rn``, which the
compiler never fuses into an FMA; PyTorch's eager ops are separate kernels), and both round the
result once to the tensor's dtype, to nearest even.
"""
import os

import pytest
import torch

from dsv2_lib.core.config import DEEPSEEK_V2_LITE
from dsv2_lib.ops.rope import apply_rope_, apply_rope_reference_, rope_cos_sin_cache

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_on")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
P = DEEPSEEK_V2_LITE.max_position_embeddings  # 163840


@pytest.fixture(scope="module")
def table():
    return rope_cos_sin_cache(DEEPSEEK_V2_LITE, P, "cuda")


def random_positions(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, P, (T,), generator=g)
    if T >= 5:
        pos[:5] = torch.tensor([P - 1, 0, 7, 7, P - 1])  # the largest position, and repeats
    return pos.cuda()


def model_views(T, h, dtype):
    """q [T, h, 192] and kv_a's output [T, 576] with q_pe, k_pe views exactly as MLA.forward has them."""
    q = (torch.randn(T, h, 192, device="cuda") * 4).to(dtype)
    kv = (torch.randn(T, 576, device="cuda") * 4).to(dtype)
    return q, kv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [16, 1, 3])
@pytest.mark.parametrize("T", [0, 1, 5, 4096])
def test_strided_views_as_in_the_model(T, h, dtype, table):
    q, kv = model_views(T, h, dtype)
    pos = random_positions(T)
    want_q, want_kv = q.clone(), kv.clone()
    apply_rope_reference_(want_q[..., 128:], want_kv[:, 512:], pos, table)
    apply_rope_(q[..., 128:], kv[:, 512:], pos, table, max_position=P - 1)
    assert torch.equal(q, want_q) and torch.equal(kv, want_kv)  # rotated parts equal, the rest untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [16, 1, 3])
@pytest.mark.parametrize("T", [1, 5, 4096])
def test_contiguous_inputs(T, h, dtype, table):
    q_pe = torch.randn(T, h, 64, device="cuda").to(dtype)
    k_pe = torch.randn(T, 64, device="cuda").to(dtype)
    pos = random_positions(T, seed=1)
    want_q, want_k = q_pe.clone(), k_pe.clone()
    apply_rope_reference_(want_q, want_k, pos, table)
    apply_rope_(q_pe, k_pe, pos, table)  # max_position read from the GPU
    assert torch.equal(q_pe, want_q) and torch.equal(k_pe, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_views_take_the_scalar_path(dtype, table):
    """Views starting one element in: not 16-byte aligned, still exact (no misaligned vector access)."""
    T, h = 37, 3
    qbase = torch.randn(T * h * 66 + 1, device="cuda").to(dtype)
    kbase = torch.randn(T * 70 + 2, device="cuda").to(dtype)
    q_pe = qbase[1:].view(T, h, 66)[..., 2:]  # head stride 66, offset 3
    k_pe = kbase[2:].view(T, 70)[:, 6:]
    pos = random_positions(T, seed=2)
    want_q, want_k = q_pe.clone(), k_pe.clone()
    apply_rope_reference_(want_q, want_k, pos, table)
    apply_rope_(q_pe, k_pe, pos, table, max_position=P - 1)
    assert torch.equal(q_pe, want_q) and torch.equal(k_pe, want_k)


def test_other_rope_widths(table):
    """d = 16 with a 16-wide table (TINY's rope dim): vector and scalar paths both index the table by d."""
    from dsv2_lib.core.config import TINY

    small = rope_cos_sin_cache(TINY, 100, "cuda")
    d = TINY.qk_rope_head_dim
    for dtype in DTYPES:
        q_pe, k_pe = torch.randn(9, 2, d, device="cuda").to(dtype), torch.randn(9, d, device="cuda").to(dtype)
        pos = torch.randint(0, 100, (9,), device="cuda")
        want_q, want_k = q_pe.clone(), k_pe.clone()
        apply_rope_reference_(want_q, want_k, pos, small)
        apply_rope_(q_pe, k_pe, pos, small, max_position=99)
        assert torch.equal(q_pe, want_q) and torch.equal(k_pe, want_k)


def test_a_position_outside_the_table_is_never_read(table):
    """The caller's bound was wrong: that token becomes NaN, the others are exact, nothing is read out of bounds."""
    small = table[:1000]
    q_pe, k_pe = torch.randn(4, 16, 64, device="cuda"), torch.randn(4, 64, device="cuda")
    pos = torch.tensor([5, 1000, -3, 999], device="cuda")
    ok = torch.tensor([0, 3], device="cuda")
    wq, wk = q_pe[ok], k_pe[ok]  # copies of the two valid tokens
    apply_rope_reference_(wq, wk, pos[ok], small)
    apply_rope_(q_pe, k_pe, pos, small, max_position=999)  # a wrong bound: only the kernel's guard is left
    assert torch.equal(q_pe[ok], wq) and torch.equal(k_pe[ok], wk)
    assert bool(q_pe[1:3].isnan().all()) and bool(k_pe[1:3].isnan().all())


def test_bad_inputs_are_refused_before_launch(table):
    q_pe, k_pe = torch.randn(4, 16, 64, device="cuda"), torch.randn(4, 64, device="cuda")
    pos = torch.arange(4, device="cuda")
    with pytest.raises(IndexError, match=r"positions up to 163840, the cos/sin cache holds 0\.\.163839"):
        apply_rope_(q_pe, k_pe, pos, table, max_position=P)
    with pytest.raises(TypeError, match=r"rope positions: dtype torch.int32, expected torch.int64"):
        apply_rope_(q_pe, k_pe, pos.int(), table, max_position=3)
    with pytest.raises(ValueError, match=r"rope k_pe: shape \[4, 32\], expected \[4, 64\]"):
        apply_rope_(q_pe, k_pe[:, :32], pos, table, max_position=3)
    with pytest.raises(TypeError, match=r"rope k_pe: dtype torch.float16, expected torch.float32"):
        apply_rope_(q_pe, k_pe.half(), pos, table, max_position=3)
    with pytest.raises(ValueError, match=r"rope q_pe: shape \[4, 1024\], expected \[\*, \*, \*\]"):
        apply_rope_(q_pe.view(4, -1), k_pe, pos, table, max_position=3)
    with pytest.raises(ValueError, match=r"rope cache: shape \[163840, 64\], expected \[\*, 32\]"):
        apply_rope_(q_pe[..., :32], k_pe[:, :32], pos, table, max_position=3)
    with pytest.raises(ValueError, match=r"must be even and dense"):
        apply_rope_(q_pe[..., ::2], k_pe[:, ::2], pos, table[:, :32].contiguous(), max_position=3)
    with pytest.raises(ValueError, match=r"rope positions: on cpu"):
        apply_rope_(q_pe, k_pe, pos.cpu(), table, max_position=3)


@pytest.mark.skipif(os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1",
                    reason="capture allocates through PyTorch's caching allocator, which the sanitizer runs switch off")
@pytest.mark.cuda_graph
def test_cuda_graph_capture_and_replay_on_new_inputs(table):
    q, kv = model_views(8, 16, torch.bfloat16)
    pos = random_positions(8)
    apply_rope_(q[..., 128:], kv[:, 512:], pos, table, max_position=P - 1)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_rope_(q[..., 128:], kv[:, 512:], pos, table, max_position=P - 1)
    for seed in range(3):
        q.copy_(torch.randn_like(q))
        kv.copy_(torch.randn_like(kv))
        pos.copy_(random_positions(8, seed=seed + 10))
        want_q, want_kv = q.clone(), kv.clone()
        apply_rope_reference_(want_q[..., 128:], want_kv[:, 512:], pos, table)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(q, want_q) and torch.equal(kv, want_kv)
