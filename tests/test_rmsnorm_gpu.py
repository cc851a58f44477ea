"""RMSNorm kernels against the PyTorch reference on the GPU (``pytest -m gpu``).

Tolerance: kernel and reference round identically (normalised value n to the dtype, then n * w),
and differ only in the order of the fp32 sum of squares, which moves 1/rms by a few fp32 ulps.
That can flip the rounding of n by one ulp of n, i.e. change the output by up to
ulp(n) * |w| <= 2^-p * |n * w|, and the final rounding adds at most half an output ulp on each
side: so |kernel - reference| <= 2 * 2^-p * |reference| (p = 7 for bf16, 10 for fp16; for fp32,
2e-6 covers a few fp32 ulps of 1/rms). Seen on the H200: a one-ulp flip of n with |w| near 2
exceeds one output ulp, so the bound is two. Values under 1e-3 get that bound at 1e-3.
"""
import pytest
import torch

from dsv2_lib.core import kernels
from dsv2_lib.ops.norm import fused_add_rms_norm, fused_add_rms_norm_reference, rms_norm, rms_norm_reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_on")]

ULP = {torch.float32: 2e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 2048), (7, 2048), (300, 512), (5, 576), (64, 33), (3, 1000), (2, 8), (1, 1), (4, 9000),
          (2, 40000), (0, 2048), (3, 0)]  # 40000: too wide to cache in registers -> scalar path


def close(a, b, dtype):
    """Within two output ulps, relative to each element's magnitude (see the module docstring)."""
    err = (a.float() - b.float()).abs()
    return bool((err <= 2 * ULP[dtype] * b.float().abs().clamp(min=1e-3)).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_reference(shape, dtype):
    x = torch.randn(shape, device="cuda", dtype=dtype) * 3
    w = (1 + 0.5 * torch.randn(shape[-1], device="cuda")).to(dtype)
    assert close(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_on_a_strided_slice(dtype):
    """kv_a_layernorm normalises latent = kv[:, :512] of kv [T, 576]: rows 576 apart, not contiguous."""
    kv = torch.randn(37, 576, device="cuda", dtype=dtype)
    w = torch.randn(512, device="cuda").to(dtype)
    latent = kv[:, :512]
    assert close(rms_norm(latent, w, 1e-6), rms_norm_reference(latent, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset,width", [(0, 576), (1, 577), (0, 40064)])  # vectors; misaligned; too wide to cache
def test_rms_norm_in_place_on_a_strided_slice(dtype, offset, width):
    """MLA's latent is normalised inside kv [T, 576]: its rows are overwritten, the other columns untouched
    (offset 1 starts the rows off a 16-byte boundary: the element variant; 40,000 wide: the two-pass one)."""
    d = width - 64 - offset
    kv = torch.randn(37, width, device="cuda", dtype=dtype) * 3
    w = (1 + 0.5 * torch.randn(d, device="cuda")).to(dtype)
    before = kv.clone()
    latent = kv[:, offset: offset + d]
    want = rms_norm_reference(latent, w, 1e-6)
    assert rms_norm(latent, w, 1e-6, in_place=True) is latent
    assert close(latent, want, dtype)
    assert torch.equal(kv[:, :offset], before[:, :offset]) and torch.equal(kv[:, offset + d:], before[:, offset + d:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm_matches_reference(shape, dtype):
    x = torch.randn(shape, device="cuda", dtype=dtype)
    res = torch.randn(shape, device="cuda", dtype=dtype)
    w = torch.randn(shape[-1], device="cuda").to(dtype)
    want_out, want_res = fused_add_rms_norm_reference(x, res, w, 1e-6)
    out, new_res = fused_add_rms_norm(x, res.clone(), w, 1e-6)
    assert torch.equal(new_res, want_res)  # the add is one rounding in both
    assert close(out, want_out, dtype)


def test_unaligned_pointer_takes_the_scalar_path():
    """A view starting one element in is not 16-byte aligned: still correct (no misaligned vector load)."""
    base = torch.randn(4 * 2048 + 1, device="cuda", dtype=torch.bfloat16)
    x = base[1:].view(4, 2048)
    w = torch.randn(2048, device="cuda").to(torch.bfloat16)
    assert close(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), torch.bfloat16)


def test_bad_inputs_are_refused_before_launch():
    x = torch.randn(4, 64, device="cuda")
    with pytest.raises(ValueError, match=r"rms_norm weight: shape \[63\], expected \[64\]"):
        rms_norm(x, torch.ones(63, device="cuda"), 1e-6)
    with pytest.raises(TypeError, match=r"rms_norm weight: dtype torch.float16, expected torch.float32"):
        rms_norm(x, torch.ones(64, device="cuda", dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match=r"rms_norm weight: on cpu"):
        rms_norm(x, torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match=r"fused_add_rms_norm residual: shape \[4, 32\], expected \[4, 64\]"):
        fused_add_rms_norm(x, torch.ones(4, 32, device="cuda"), torch.ones(64, device="cuda"), 1e-6)
    with pytest.raises(ValueError, match=r"x and residual are the same tensor"):
        fused_add_rms_norm(x, x, torch.ones(64, device="cuda"), 1e-6)
    with pytest.raises(TypeError, match=r"has no kernel"):
        rms_norm(x.double(), torch.ones(64, device="cuda", dtype=torch.float64), 1e-6)


@pytest.mark.cuda_graph
def test_cuda_graph_capture_and_replay_on_new_inputs():
    """Launches go to the current stream, so a captured graph replays the kernel on fresh data."""
    x = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.randn(2048, device="cuda").to(torch.bfloat16)
    rms_norm(x, w, 1e-6)  # compile outside the capture
    fused_add_rms_norm(x, res.clone(), w, 1e-6)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rms_norm(x, w, 1e-6)
        out2, _ = fused_add_rms_norm(x, res, w, 1e-6)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        before = res.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert close(out, rms_norm_reference(x, w, 1e-6), torch.bfloat16)
        assert close(out2, fused_add_rms_norm_reference(x, before, w, 1e-6)[0], torch.bfloat16)


def test_auto_backend_uses_the_kernel_for_cuda_tensors(monkeypatch):
    monkeypatch.setenv("DSV2_BACKEND", "auto")
    assert kernels.use_kernels(torch.empty(1, device="cuda")) and not kernels.use_kernels(torch.empty(1))
    monkeypatch.setenv("DSV2_BACKEND", "torch")
    assert not kernels.use_kernels(torch.empty(1, device="cuda"))
