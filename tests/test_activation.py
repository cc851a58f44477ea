"""silu_and_mul's reference on the CPU: the definition, one rounding, odd widths refused; and the
fused MLP equals the unfused ``down(silu(gate(x)) * up(x))``."""
import pytest
import torch
import torch.nn.functional as F

from dsv2_lib.core.dtypes import default_dtype
from dsv2_lib.model.mlp import MLP
from dsv2_lib.ops.activation import silu_and_mul, silu_and_mul_reference


def test_reference_definition_fp64():
    x = torch.randn(5, 3, 14, dtype=torch.float64) * 4
    g, u = x[..., :7], x[..., 7:]
    torch.testing.assert_close(silu_and_mul_reference(x), g / (1 + torch.exp(-g)) * u, rtol=1e-15, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_rounds_once(dtype):
    """16-bit inputs: computed in fp32, one rounding at the end (more accurate than two)."""
    x = (torch.randn(300, 2 * 64) * 3).to(dtype)
    out = silu_and_mul_reference(x)
    assert out.dtype == dtype
    assert torch.equal(out, (F.silu(x[:, :64].float()) * x[:, 64:].float()).to(dtype))
    exact = F.silu(x[:, :64].double()) * x[:, 64:].double()
    twice = F.silu(x[:, :64]) * x[:, 64:]  # rounds silu to the dtype, then the product again
    assert (out.double() - exact).abs().sum() < (twice.double() - exact).abs().sum()


def test_cpu_dispatch_takes_the_reference():
    x = torch.randn(3, 10)
    assert torch.equal(silu_and_mul(x), silu_and_mul_reference(x))
    assert silu_and_mul(torch.empty(0, 10)).shape == (0, 5)
    assert silu_and_mul(torch.empty(4, 0)).shape == (4, 0)


@pytest.mark.parametrize("shape", [(4, 7), (9,), ()])
def test_odd_or_missing_last_dim_refused(shape):
    with pytest.raises(ValueError, match=r"silu_and_mul input: shape .* expected \[\.\.\., 2I\] = \[gate \| up\]"):
        silu_and_mul_reference(torch.zeros(shape))


def test_fused_mlp_equals_two_projections():
    """gate_up_proj.weight = [gate; up]: one GEMM then silu_and_mul is the textbook SwiGLU."""
    torch.manual_seed(0)
    with default_dtype(torch.float64):
        mlp = MLP(16, 24)
    for p in mlp.parameters():
        p.copy_(torch.randn_like(p))
    assert mlp.gate_up_proj.weight.shape == (48, 16) and mlp.down_proj.weight.shape == (16, 24)
    gate, up = mlp.gate_up_proj.weight[:24], mlp.gate_up_proj.weight[24:]
    x = torch.randn(11, 16, dtype=torch.float64)
    want = (F.silu(x @ gate.T) * (x @ up.T)) @ mlp.down_proj.weight.T
    torch.testing.assert_close(mlp(x), want, rtol=1e-12, atol=1e-12)
