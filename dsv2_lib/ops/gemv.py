"""Dense projections of a few tokens (chapter 14): ``y [T, N] = x [T, K] · weight [N, K]ᵀ``.

At decode's batch 1 a projection is a matrix–vector product whose time is reading its weight
(2–13 MB for V2-Lite's attention projections, 135 MB for layer 0's MLP); cuBLAS's kernels for that
shape reach well under half the copy bandwidth (chapter 14's profile). ``linear_gemv``
(``kernels_cu/gemv.cu``) reads each weight row once for all ``T`` tokens with chapter 08's load pattern,
accumulates in fp32 and rounds once, as cuBLAS does (in another order: the two differ by roundings).
It takes ``x`` of up to :data:`GEMV_MAX_TOKENS` rows of a 16-bit CUDA tensor; everything else goes
to ``F.linear``, which is also the reference.

For a few tens of tokens (decode batches), :func:`linear_skinny` (``kernels_cu/linear_skinny.cu``) runs
the product on the tensor cores with chapter 08's skinny layout (the weight's rows as the mma's 16-row
side, the tokens in groups of 8 as its 8-wide side), the weight read once per 32 tokens, the block's
warps splitting K.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from dsv2_lib.core import kernels
from dsv2_lib.core.kernels import CUDA_TYPE

GEMV_MAX_TOKENS = 2  # tokens (rows of x) up to which the engine runs the GEMV; cuBLAS beyond (benchmarks/bench_gemv.py)
SKINNY_MAX_TOKENS = 8  # ... and beyond those, up to which it runs linear_skinny (benchmarks/bench_gemv.py); 0: never
TOKENS_COMPILED = 4  # the kernel is compiled for 1..4 rows, so that the benchmark can time it past the threshold
WARPS = 4  # warps per block, two output columns each (gemv.cu's gemv::WARPS)
SKINNY_WARPS = 8  # warps per block of linear_skinny, splitting K between them
SKINNY_GROUPS = (1, 2, 4)  # groups of 8 tokens per block compiled: 8, 16 or 32 tokens share a weight read
GEMV_CU = kernels.declare("gemv.cu", [f"linear_gemv<{t}, {n}>" for t in ("__half", "__nv_bfloat16")
                                      for n in range(1, TOKENS_COMPILED + 1)], {"DSV2_GEMV_WARPS": WARPS})
SKINNY_CU = kernels.declare("linear_skinny.cu", [f"linear_skinny<{t}, {x}, {g}>" for t in ("__half", "__nv_bfloat16")
                                                 for x in (t, "float") for g in SKINNY_GROUPS],
                            {"DSV2_GEMV_SKINNY_WARPS": SKINNY_WARPS})


def linear(x: torch.Tensor, weight: torch.Tensor, max_tokens: int = GEMV_MAX_TOKENS,
           skinny_max_tokens: int = SKINNY_MAX_TOKENS) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) for ``x [..., K]`` and ``weight [N, K]``: the GEMV kernel when
    :func:`gemv_applies` (``x`` of at most ``max_tokens`` rows, at most :data:`TOKENS_COMPILED`), else
    :func:`linear_skinny` for at most ``skinny_max_tokens`` rows that :func:`skinny_applies`, else
    ``F.linear`` (cuBLAS on a GPU). The rows are checked once, here."""
    rows = _kernel_rows(x, weight)
    if rows is not None and _gemv_takes(rows, max_tokens):
        return _launch_gemv(rows, weight).view(*x.shape[:-1], weight.shape[0])
    if rows is not None and rows.shape[0] <= skinny_max_tokens and _skinny_takes(rows, weight):
        return _launch_skinny(rows, weight).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, max_tokens: int = GEMV_MAX_TOKENS) -> bool:
    """The kernel can take this call: 1 to ``max_tokens`` rows of ``x`` (at most :data:`TOKENS_COMPILED`)
    that :func:`_kernel_rows` accepts, and K a multiple of 8 values. Anything else is ``F.linear``'s: the
    kernel never sees a shape it was not written for."""
    rows = _kernel_rows(x, weight)
    return rows is not None and _gemv_takes(rows, max_tokens)


