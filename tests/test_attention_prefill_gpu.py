"""The engine's prefill attention (the tiled kernel, its tensor-core variants, SDPA and the default
dispatch) against the packed reference on the GPU (``pytest -m gpu``). The chapter's lesson versions:
tests/test_attention_prefill_lessons_gpu.py.

Tolerance. The reference computes in fp32 from the same rounded inputs and rounds the output
once to the dtype. The kernels also accumulate in fp32 but (a) sum in another order and use
exp2 of pre-scaled scores: a few fp32 ulps, and (b) the tensor-core kernel rounds the softmax
weights p (<= 1) to the dtype before P V, a relative error of at most the unit roundoff
u = 2^-8 (bf16, 8 significant bits) or 2^-11 (fp16, 11). Since the weights of a row sum to 1
(after the division by l, which sums the unrounded p), (b) moves the output by at most u max|v|.
Each side's output rounding adds at most u |reference|, so
|kernel - reference| <= u max|v| + 2 u |reference| + (a) <= 2 (u max|v| + u |reference|):
the bound with a factor 2 to spare on the first term for (a). fp32 (no rounding of p) gets
1e-5 (max|v| + |reference|).
"""
import numpy as np
import pytest
import torch

from dsv2_lib.ops import attention
from dsv2_lib.ops.attention import AttentionTuning, prefill_attention, prefill_attention_reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_on")]

SCALE = 0.114721
EPS = {torch.float32: 1e-5, torch.float16: 2**-11, torch.bfloat16: 2**-8}  # u, the unit roundoff (docstring)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CASES = {  # name -> (query lengths, cached starts)
    "len1": ([1], [0]), "len15": ([15], [0]), "len16": ([16], [0]), "len17": ([17], [0]),
    "len1000": ([1000], [0]),
    "mixed": ([17, 1, 64, 130, 5], [0, 0, 0, 0, 0]),
    "mixed_with_cache": ([17, 1, 64, 130, 5, 0], [3, 200, 64, 0, 1000, 7]),
}


def make(lens_q, starts, dtype, h=16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens_k = [s + n for s, n in zip(starts, lens_q)]
    Tq, Tk = sum(lens_q), sum(lens_k)
    q = torch.randn(Tq, h, 192, device="cuda", generator=g).to(dtype)
    kv = torch.randn(Tk, h, 256, device="cuda", generator=g).to(dtype)  # [k_nope | v], as kv_b_proj makes them
    k_pe = torch.randn(Tk, 576, device="cuda", generator=g).to(dtype)[:, 512:]  # a strided slice of cache rows
    cu_q = torch.tensor([0, *np.cumsum(lens_q)], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *np.cumsum(lens_k)], dtype=torch.int32, device="cuda")
    return q, kv[..., :128], k_pe, kv[..., 128:], cu_q, cu_k


def close(out, ref, v, dtype):
    eps = EPS[dtype]
    bound = 2 * eps * (v.float().abs().max() + ref.float().abs())
    return bool(((out.float() - ref.float()).abs() <= bound).all())


def versions(dtype):
    return ["tiled", "sdpa", None] + (list(attention.MMA_VARIANTS) if dtype != torch.float32 else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.heavy) if c == "len1000" else c for c in CASES])
def test_every_version_matches_the_reference(case, dtype):
    args = make(*CASES[case], dtype)
    ref = prefill_attention_reference(*args, SCALE)
    for version in versions(dtype):
        out = prefill_attention(*args, SCALE, version=version)
        assert out.shape == ref.shape and out.dtype == dtype
        assert close(out, ref, args[3], dtype), f"version {version}"


@pytest.mark.parametrize("tuning", [AttentionTuning(sdpa_min_tokens=10**9),
                                    AttentionTuning(sdpa_min_tokens=0, sdpa_min_max_len=0)], ids=["kernel", "sdpa"])
def test_default_dispatch_follows_the_backend_rule(tuning):
    args = make([100, 37], [0, 20], torch.bfloat16)
    assert attention.prefill_backend(137, 100, 2, tuning) == ("kernel" if tuning.sdpa_min_tokens else "sdpa")
    out = prefill_attention(*args, SCALE, tuning=tuning)
    assert close(out, prefill_attention_reference(*args, SCALE), args[3], torch.bfloat16)


@pytest.mark.parametrize("variant", list(attention.MMA_VARIANTS))
def test_default_dispatch_uses_the_chosen_variants(variant):
    """The default path launches the record's kernel_variant / small_kernel_variant (whatever the benchmark set)."""
    tuning = AttentionTuning(kernel_variant=variant, small_kernel_variant=variant)
    args = make([300, 37, 1], [0, 20, 5], torch.bfloat16)
    out = prefill_attention(*args, SCALE, tuning=tuning)
    assert close(out, prefill_attention_reference(*args, SCALE), args[3], torch.bfloat16)


