"""Chapter 06's lesson versions of prefill attention (the naive kernel and the tensor-core configurations
the engine does not launch, ``dsv2_lib.lessons.attention_prefill``) against the packed reference on the
GPU (``pytest -m gpu``). Inputs, cases and the tolerance (its derivation): tests/test_attention_prefill_gpu.py.
"""
import pytest
import torch
from test_attention_prefill_gpu import CASES, DTYPES, SCALE, close, make

from dsv2_lib.lessons import attention_prefill as lesson
from dsv2_lib.ops import attention
from dsv2_lib.ops.attention import prefill_attention_reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_on")]


def versions(dtype):
    return ["naive"] + (list(lesson.MMA_VARIANTS) if dtype != torch.float32 else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.heavy) if c == "len1000" else c for c in CASES])
def test_every_lesson_version_matches_the_reference(case, dtype):
    args = make(*CASES[case], dtype)
    ref = prefill_attention_reference(*args, SCALE)
    for version in versions(dtype):
        if version == "naive" and case == "len1000" and dtype != torch.bfloat16:
            continue  # one thread per (query, head) over 1000 keys: slow, and the bf16 run covers it
        out = lesson.prefill_attention_version(*args, SCALE, version=version)
        assert out.shape == ref.shape and out.dtype == dtype
        assert close(out, ref, args[3], dtype), f"version {version}"


def test_engine_versions_go_to_the_engine_op():
    """prefill_attention_version runs the engine's versions too (the chapter and the benchmark compare all)."""
    args = make([17], [3], torch.bfloat16)
    ref = prefill_attention_reference(*args, SCALE)
    for version in ("tiled", *attention.MMA_VARIANTS, "sdpa"):
        assert close(lesson.prefill_attention_version(*args, SCALE, version=version), ref, args[3], torch.bfloat16), version


@pytest.mark.parametrize("variant", list(lesson.MMA_VARIANTS))
def test_mma_variants_on_long_sequences(variant):
    """Many key tiles (both buffers of the two-stage variants cycle), several query tiles, a cached prefix;
    the reference on the CPU (on the GPU it dominated the racecheck run, which instruments every kernel)."""
    args = make([1100, 700], [0, 333], torch.bfloat16, seed=1)
    ref = prefill_attention_reference(*(a.cpu() for a in args), SCALE).cuda()
    assert close(lesson.prefill_attention_version(*args, SCALE, version=variant), ref, args[3], torch.bfloat16)


def test_ill_formed_inputs_are_refused_before_launch():
    q, k_nope, k_pe, v, cu_q, cu_k = make([10, 6], [0, 4], torch.bfloat16)
    bad_q = torch.tensor([0, 10, 17], dtype=torch.int32, device="cuda")
    for version in ("naive", *lesson.MMA_VARIANTS):
        with pytest.raises(ValueError, match="ends at 17 but there are 16 rows"):
            lesson.prefill_attention_version(q, k_nope, k_pe, v, bad_q, cu_k, SCALE, version=version)
        with pytest.raises(TypeError, match="dtype torch.float16, expected torch.bfloat16"):
            lesson.prefill_attention_version(q, k_nope.half(), k_pe, v, cu_q, cu_k, SCALE, version=version)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        lesson.prefill_attention_version(q.float(), k_nope.float(), k_pe.float(), v.float(), cu_q, cu_k, SCALE,
                                         version="mma")
    unaligned = torch.randn(20, 66, device="cuda").to(torch.bfloat16)[:, 1:65]
    with pytest.raises(ValueError, match="16-byte aligned"):
        lesson.prefill_attention_version(q, k_nope, unaligned, v, cu_q, cu_k, SCALE, version="mma")
    with pytest.raises(ValueError, match="version must be one of"):
        lesson.prefill_attention_version(q, k_nope, k_pe, v, cu_q, cu_k, SCALE, version="fast")
