"""The tiled GEMM's dispatch and reference on the CPU: CPU tensors take the reference
``(a.float() @ b.float()).to(dtype)``; malformed inputs are refused on every backend."""
import pytest
import torch

from dsv2_lib.lessons.gemm import tiled_matmul, tiled_matmul_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_cpu_takes_the_reference(dtype):
    a, b = torch.randn(7, 33).to(dtype), torch.randn(33, 10).to(dtype)
    c = tiled_matmul(a, b)
    assert c.dtype == dtype and c.shape == (7, 10)
    assert torch.equal(c, tiled_matmul_reference(a, b))
    wide = torch.promote_types(dtype, torch.float32)
    assert torch.equal(c, (a.to(wide) @ b.to(wide)).to(dtype))


def test_reference_is_fp32_accumulation_rounded_once():
    """bf16 inputs: the sum is exact in fp32 here (small integers), then rounded once to bf16."""
    a = torch.full((1, 300), 1.0, dtype=torch.bfloat16)
    b = torch.full((300, 1), 1.0, dtype=torch.bfloat16)
    assert tiled_matmul_reference(a, b).item() == 300.0  # a bf16 running sum would stall at 256


def test_empty_and_k_zero():
    assert tiled_matmul(torch.empty(0, 4), torch.empty(4, 3)).shape == (0, 3)
    assert torch.equal(tiled_matmul(torch.empty(2, 0), torch.empty(0, 3)), torch.zeros(2, 3))


def test_bad_inputs_are_refused():
    a = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"want 2-D a \[M, K\] and b \[K, N\], got shapes \[8\] and \[8, 3\]"):
        tiled_matmul(a[0], torch.randn(8, 3))
    with pytest.raises(TypeError, match=r"a is torch.float32 but b is torch.bfloat16"):
        tiled_matmul(a, torch.randn(8, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"K differs \(8 != 7\)"):
        tiled_matmul(a, torch.randn(7, 3))
