"""Dense projections of one or two tokens as a GEMV (chapter 14): ``y [T, N] = x [T, K] · weight [N, K]ᵀ``.

At decode's batch 1 a projection is a matrix–vector product whose time is reading its weight
(2–13 MB for V2-Lite's attention projections, 135 MB for layer 0's MLP); cuBLAS's kernels for that
shape reach well under half the copy bandwidth (chapter 14's profile). ``linear_gemv``
(``kernels_cu/gemv.cu``) reads each weight row once for all ``T`` tokens with chapter 08's load pattern,
accumulates in fp32 and rounds once, as cuBLAS does (in another order: the two differ by roundings).
It takes ``x`` of up to :data:`GEMV_MAX_TOKENS` rows of a 16-bit CUDA tensor; everything else goes
to ``F.linear``, which is also the reference.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from dsv2_lib.core import kernels
from dsv2_lib.core.kernels import CUDA_TYPE

GEMV_MAX_TOKENS = 2  # tokens (rows of x) up to which the engine runs the GEMV; cuBLAS beyond (benchmarks/bench_gemv.py)
TOKENS_COMPILED = 4  # the kernel is compiled for 1..4 rows, so that the benchmark can time it past the threshold
WARPS = 4  # warps per block, two output columns each (gemv.cu's gemv::WARPS)
GEMV_CU = kernels.declare("gemv.cu", [f"linear_gemv<{t}, {n}>" for t in ("__half", "__nv_bfloat16")
                                      for n in range(1, TOKENS_COMPILED + 1)], {"DSV2_GEMV_WARPS": WARPS})


def linear(x: torch.Tensor, weight: torch.Tensor, max_tokens: int = GEMV_MAX_TOKENS) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) for ``x [..., K]`` and ``weight [N, K]``: the GEMV kernel when
    :func:`gemv_applies` (``x`` of at most ``max_tokens`` rows, at most :data:`TOKENS_COMPILED`), else
    ``F.linear`` (cuBLAS on a GPU)."""
    if not gemv_applies(x, weight, max_tokens):
        return F.linear(x, weight)
    K, N = x.shape[-1], weight.shape[0]
    rows = x.reshape(-1, K)  # a view: gemv_applies checked that the rows are strided views of x
    out = torch.empty(rows.shape[0], N, dtype=x.dtype, device=x.device)
    GEMV_CU.launch(f"linear_gemv<{CUDA_TYPE[x.dtype]}, {rows.shape[0]}>", x.device, (-(-N // (2 * WARPS)),),
                   (32 * WARPS,), y=kernels.ptr(out), x=kernels.ptr(rows), w=kernels.ptr(weight), N=np.int32(N),
                   K=np.int32(K), x_stride=np.int64(rows.stride(0)), y_stride=np.int64(out.stride(0)))
    return out.view(*x.shape[:-1], N)


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, max_tokens: int = GEMV_MAX_TOKENS) -> bool:
    """The kernel can take this call: kernels on for ``x``, both 16-bit of one dtype on one device,
    ``weight [N, K]`` contiguous, 1 to ``max_tokens`` rows of ``x`` whose last dimension is dense
    with a row stride (and K) a multiple of 8 values, 16-byte aligned. Anything else is ``F.linear``'s:
    the kernel never sees a shape it was not written for."""
    if not kernels.use_kernels(x) or x.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != x.dtype:
        return False
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1] or x.device != weight.device:
        return False
    K = x.shape[-1]
    T = x.numel() // K if K else 0
    if not 1 <= T <= min(max_tokens, TOKENS_COMPILED) or K % 8 or weight.shape[0] == 0 or not weight.is_contiguous():
        return False
    try:
        rows = x.view(-1, K)
    except RuntimeError:  # not viewable as rows: F.linear copies
        return False
    return rows.stride(-1) == 1 and (T == 1 or rows.stride(0) % 8 == 0) and kernels.aligned16(rows, weight)
