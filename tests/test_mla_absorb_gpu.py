"""The absorbed W_k / W_v kernels against exact products (``pytest -m gpu``): for a few tokens
kernels_cu/mla_absorb.cu's CUDA-core kernels, beyond its tensor-core query kernel and linear_skinny per head.

Tolerance: each kernel sums in fp32 and rounds once to the dtype. Rounding moves a value by at most
u |x| (u = 2^-8 for bf16, 2^-11 for fp16); the fp32 sum of n <= 512 products differs from the exact sum
by at most about n 2^-24 sum|terms| <= 2^-15 sum|terms|. So |kernel - exact| <= u |exact| + 2^-15 sum|terms|,
exact computed in fp64 from the same 16-bit inputs. The query's q_pe half is a copy: equal bit for bit.
"""
import pytest
import torch

from dsv2_lib.ops.mla_absorb import (
    ABSORB_MAX_TOKENS,
    _output_path,
    _query_path,
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


MANY = [ABSORB_MAX_TOKENS + 1, 9, 32, 33, 100]  # the tensor-core kernels: one group of 8, 16, 32 tokens, several


def path_for(t):
    return "kernel" if t <= ABSORB_MAX_TOKENS else "mma"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 3, ABSORB_MAX_TOKENS, *MANY])
@pytest.mark.parametrize("h,nope,rope,c,v", [(16, 128, 64, 512, 128), (3, 48, 8, 256, 24)])
def test_absorbed_query_kernel(dtype, t, h, nope, rope, c, v):
    q_nope, q_pe, w_k, _ = projections(t, h, nope, rope, c, v, dtype)
    assert _query_path(q_nope, q_pe, w_k, dtype) == path_for(t)
    got = absorbed_query(q_nope, q_pe, w_k, dtype)
    assert got.shape == (t, h, c + rope) and got.dtype == dtype
    exact = torch.einsum("thn,hnc->thc", q_nope.double(), w_k.double())
    magnitude = torch.einsum("thn,hnc->thc", q_nope.double().abs(), w_k.double().abs())
    assert within_one_rounding(got[..., :c], exact, magnitude, dtype)
    assert torch.equal(got[..., c:], q_pe)
    ref = absorbed_query_reference(q_nope, q_pe, w_k, dtype)  # cuBLAS: the same values up to one rounding
    assert within_one_rounding(ref[..., :c], exact, magnitude, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 3, ABSORB_MAX_TOKENS, *MANY])
@pytest.mark.parametrize("h,c,v", [(16, 512, 128), (3, 192, 32), (3, 72, 7), (2, 1032, 9)])
def test_absorbed_output_kernel(dtype, t, h, c, v):
    _, _, _, w_v = projections(1, h, 8, 8, c, v, dtype)
    o = torch.randn(t, h, c, device="cuda") * 0.3
    # the tensor-core path needs C % 64 == 0 and V % 16 == 0; the other shapes take the einsum past a few tokens
    assert _output_path(o, w_v, dtype) == (path_for(t) if t <= ABSORB_MAX_TOKENS or (c % 64, v % 16) == (0, 0)
                                           else "einsum")
    got = absorbed_output(o, w_v, dtype)
    assert got.shape == (t, h, v) and got.dtype == dtype
    o16 = o.to(dtype).double()  # the einsum's input is o rounded to the dtype
    exact = torch.einsum("thc,hvc->thv", o16, w_v.double())
    magnitude = torch.einsum("thc,hvc->thv", o16.abs(), w_v.double().abs())
    assert within_one_rounding(got, exact, magnitude, dtype)


def test_tensor_core_products_do_not_depend_on_the_batch():
    """A token's sums run in one order whatever the tokens beside it (groups of 8, 16 or 32, one block or
    several): the first 9 tokens of 100 give the bits of those 9 alone, run after run."""
    dtype = torch.bfloat16
    q_nope, q_pe, w_k, w_v = projections(100, 16, 128, 64, 512, 128, dtype)
    many = absorbed_query(q_nope, q_pe, w_k, dtype)
    assert torch.equal(many, absorbed_query(q_nope, q_pe, w_k, dtype))
    assert torch.equal(many[:9], absorbed_query(q_nope[:9], q_pe[:9], w_k, dtype))
    o = torch.randn(100, 16, 512, device="cuda")
    out = absorbed_output(o, w_v, dtype)
    assert torch.equal(out, absorbed_output(o, w_v, dtype))
    assert torch.equal(out[:9], absorbed_output(o[:9].contiguous(), w_v, dtype))


def test_the_output_rounds_o_as_the_einsum_does():
    """o rounded to the dtype as it is read: an o already on the dtype's grid gives the bits of that grid's
    values, whatever lies between grid points (here o + a quarter of a bf16 step, rounded away)."""
    dtype = torch.bfloat16
    _, _, _, w_v = projections(1, 16, 8, 8, 512, 128, dtype)
    o = torch.randn(9, 16, 512, device="cuda").to(dtype).float()
    nudged = o + o.abs() * 2**-10  # a quarter of bf16's relative step (2^-8): rounds back to o
    assert torch.equal(nudged.to(dtype).float(), o)
    assert torch.equal(absorbed_output(nudged, w_v, dtype), absorbed_output(o, w_v, dtype))


def test_kernels_step_aside_where_they_do_not_apply():
    """An fp32 model, widths the kernels were not written for, a non-contiguous output, an odd head stride
    for the tensor-core query's 4-byte loads: the einsums, bit for bit."""
    dtype = torch.bfloat16
    q_nope, q_pe, w_k, w_v = projections(ABSORB_MAX_TOKENS + 1, 4, 40, 8, 128, 16, dtype)
    assert _query_path(q_nope, q_pe, w_k, dtype) == "einsum"  # nope = 40: not a multiple of 16
    assert torch.equal(absorbed_query(q_nope, q_pe, w_k, dtype), absorbed_query_reference(q_nope, q_pe, w_k, dtype))
    q_nope, q_pe, w_k, w_v = projections(2, 4, 16, 8, 64, 16, dtype)
    assert _query_path(q_nope, q_pe, w_k, dtype) == "einsum"  # C = 64
    assert _query_path(q_nope.float(), q_pe.float(), w_k.float(), torch.float32) == "einsum"
    o = torch.randn(2, 4, 64, 2, device="cuda")[..., 0]  # strided
    assert _output_path(o, w_v, dtype) == "einsum"
    assert torch.equal(absorbed_output(o, w_v, dtype), absorbed_output_reference(o, w_v, dtype))
    q = torch.randn(9, 4, 41, device="cuda").to(dtype)[..., 1:]  # head stride 41: odd, and so is the start
    _, _, w_k, _ = projections(1, 4, 32, 8, 128, 16, dtype)
    q_nope, q_pe = q[..., :32], q[..., 32:]
    assert _query_path(q_nope, q_pe, w_k, dtype) == "einsum"
    assert torch.equal(absorbed_query(q_nope, q_pe, w_k, dtype), absorbed_query_reference(q_nope, q_pe, w_k, dtype))


def test_empty_batch():
    q_nope, q_pe, w_k, w_v = projections(0, 16, 128, 64, 512, 128, torch.bfloat16)
    assert absorbed_query(q_nope, q_pe, w_k, torch.bfloat16).shape == (0, 16, 576)
    assert absorbed_output(torch.zeros(0, 16, 512, device="cuda"), w_v, torch.bfloat16).shape == (0, 16, 128)
