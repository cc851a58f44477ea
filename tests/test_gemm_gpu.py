"""The tiled GEMM kernel against an fp64 reference on the GPU (``pytest -m gpu``).

Tolerance, element by element, with S = |a| @ |b| computed in fp64:

    |kernel - exact| <= 2 * K * 2^-24 * S  +  2^-p * |exact|  +  floor

* fp32 accumulation of K products: each of the K fused multiply-adds rounds once, so the
  accumulated error is at most about K * 2^-24 * S (the classic gamma_K bound; the inputs
  themselves are exact in fp32). A factor 2 leaves room for the rounding order.
* The output is rounded to the dtype: at most half an ulp. With p significant bits (8 for bf16,
  11 for fp16, 24 for fp32) a value x in [2^e, 2^(e+1)) has ulp 2^(e+1-p), so half an ulp is at
  most 2^-p * |x|. The accumulation error can move x across a rounding boundary, which the
  factor 2 on the first term covers.
* floor = 1e-6 * max(S) absorbs fp16 subnormals (values under 6e-5 have a fixed ulp of 2^-24).

For (512, 2048, 576) in bf16 that allows 2.4e-4 * S plus 0.4 % of the value: far below what a
wrong index (an error of order S) would produce.
"""
import os

import pytest
import torch

from dsv2_lib.core import kernels
from dsv2_lib.lessons.gemm import tiled_matmul, tiled_matmul_reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_on")]

P = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 2048, 3072), (512, 2048, 576), (7, 33, 1000), (1000, 7, 33), (0, 8, 8), (8, 0, 8), (8, 8, 0),
          (64, 64, 64), (1, 1, 1), (65, 17, 63), (130, 512, 4096)]  # (M, K, N)


def assert_close(c, a, b):
    exact = a.double() @ b.double()
    s = a.double().abs() @ b.double().abs()
    K = a.shape[1]
    floor = 1e-6 * (s.max().item() if s.numel() else 0.0)
    tol = 2 * K * 2.0**-24 * s + 2.0 ** -P[a.dtype] * exact.abs() + floor
    err = (c.double() - exact).abs()
    assert c.shape == exact.shape and c.dtype == a.dtype
    assert bool((err <= tol).all()), f"max err {err.max().item():.3g}, worst err/tol {(err / tol.clamp(min=1e-30)).max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_tiled_matmul_matches_fp64(shape, dtype):
    M, K, N = shape
    torch.manual_seed(M * 7 + K * 3 + N)
    a = torch.randn(M, K, device="cuda").to(dtype)
    b = (torch.randn(K, N, device="cuda") / max(K, 1) ** 0.5).to(dtype)
    assert_close(tiled_matmul(a, b), a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_the_reference_and_cublas(dtype):
    """The kernel, the reference ((a.float() @ b.float()).to(dtype)) and cuBLAS agree within the bound."""
    a = torch.randn(37, 300, device="cuda").to(dtype)
    b = torch.randn(300, 91, device="cuda").to(dtype)
    assert_close(tiled_matmul(a, b), a, b)
    assert_close(tiled_matmul_reference(a, b), a, b)


def test_k_zero_gives_zeros():
    a, b = torch.empty(5, 0, device="cuda"), torch.empty(0, 9, device="cuda")
    assert torch.equal(tiled_matmul(a, b), torch.zeros(5, 9, device="cuda"))


def test_bad_inputs_are_refused_before_launch():
    a = torch.randn(4, 8, device="cuda")
    with pytest.raises(ValueError, match=r"want 2-D"):
        tiled_matmul(a[0], torch.randn(8, 3, device="cuda"))
    with pytest.raises(TypeError, match=r"a is torch.float32 but b is torch.float16"):
        tiled_matmul(a, torch.randn(8, 3, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match=r"K differs \(8 != 7\)"):
        tiled_matmul(a, torch.randn(7, 3, device="cuda"))
    with pytest.raises(ValueError, match=r"tiled_matmul b: not contiguous"):
        tiled_matmul(a, torch.randn(3, 8, device="cuda").t())
    with pytest.raises(ValueError, match=r"tiled_matmul b: on cpu"):
        tiled_matmul(a, torch.randn(8, 3))
    with pytest.raises(TypeError, match=r"has no kernel"):
        tiled_matmul(a.double(), torch.randn(8, 3, device="cuda", dtype=torch.float64))


@pytest.mark.skipif(os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1",
                    reason="capture allocates through PyTorch's caching allocator, which the sanitizer runs switch off")
def test_cuda_graph_capture_and_replay_on_new_inputs():
    """The launch goes to the current stream, so a captured graph replays the kernel on fresh data."""
    a = torch.randn(64, 2048, device="cuda").to(torch.bfloat16)
    b = (torch.randn(2048, 576, device="cuda") / 2048**0.5).to(torch.bfloat16)
    tiled_matmul(a, b)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c = tiled_matmul(a, b)
    for _ in range(3):
        a.copy_(torch.randn_like(a))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(c, a, b)


def test_auto_backend_uses_the_kernel_for_cuda_tensors(monkeypatch):
    monkeypatch.setenv("DSV2_BACKEND", "auto")
    assert kernels.use_kernels(torch.empty(1, device="cuda"))
