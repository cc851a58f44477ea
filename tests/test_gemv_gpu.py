"""The dense GEMV (kernels_cu/gemv.cu) against exact products (``pytest -m gpu``).

Tolerance: the kernel multiplies exactly (FMA), sums each lane's K/32 products in order and the 32 lane
sums in a 5-level shuffle tree, in fp32, then rounds once to the dtype. The fp32 sums differ from the
exact sum by at most about (K/32 + 5) 2^-24 sum|terms|, the rounding by u |result| (u = 2^-8 for bf16,
2^-11 for fp16); the test allows u |exact| + 2 (K/32 + 5) 2^-24 sum|terms|, exact in fp64 from the same
16-bit inputs (the factor 2 covers the second-order terms and the rounding of the error itself).
"""
import pytest
import torch
import torch.nn.functional as F

from dsv2_lib.model.layers import Linear
from dsv2_lib.ops.gemv import GEMV_MAX_TOKENS, TOKENS_COMPILED, gemv_applies, linear

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_on")]

U = {torch.float16: 2**-11, torch.bfloat16: 2**-8}
DTYPES = [torch.bfloat16, torch.float16]
# V2-Lite's q_proj, kv_a_proj_with_mqa, o_proj, layer 0's down_proj; odd and tiny N; K not a multiple of 256
SHAPES = [(3072, 2048), (576, 2048), (2048, 2048), (2048, 10944), (7, 8), (1, 16), (33, 1000)]


def inputs(t, n, k, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    return x, w


def within_bound(got, x, w, dtype):
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    k = x.shape[-1]
    err = (got.double() - exact).abs()
    return bool((err <= U[dtype] * exact.abs() + 2 * (k / 32 + 5) * 2**-24 * magnitude).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", range(1, TOKENS_COMPILED + 1))
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_matches_exact_products(dtype, t, n, k):
    x, w = inputs(t, n, k, dtype)
    assert gemv_applies(x, w, max_tokens=t)
    got = linear(x, w, max_tokens=t)
    assert got.shape == (t, n) and got.dtype == dtype
    assert within_bound(got, x, w, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_takes_strided_rows_and_leading_dimensions(dtype):
    """Rows of a wider tensor (a row stride of K + 8) and x [1, T, K]: the kernel reads them in place."""
    x, w = inputs(2, 576, 2048, dtype)
    wide = torch.zeros(2, 2048 + 8, dtype=dtype, device="cuda")
    wide[:, :2048] = x
    view = wide[:, :2048]
    assert gemv_applies(view, w)
    assert torch.equal(linear(view, w), linear(x, w))
    got = linear(x[None], w)
    assert got.shape == (1, 2, 576) and torch.equal(got[0], linear(x, w))


def test_everything_else_is_f_linear():
    """More rows than the threshold, fp32, K not a multiple of 8, a row 2 bytes off a 16-byte boundary,
    a transposed weight, no rows: F.linear's result, bit for bit (the kernel is not asked)."""
    x, w = inputs(GEMV_MAX_TOKENS + 1, 64, 256, torch.bfloat16)
    cases = [(x, w), (x[:1].float(), w.float()), (x[:1, :255], w[:, :255].contiguous()),
             (torch.empty(1, 257, dtype=torch.bfloat16, device="cuda")[:, 1:].copy_(x[:1]), w),
             (x[:1], w.T.contiguous().T), (x[:0], w)]
    for xi, wi in cases:
        assert not gemv_applies(xi, wi)
        assert torch.equal(linear(xi, wi), F.linear(xi, wi))


def test_linear_module_uses_the_kernel():
    x, w = inputs(1, 576, 2048, torch.bfloat16)
    layer = Linear(2048, 576).to(device="cuda", dtype=torch.bfloat16)
    layer.weight.data.copy_(w)
    assert torch.equal(layer(x), linear(x, w)) and within_bound(layer(x), x, w, torch.bfloat16)


@pytest.mark.cuda_graph
def test_cuda_graph_replays_the_kernel_on_new_inputs():
    x, w = inputs(2, 3072, 2048, torch.bfloat16)
    static = x.clone()
    linear(static, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(static, w)
    for seed in (1, 2):
        fresh, _ = inputs(2, 3072, 2048, torch.bfloat16, seed=seed)
        static.copy_(fresh)
        graph.replay()
        assert torch.equal(out, linear(fresh, w))