def linear_skinny(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) for ``x [..., K]`` and ``weight [N, K]`` on the tensor cores
    (``kernels_cu/linear_skinny.cu``, :func:`skinny_applies` inputs): blocks of 16 weight rows and up to 32
    tokens (the fewest groups of 8 of :data:`SKINNY_GROUPS` that hold T, more blocks beyond 32)."""
    rows = _kernel_rows(x, weight)
    if rows is None or not _skinny_takes(rows, weight):
        raise ValueError(f"linear_skinny: takes 16-bit CUDA rows x [T, K] and weight [N, K] of x's dtype with "
                         f"K % 64 == 0 and N % 16 == 0, 16-byte aligned; got x {tuple(x.shape)} {x.dtype}, "
                         f"weight {tuple(weight.shape)} {weight.dtype}")
    return _launch_skinny(rows, weight).view(*x.shape[:-1], weight.shape[0])


def skinny_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """:func:`linear_skinny` can take this call: rows that :func:`_kernel_rows` accepts, K a multiple of 64
    (a warp's k-step) and N of 16 (a block's rows)."""
    rows = _kernel_rows(x, weight)
    return rows is not None and _skinny_takes(rows, weight)


def _gemv_takes(rows: torch.Tensor, max_tokens: int) -> bool:
    return rows.shape[0] <= min(max_tokens, TOKENS_COMPILED) and rows.shape[1] % 8 == 0


def _skinny_takes(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    return rows.shape[1] % 64 == 0 and weight.shape[0] % 16 == 0


def _launch_gemv(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``linear_gemv`` on checked rows ``[T, K]``: ``[T, N]``."""
    (T, K), N = rows.shape, weight.shape[0]
    out = torch.empty(T, N, dtype=rows.dtype, device=rows.device)
    GEMV_CU.launch(f"linear_gemv<{CUDA_TYPE[rows.dtype]}, {T}>", rows.device, (-(-N // (2 * WARPS)),),
                   (32 * WARPS,), y=kernels.ptr(out), x=kernels.ptr(rows), w=kernels.ptr(weight), N=np.int32(N),
                   K=np.int32(K), x_stride=np.int64(rows.stride(0)), y_stride=np.int64(out.stride(0)))
    return out


def _launch_skinny(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``linear_skinny`` on checked rows ``[T, K]``: ``[T, N]``."""
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=rows.dtype, device=rows.device)
    _skinny_kernel(out[:, None], rows[:, None], weight[None])
    return out


def _skinny_kernel(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """``out[t, h] = x[t, h] · weight[h]ᵀ`` by ``linear_skinny``, one product per head: ``x [T, h, K]`` (the
    weight's dtype, or fp32 rounded to it as it is read), ``weight [h, N, K]``, ``out [T, h, N]``, strided
    views the caller has checked (rows contiguous, strides multiples of 16 bytes' worth, K % 64 == 0,
    N % 16 == 0). A dense projection is one head; MLA's absorbed output has one per attention head."""
    (T, heads, K), N = x.shape, weight.shape[1]
    groups = next((g for g in SKINNY_GROUPS if 8 * g >= T), SKINNY_GROUPS[-1])
    SKINNY_CU.launch(f"linear_skinny<{CUDA_TYPE[weight.dtype]}, {CUDA_TYPE[x.dtype]}, {groups}>", x.device,
                     (N // 16, -(-T // (8 * groups)), heads), (32 * SKINNY_WARPS,), y=kernels.ptr(out),
                     x=kernels.ptr(x), w=kernels.ptr(weight), tokens=np.int32(T), N=np.int32(N), K=np.int32(K),
                     x_stride=np.int64(x.stride(0)), y_stride=np.int64(out.stride(0)),
                     x_head=np.int64(x.stride(1)), y_head=np.int64(out.stride(1)), w_head=np.int64(weight.stride(0)))


def _kernel_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x`` as rows ``[T, K]`` (a view) if the kernels can read them: kernels on for ``x``, both 16-bit of
    one dtype on one device, ``weight [N, K]`` contiguous with N > 0, at least one row, each dense with a
    row stride a multiple of 8 values, all 16-byte aligned; else None."""
    if not kernels.use_kernels(x) or x.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != x.dtype:
        return None
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1] or x.device != weight.device:
        return None
    K = x.shape[-1]
    if K == 0 or x.numel() == 0 or weight.shape[0] == 0 or not weight.is_contiguous():
        return None
    try:
        rows = x.view(-1, K)
    except RuntimeError:  # not viewable as rows: F.linear copies
        return None
    ok = rows.stride(-1) == 1 and (rows.shape[0] == 1 or rows.stride(0) % 8 == 0) and kernels.aligned16(rows, weight)
    return rows if ok else None