def test_mma_variants_on_long_sequences():
    """Many key tiles (both buffers of the two-stage variants cycle), several query tiles, a cached prefix;
    each of the engine's variants against one reference, computed on the CPU (on the GPU its kernels,
    cuBLAS's among them, took minutes of the racecheck run, which instruments them all)."""
    args = make([1100, 700], [0, 333], torch.bfloat16, seed=1)
    ref = prefill_attention_reference(*(a.cpu() for a in args), SCALE).cuda()
    for variant in attention.MMA_VARIANTS:
        assert close(prefill_attention(*args, SCALE, version=variant), ref, args[3], torch.bfloat16), variant


def test_unaligned_rows_take_the_tiled_kernel():
    """k_pe one element into the cache row is not 16-byte aligned: the mma kernel refuses, the default path
    quietly takes the tiled kernel (scalar loads) and is still right."""
    q, k_nope, _, v, cu_q, cu_k = make([40], [9], torch.bfloat16)
    k_pe = torch.randn(49, 66, device="cuda").to(torch.bfloat16)[:, 1:65]
    with pytest.raises(ValueError, match="16-byte aligned"):
        prefill_attention(q, k_nope, k_pe, v, cu_q, cu_k, SCALE, version=attention.TUNING.small_kernel_variant)
    ref = prefill_attention_reference(q, k_nope, k_pe, v, cu_q, cu_k, SCALE)
    assert close(prefill_attention(q, k_nope, k_pe, v, cu_q, cu_k, SCALE), ref, v, torch.bfloat16)


def test_ill_formed_seqlens_are_refused_before_launch():
    q, k_nope, k_pe, v, cu_q, cu_k = make([10, 6], [0, 4], torch.bfloat16)
    bad = {
        "ends at 17 but there are 16 rows": (torch.tensor([0, 10, 17], dtype=torch.int32, device="cuda"), cu_k),
        "ends at 21 but there are 20 rows": (cu_q, torch.tensor([0, 10, 21], dtype=torch.int32, device="cuda")),
        "prefix sums decrease": (torch.tensor([0, 12, 10, 16], dtype=torch.int32, device="cuda"),
                                 torch.tensor([0, 12, 14, 20], dtype=torch.int32, device="cuda")),
        "1 queries but only 0 keys": (torch.tensor([0, 15, 16], dtype=torch.int32, device="cuda"),
                                      torch.tensor([0, 20, 20], dtype=torch.int32, device="cuda")),
    }
    for msg, (cq, ck) in bad.items():
        for version in ("tiled", *attention.MMA_VARIANTS, None):
            with pytest.raises(ValueError, match=msg):
                prefill_attention(q, k_nope, k_pe, v, cq, ck, SCALE, version=version)
    with pytest.raises(TypeError, match="dtype torch.float16, expected torch.bfloat16"):
        prefill_attention(q, k_nope.half(), k_pe, v, cu_q, cu_k, SCALE, version="tiled")
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        prefill_attention(q.float(), k_nope.float(), k_pe.float(), v.float(), cu_q, cu_k, SCALE,
                          version=attention.TUNING.kernel_variant)


def test_engine_prefill_uses_the_packed_path(monkeypatch):
    """MLA.prefill_attention on CUDA (packed, one kv_b_proj GEMM, our kernel) equals its reference loop."""
    from dataclasses import replace

    from dsv2_lib.core.config import DEEPSEEK_V2_LITE
    from dsv2_lib.model.cache import SequenceBatch
    from dsv2_lib.model.mla import MLA

    cfg = replace(DEEPSEEK_V2_LITE, hidden_size=256)  # V2-Lite's attention shapes, a small hidden size
    torch.manual_seed(0)
    layer = MLA(cfg).to("cuda", torch.bfloat16)
    for p in layer.parameters():
        p.data.normal_(0, 0.05)
    batch = SequenceBatch(slots=(2, 0), starts=(5, 0), lens=(30, 70))
    cache = torch.randn(3, 128, 576, device="cuda").to(torch.bfloat16)
    q_nope = torch.randn(100, 16, 128, device="cuda").to(torch.bfloat16)
    q_pe = torch.randn(100, 16, 64, device="cuda").to(torch.bfloat16)
    out = layer.prefill_attention(q_nope, q_pe, batch, cache)
    monkeypatch.setenv("DSV2_BACKEND", "torch")
    ref = layer.prefill_attention(q_nope, q_pe, batch, cache)
    v_max = layer.kv_b_proj(cache[..., :512]).abs().max()  # bounds every value row
    assert close(out, ref.to(out.dtype), v_max, torch.bfloat16)
