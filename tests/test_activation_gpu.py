"""silu_and_mul kernel against its PyTorch reference on the GPU (``pytest -m gpu``).

Tolerance: kernel and reference compute the same fp32 expression, ``g / (1 + exp(-g)) * u``, and
round it once to the output dtype. The kernel uses the accurate ``expf`` (at most 2 fp32 ulps off),
so its fp32 value differs from PyTorch's by at most a few fp32 ulps (exp's error, then one rounding
each for the add, the divide and the multiply): 4 ulps, 2^-21 relative, bounds the fp32 case.
For fp16/bf16 the two fp32 values, a few fp32 ulps apart, can straddle a rounding boundary of the
output dtype only rarely, and then round to neighbours: one output ulp, at most 2^-p * |reference|
(p = 10 for fp16, 7 for bf16), with values below the smallest normal number held to that number's
ulp. That happens with probability ~ (few fp32 ulps) / 2^(23 - p), so on large inputs we also
require that at most 1 element in 1000 differs at all.
"""
import os

import pytest
import torch

from dsv2_lib.core import kernels
from dsv2_lib.ops.activation import silu_and_mul, silu_and_mul_reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_on")]

ULP = {torch.float32: 2**-21, torch.float16: 2**-10, torch.bfloat16: 2**-7}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
WIDTHS = [1408, 10944, 2816, 1, 7, 33, 1000]  # I: V2-Lite expert, dense layer 0, shared experts, awkward
ROWS = [0, 1, 5, 4096]


def close(a, b, dtype):
    """Within one output ulp of the reference (see the module docstring), and rarely different at all."""
    assert a.shape == b.shape and a.dtype == b.dtype == dtype
    a, b = a.float(), b.float()
    ok = bool(((a - b).abs() <= ULP[dtype] * b.abs().clamp(min=torch.finfo(dtype).tiny)).all())
    if dtype != torch.float32 and b.numel() >= 100_000:
        ok = ok and (a != b).float().mean().item() <= 1e-3
    return ok


def gate_up(rows, i, dtype):
    """Gates spread over where silu bends (±6), up values of either sign."""
    return torch.cat([torch.randn(rows, i, device="cuda") * 3, torch.randn(rows, i, device="cuda")], dim=-1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("i", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_matches_reference(rows, i, dtype):
    x = gate_up(rows, i, dtype)
    out = silu_and_mul(x)
    assert out.shape == (rows, i)
    assert close(out, silu_and_mul_reference(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_hf_math_rounded_once(dtype):
    """The reference is ``F.silu(gate.float()) * up.float()`` rounded once to the dtype."""
    x = gate_up(64, 1408, dtype)
    want = (torch.nn.functional.silu(x[:, :1408].float()) * x[:, 1408:].float()).to(dtype)
    assert torch.equal(silu_and_mul_reference(x), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("extra", [0, 8, 1, 3])
def test_strided_rows(dtype, extra):
    """x = wide[:, :2I]: rows 2I + extra apart. extra 0 and 8 keep 16-byte rows (vector path for
    16-bit types; 8 is a multiple of every vector width), extra 1 and 3 force the scalar path."""
    i = 1408
    wide = torch.randn(37, 2 * i + extra, device="cuda").to(dtype)
    x = wide[:, : 2 * i]
    assert x.stride(0) == 2 * i + extra
    assert close(silu_and_mul(x), silu_and_mul_reference(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_pointer_takes_the_scalar_path(dtype):
    """A view starting one element in is not 16-byte aligned: still right (no misaligned vector load)."""
    base = torch.randn(5 * 2 * 1408 + 1, device="cuda").to(dtype)
    x = base[1:].view(5, 2 * 1408)
    assert x.data_ptr() % 16 != 0
    assert close(silu_and_mul(x), silu_and_mul_reference(x), dtype)


def test_more_dims_and_a_transposed_input():
    """[B, T, 2I] keeps its leading dims; a last dim that is not contiguous is copied first."""
    x = gate_up(6, 1000, torch.bfloat16).view(2, 3, 2000)
    out = silu_and_mul(x)
    assert out.shape == (2, 3, 1000) and close(out, silu_and_mul_reference(x), torch.bfloat16)
    xt = gate_up(66, 4, torch.bfloat16).t()  # [8, 66] with strides (1, 8)
    assert close(silu_and_mul(xt), silu_and_mul_reference(xt), torch.bfloat16)


def test_zero_width_and_many_rows():
    assert silu_and_mul(torch.empty(5, 0, device="cuda")).shape == (5, 0)
    x = gate_up(70_000, 1, torch.bfloat16)  # more rows than gridDim.y could hold: rows go in gridDim.x
    assert close(silu_and_mul(x), silu_and_mul_reference(x), torch.bfloat16)


def test_bad_inputs_are_refused_before_launch():
    with pytest.raises(ValueError, match=r"silu_and_mul input: shape \[4, 7\], expected \[\.\.\., 2I\]"):
        silu_and_mul(torch.randn(4, 7, device="cuda"))
    with pytest.raises(ValueError, match=r"silu_and_mul input: shape \[\], expected"):
        silu_and_mul(torch.tensor(1.0, device="cuda"))
    with pytest.raises(TypeError, match=r"silu_and_mul input: dtype torch.float64 has no kernel"):
        silu_and_mul(torch.randn(4, 8, device="cuda", dtype=torch.float64))
    with pytest.raises(TypeError, match=r"silu_and_mul input: dtype torch.int32 has no kernel"):
        silu_and_mul(torch.ones(4, 8, device="cuda", dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"DSV2_BACKEND=cuda but the tensor is on cpu"):
        silu_and_mul(torch.randn(4, 8))


@pytest.mark.skipif(os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1",
                    reason="capture allocates through PyTorch's caching allocator, which the sanitizer runs switch off")
def test_cuda_graph_capture_and_replay_on_new_inputs():
    """Launches go to the current stream, so a captured graph replays the kernel on fresh data."""
    x = gate_up(16, 1408, torch.bfloat16)
    silu_and_mul(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = silu_and_mul(x)
    for _ in range(3):
        x.copy_(gate_up(16, 1408, torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert close(out, silu_and_mul_reference(x), torch.bfloat16)


def test_auto_backend_uses_the_kernel_for_cuda_tensors(monkeypatch):
    monkeypatch.setenv("DSV2_BACKEND", "auto")
    assert kernels.use_kernels(torch.empty(1, device="cuda"))
