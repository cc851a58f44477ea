"""Prefill attention versions that chapter 06 builds and measures but the engine never launches.

* ``"naive"``: version 1, one thread per (query, head), reading every key from global memory
  (``kernels_cu/lessons/attention_prefill.cu``);
* the tensor-core configurations of :data:`MMA_VARIANTS`, instantiations of the engine's template
  (``kernels_cu/attention_prefill.cuh``) that lost to the two the engine keeps
  (``dsv2_lib.ops.attention.MMA_VARIANTS``) in ``benchmarks/bench_attention_prefill.py``.

:func:`prefill_attention_version` runs any version by name, these and the engine's (``"tiled"``, its
tensor-core variants, ``"sdpa"``), on the engine's checks and tile plan: the chapter and the benchmark
compare them all with it. Layout of the inputs: ``dsv2_lib.ops.attention``.
"""
from __future__ import annotations

import numpy as np
import torch

from dsv2_lib.core import kernels
from dsv2_lib.core.kernels import CUDA_TYPE
from dsv2_lib.ops import attention
from dsv2_lib.ops.attention import MmaVariant

NAIVE_THREADS = 128  # threads per block of the naive kernel, one (query, head) each
MMA_VARIANTS = {
    "mma": MmaVariant(4, False, 1, 1),            # 64 queries per block, one K and one V buffer
    "mma_w8": MmaVariant(8, False, 1, 1),         # 128 queries: half the K/V bytes per FLOP from L2
    "mma_w4_qs": MmaVariant(4, True, 1, 3),       # Q in shared memory: <= 168 registers, 3 blocks (12 warps) per SM
    "mma_w4_qs_st2": MmaVariant(4, True, 2, 2),
    "mma_w2": MmaVariant(2, False, 1, 4),         # 32 queries per block: more blocks for short sequences
    "mma_w2_st2": MmaVariant(2, False, 2, 2),
    "mma_w1": MmaVariant(1, False, 1, 5),         # 16 queries per block
}
ALL_MMA_VARIANTS = {**MMA_VARIANTS, **attention.MMA_VARIANTS}  # every configuration the benchmark compares
VERSIONS = ("naive", "tiled", *ALL_MMA_VARIANTS, "sdpa")

ATTENTION_LESSON_CU = kernels.declare(
    "lessons/attention_prefill.cu",
    [f"attention_prefill_naive<{t}>" for t in CUDA_TYPE.values()]
    + [m.kernel_name(t) for m in MMA_VARIANTS.values() for t in attention.MMA_TYPES],
    attention.HEADER_DEFINES,
)


def prefill_attention_version(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                              cu_seqlens_q, cu_seqlens_k, scale: float, version: str) -> torch.Tensor:
    """:func:`~dsv2_lib.ops.attention.prefill_attention` (``q [Tq, h, 192]``, keys ``[k_nope [Tk, h, 128] |
    k_pe [Tk, 64]]``, ``v [Tk, h, 128]`` -> ``[Tq, h, 128]``) by the named ``version``, one of
    :data:`VERSIONS`, on CUDA tensors. The engine's versions go to the engine's op."""
    if version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    if version not in ("naive", *MMA_VARIANTS):
        return attention.prefill_attention(q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, scale, version=version)
    attention.check_shapes(q, k_nope, k_pe, v)
    cu_q, cu_k = attention.cuda_seqlens(q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k)
    if version != "naive":
        return attention.launch_mma(ATTENTION_LESSON_CU, MMA_VARIANTS[version], q, k_nope, k_pe, v, cu_q, cu_k, scale)
    attention.check_layout(q, k_nope, k_pe, v, "naive", mma=False)
    Tq, h = q.shape[:2]
    out = torch.empty(Tq, h, attention.D_V, dtype=q.dtype, device=q.device)
    if Tq:
        args, _ = attention.kernel_args(out, q, k_nope, k_pe, v, cu_q, cu_k, scale, block_q=0)
        ATTENTION_LESSON_CU.launch(f"attention_prefill_naive<{CUDA_TYPE[q.dtype]}>", q.device,
                                   (-(-Tq * h // NAIVE_THREADS),), (NAIVE_THREADS,),
                                   B=np.int32(len(cu_q) - 1), Tq=np.int32(Tq), h=np.int32(h), **args)
    return out
