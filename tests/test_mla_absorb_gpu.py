"""The absorbed W_k / W_v kernels (kernels_cu/mla_absorb.cu) against exact products (``pytest -m gpu``).

Tolerance: each kernel sums in fp32 and rounds once to the dtype. Rounding moves a value by at most
u |x| (u = 2^-8 for bf16, 2^-11 for fp16); the fp32 sum of n <= 512 products differs from the exact sum
by at most about n 2^-24 sum|terms| <= 2^-15 sum|terms|. So |kernel - exact| <= u |exact| + 2^-15 sum|terms|,
exact computed in fp64 from the same 16-bit inputs. The query's q_pe half is a copy: equal bit for bit.
"""
import pytest
import torch

from dsv2_lib.ops.mla_absorb import (
    ABSORB_MAX_TOKENS,
    _output_kernel_applies,
    _query_kernel_applies,
    absorbed_output,
    absorbed_output_reference,
    absorbed_query,
    absorbed_query_reference,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_on")]

U = {torch.float16: 2**-11, torch.bfloat16: 2**-8}
DTYPES = [torch.bfloat16, torch.float16]


def within_one_rounding(got, exact, magnitude, dtype):
    err = (got.double() - exact).abs()
    return bool((err <= U[dtype] * exact.abs() + 2**-15 * magnitude).all())


def projections(t, h, nope, rope, c, v, dtype, seed=0):
    """q [T, h, nope + rope] as project_q leaves it (q_nope, q_pe strided views) and kv_b's weight viewed
    as W_k [h, nope, C], W_v [h, V, C] (MLA.split_kv_b)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(t, h, nope + rope, device="cuda", generator=g).to(dtype)
    kv_b = (torch.randn(h * (nope + v), c, device="cuda", generator=g) * 0.05).to(dtype)
    w = kv_b.view(h, nope + v, c)
    return q[..., :nope], q[..., nope:], w[:, :nope], w[:, nope:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 3, ABSORB_MAX_TOKENS])
@pytest.mark.parametrize("h,nope,rope,c,v", [(16, 128, 64, 512, 128), (3, 40, 8, 256, 24)])
def test_absorbed_query_kernel(dtype, t, h, nope, rope, c, v):
    q_nope, q_pe, w_k, _ = projections(t, h, nope, rope, c, v, dtype)
    assert _query_kernel_applies(q_nope, q_pe, w_k, dtype)
    got = absorbed_query(q_nope, q_pe, w_k, dtype)
    assert got.shape == (t, h, c + rope) and got.dtype == dtype
    exact = torch.einsum("thn,hnc->thc", q_nope.double(), w_k.double())
    magnitude = torch.einsum("thn,hnc->thc", q_nope.double().abs(), w_k.double().abs())
    assert within_one_rounding(got[..., :c], exact, magnitude, dtype)
    assert torch.equal(got[..., c:], q_pe)
    ref = absorbed_query_reference(q_nope, q_pe, w_k, dtype)  # cuBLAS: the same values up to one rounding
    assert within_one_rounding(ref[..., :c], exact, magnitude, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 3, ABSORB_MAX_TOKENS])
@pytest.mark.parametrize("h,c,v", [(16, 512, 128), (3, 72, 7), (2, 1032, 9)])
def test_absorbed_output_kernel(dtype, t, h, c, v):
    _, _, _, w_v = projections(1, h, 8, 8, c, v, dtype)
    o = torch.randn(t, h, c, device="cuda") * 0.3
    assert _output_kernel_applies(o, w_v, dtype)
    got = absorbed_output(o, w_v, dtype)
    assert got.shape == (t, h, v) and got.dtype == dtype
    o16 = o.to(dtype).double()  # the einsum's input is o rounded to the dtype
    exact = torch.einsum("thc,hvc->thv", o16, w_v.double())
    magnitude = torch.einsum("thc,hvc->thv", o16.abs(), w_v.double().abs())
    assert within_one_rounding(got, exact, magnitude, dtype)


def test_kernels_step_aside_where_they_do_not_apply():
    """More tokens than a launch takes, an fp32 model, a width not a multiple of 128, a non-contiguous
    output: the einsums, bit for bit."""
    dtype = torch.bfloat16
    q_nope, q_pe, w_k, w_v = projections(ABSORB_MAX_TOKENS + 1, 4, 16, 8, 128, 16, dtype)
    assert not _query_kernel_applies(q_nope, q_pe, w_k, dtype)
    assert torch.equal(absorbed_query(q_nope, q_pe, w_k, dtype), absorbed_query_reference(q_nope, q_pe, w_k, dtype))
    q_nope, q_pe, w_k, w_v = projections(2, 4, 16, 8, 64, 16, dtype)
    assert not _query_kernel_applies(q_nope, q_pe, w_k, dtype)  # C = 64
    assert not _query_kernel_applies(q_nope.float(), q_pe.float(), w_k.float(), torch.float32)
    o = torch.randn(2, 4, 64, 2, device="cuda")[..., 0]  # strided
    assert not _output_kernel_applies(o, w_v, dtype)
    assert torch.equal(absorbed_output(o, w_v, dtype), absorbed_output_reference(o, w_v, dtype))


def test_empty_batch():
    q_nope, q_pe, w_k, w_v = projections(0, 16, 128, 64, 512, 128, torch.bfloat16)
    assert absorbed_query(q_nope, q_pe, w_k, torch.bfloat16).shape == (0, 16, 576)
    assert absorbed_output(torch.zeros(0, 16, 512, device="cuda"), w_v, torch.bfloat16).shape == (0, 16, 128)
