"""Dense GEMVs (dsv2_lib/gemv.py: the MoE GEMV kernels with one expert) against F.linear and the MLP on
the GPU (``pytest -m gpu``).

Tolerance: kernel and cuBLAS both accumulate in fp32 and round once (linear), or at the same points
(swiglu: gate|up output, SwiGLU output, down output); they differ only in the order of the fp32 sums,
which can flip an intermediate's rounding by one ulp of its dtype. So |kernel - reference| <= 4 ulp
times the row's largest |reference| (ulp = 2^-8 for bf16, 2^-11 for fp16), as in test_moe_gpu.py.
"""
import pytest
import torch
import torch.nn.functional as F

from dsv2_lib import gemv, moe
from dsv2_lib.mlp import MLP, silu_and_mul
from dsv2_lib.weights import Linear, default_dtype

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_on")]

DTYPES = [torch.float16, torch.bfloat16]
REL = {torch.float16: 4 * 2**-11, torch.bfloat16: 4 * 2**-8}


def close(got, want, dtype):
    scale = want.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-3)
    return got.shape == want.shape and bool(((got.float() - want.float()).abs() <= REL[dtype] * scale).all())


def randn(*shape, dtype, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)


def spy(monkeypatch):
    """Count moe.gemv_down launches (the GEMV path ends in one)."""
    calls, real = [], moe.gemv_down
    monkeypatch.setattr(moe, "gemv_down", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


# V2-Lite's projections (kv_a, q, o, layer 0's gate|up and down) and an odd N with a tiny K
@pytest.mark.parametrize("n,k", [(576, 2048), (3072, 2048), (2048, 2048), (21888, 2048), (2048, 10944), (577, 24)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_f_linear(n, k, dtype, monkeypatch):
    calls = spy(monkeypatch)
    w = randn(n, k, dtype=dtype, scale=k**-0.5, seed=1)
    for t in (1, 3, gemv.DENSE_GEMV_MAX_TOKENS):
        x = randn(t, k, dtype=dtype, seed=t)
        assert close(gemv.linear(x, w), F.linear(x, w), dtype)
    assert len(calls) == 3


@pytest.mark.parametrize("h,i", [(2048, 1408), (2048, 2816), (2048, 10944), (256, 96)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_the_mlp(h, i, dtype, monkeypatch):
    calls = spy(monkeypatch)
    gate_up, down = randn(2 * i, h, dtype=dtype, scale=h**-0.5, seed=2), randn(h, i, dtype=dtype, scale=i**-0.5, seed=3)
    for t in (1, 5, gemv.DENSE_GEMV_MAX_TOKENS):
        x = randn(t, h, dtype=dtype, seed=t)
        assert gemv.swiglu_applies(x, gate_up, down)
        assert close(gemv.swiglu(x, gate_up, down), F.linear(silu_and_mul(F.linear(x, gate_up)), down), dtype)
    assert len(calls) == 3
    assert not gemv.swiglu_applies(randn(gemv.DENSE_GEMV_MAX_TOKENS + 1, h, dtype=dtype), gate_up, down)
    assert not gemv.swiglu_applies(randn(1, h, dtype=dtype), gate_up, down[:, : i // 2].contiguous())  # I mismatch


def test_where_the_kernel_does_not_apply_it_is_f_linear(monkeypatch):
    calls = spy(monkeypatch)
    w = randn(64, 32, dtype=torch.bfloat16)
    for x in (randn(gemv.DENSE_GEMV_MAX_TOKENS + 1, 32, dtype=torch.bfloat16),  # too many rows
              randn(2, 32, dtype=torch.float32),  # fp32 (w cast below)
              randn(2, 64, dtype=torch.bfloat16)[:, ::2],  # not contiguous
              randn(0, 32, dtype=torch.bfloat16)):  # no rows
        wx = w.to(x.dtype)
        assert torch.equal(gemv.linear(x, wx), F.linear(x, wx))
    assert torch.equal(gemv.linear(randn(2, 12, dtype=torch.bfloat16), w[:, :12].contiguous()),
                       F.linear(randn(2, 12, dtype=torch.bfloat16), w[:, :12].contiguous()))  # K = 12: not a multiple of 8
    monkeypatch.setattr(gemv, "DENSE_GEMV_MAX_TOKENS", 0)  # switched off
    x = randn(1, 32, dtype=torch.bfloat16)
    assert torch.equal(gemv.linear(x, w), F.linear(x, w))
    assert calls == []


def test_the_modules_take_the_gemv_on_the_gpu(monkeypatch):
    calls = spy(monkeypatch)
    with default_dtype(torch.bfloat16):
        lin, mlp = Linear(2048, 576).cuda(), MLP(2048, 1408).cuda()
    for p in (*lin.parameters(), *mlp.parameters()):
        p.data.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    x = randn(4, 2048, dtype=torch.bfloat16)
    assert close(lin(x), F.linear(x, lin.weight), torch.bfloat16)
    want = F.linear(silu_and_mul(F.linear(x, mlp.gate_up_proj.weight)), mlp.down_proj.weight)
    assert close(mlp(x), want, torch.bfloat16)
    assert len(calls) == 2


@pytest.mark.cuda_graph
def test_linear_in_a_cuda_graph():
    """No host sync and no allocation outside the graph's pool: capture once, replay on new inputs."""
    w = randn(3072, 2048, dtype=torch.bfloat16, scale=2048**-0.5)
    x = randn(2, 2048, dtype=torch.bfloat16)
    gemv.linear(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.linear(x, w)
    for seed in (5, 6):
        x.copy_(randn(2, 2048, dtype=torch.bfloat16, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert close(out, F.linear(x, w), torch.bfloat16)
