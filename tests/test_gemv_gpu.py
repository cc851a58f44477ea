"""The dense GEMV and skinny GEMM (kernels_cu/gemv.cu) against exact products (``pytest -m gpu``).

Tolerance: the kernel multiplies exactly (FMA), sums each lane's K/32 products in order and the 32 lane
sums in a 5-level shuffle tree, in fp32, then rounds once to the dtype. The fp32 sums differ from the
exact sum by at most about (K/32 + 5) 2^-24 sum|terms|, the rounding by u |result| (u = 2^-8 for bf16,
2^-11 for fp16); the test allows u |exact| + 2 (K/32 + 5) 2^-24 sum|terms|, exact in fp64 from the same
16-bit inputs (the factor 2 covers the second-order terms and the rounding of the error itself).
The skinny GEMM's sums run on the tensor cores: each mma adds 16 products to its fp32 accumulator, a
warp chains K / (16 SKINNY_WARPS) of them and the block adds its SKINNY_WARPS partials; the test allows
an error of 2^-23 (the tensor cores may truncate rather than round) per addition of that chain.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dsv2_lib.model.layers import Linear
from dsv2_lib.ops.gemv import (
    GEMV_MAX_TOKENS,
    SKINNY_MAX_TOKENS,
    SKINNY_WARPS,
    TOKENS_COMPILED,
    gemv_applies,
    linear,
    linear_skinny,
    skinny_applies,
)

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


def within_bound(got, x, w, dtype, additions=None):
    """|got - exact| <= u |exact| + 2 * additions * 2^-24 * sum|terms| (the GEMV's K/32 + 5 by default)."""
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    k = x.shape[-1]
    additions = k / 32 + 5 if additions is None else additions
    err = (got.double() - exact).abs()
    return bool((err <= U[dtype] * exact.abs() + 2 * additions * 2**-24 * magnitude).all())


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
@pytest.mark.parametrize("op,t,n", [(linear, 2, 3072), (linear_skinny, 32, 2048)], ids=["gemv", "skinny"])
def test_cuda_graph_replays_the_kernel_on_new_inputs(op, t, n):
    """The GEMV (two tokens) and the skinny GEMM (32), captured once, replayed on fresh inputs."""
    x, w = inputs(t, n, 2048, torch.bfloat16)
    static = x.clone()
    op(static, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(static, w)
    for seed in (1, 2):
        fresh, _ = inputs(t, n, 2048, torch.bfloat16, seed=seed)
        static.copy_(fresh)
        graph.replay()
        assert torch.equal(out, op(fresh, w))


# ---- the skinny GEMM: 3 to 64 tokens on the tensor cores -------------------------------------------
# V2-Lite's q_proj, kv_a_proj_with_mqa, shared experts' down_proj; the smallest block (16 rows, one k-step);
# a K that leaves some warps without a k-step
SKINNY_SHAPES = [(3072, 2048), (576, 2048), (2048, 2816), (16, 64), (48, 192)]


def skinny_bound(got, x, w, dtype):
    k = x.shape[-1]
    return within_bound(got, x, w, dtype, additions=2 * (k / (16 * SKINNY_WARPS) + SKINNY_WARPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [3, 8, 9, 17, 32, 33, 64, 100])
@pytest.mark.parametrize("n,k", SKINNY_SHAPES)
def test_skinny_matches_exact_products(dtype, t, n, k):
    """Token counts at and past each group size (8, 16, 32) and past one block's 32 tokens."""
    x, w = inputs(t, n, k, dtype, seed=t)
    assert skinny_applies(x, w)
    got = linear_skinny(x, w)
    assert got.shape == (t, n) and got.dtype == dtype
    assert skinny_bound(got, x, w, dtype)
    assert torch.equal(got, linear_skinny(x, w))  # the warps' partials are added in a fixed order


@pytest.mark.parametrize("dtype", DTYPES)
def test_skinny_takes_strided_rows_and_leading_dimensions(dtype):
    """Rows of a wider tensor (a row stride of K + 8) and x [2, T, K]: the kernel reads them in place,
    and a token's result does not depend on the tokens beside it."""
    x, w = inputs(24, 576, 2048, dtype)
    wide = torch.zeros(24, 2048 + 8, dtype=dtype, device="cuda")
    wide[:, :2048] = x
    assert skinny_applies(wide[:, :2048], w)
    assert torch.equal(linear_skinny(wide[:, :2048], w), linear_skinny(x, w))
    got = linear_skinny(x.view(2, 12, 2048), w)
    assert got.shape == (2, 12, 576) and torch.equal(got.view(24, 576), linear_skinny(x, w))
    assert torch.equal(linear_skinny(x[5:8], w), linear_skinny(x, w)[5:8])


def test_skinny_refuses_what_it_was_not_written_for():
    """K not a multiple of 64, N not of 16, fp32, a weight of another dtype, a row off a 16-byte
    boundary, a transposed weight, no rows: refused by name, nothing launched."""
    x, w = inputs(4, 64, 256, torch.bfloat16)
    cases = [(x[:, :192 + 8], w[:, :200].contiguous()), (x, w[:48 + 8].contiguous()), (x.float(), w.float()),
             (x, w.half()), (torch.empty(4, 257, dtype=torch.bfloat16, device="cuda")[:, 1:].copy_(x), w),
             (x, w.T.contiguous().T), (x[:0], w)]
    for xi, wi in cases:
        assert not skinny_applies(xi, wi)
        with pytest.raises(ValueError, match="linear_skinny: takes 16-bit CUDA rows"):
            linear_skinny(xi, wi)


def test_linear_takes_the_skinny_gemm_past_the_gemv_up_to_its_threshold():
    """``linear`` (and a ``Linear`` layer): the GEMV up to ``max_tokens``, the skinny GEMM up to
    ``skinny_max_tokens``, cuBLAS beyond; a shape the skinny GEMM does not take goes to cuBLAS."""
    x, w = inputs(8, 576, 2048, torch.bfloat16)
    assert torch.equal(linear(x, w, max_tokens=2, skinny_max_tokens=8), linear_skinny(x, w))
    assert torch.equal(linear(x, w, max_tokens=2, skinny_max_tokens=7), F.linear(x, w))
    assert torch.equal(linear(x[:2], w, max_tokens=2, skinny_max_tokens=8), linear(x[:2], w, max_tokens=2))
    odd = w[:568].contiguous()  # N not a multiple of 16
    assert torch.equal(linear(x, odd, max_tokens=2, skinny_max_tokens=8), F.linear(x, odd))
    layer = Linear(2048, 576, 2, 16).to(device="cuda", dtype=torch.bfloat16)
    layer.weight.data.copy_(w)
    assert torch.equal(layer(x), linear_skinny(x, w))


def test_the_lm_head_takes_the_paths_of_every_linear():
    """``compute_logits`` (tied or untied head), in fp32: the GEMV up to ``gemv_max_tokens`` rows, the skinny
    GEMM up to ``skinny_max_tokens``, ``F.linear`` beyond."""
    from dsv2_lib.core.config import TINY
    from dsv2_lib.core.dtypes import default_dtype
    from dsv2_lib.model.deepseek_v2 import DeepseekV2

    for tied in (False, True):
        with torch.device("cuda"), default_dtype(torch.bfloat16):
            model = DeepseekV2(dataclasses.replace(TINY, tie_word_embeddings=tied))
        w = model.lm_head_weight
        w.data.copy_(torch.randn_like(w, dtype=torch.float32).to(w.dtype) / 16)
        x = torch.randn(9, TINY.hidden_size, device="cuda").to(torch.bfloat16)
        gemv, skinny = model.logits_thresholds
        assert (gemv, skinny) == (GEMV_MAX_TOKENS, SKINNY_MAX_TOKENS) and TINY.vocab_size % 16 == 0
        for t in range(1, skinny + 2):
            want = (linear(x[:t], w, max_tokens=t) if t <= gemv else linear_skinny(x[:t], w) if t <= skinny
                    else F.linear(x[:t], w))
            assert torch.equal(model.compute_logits(x[:t]), want.float())
        assert model.compute_logits(x[:1]).dtype == torch.float32
