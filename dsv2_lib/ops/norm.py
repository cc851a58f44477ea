"""RMSNorm: ``y = x / sqrt(mean(x²) + eps) * weight``, reduced in fp32; and its fusion with the
residual add in front of it.

The normalised value is rounded to the input dtype *before* the weight multiplies it, exactly as
transformers' ``DeepseekV2RMSNorm`` does, so bf16 results match the oracle on the CPU. The
CUDA kernels (``kernels_cu/rmsnorm.cu``) follow the same rounding.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from dsv2_lib.core import kernels
from dsv2_lib.core.dtypes import empty_param, upcast
from dsv2_lib.core.kernels import CUDA_TYPE

ROW_VECS = 4  # 16-byte vectors each thread keeps in registers (rmsnorm.cuh's ROW_VECS)
RMSNORM_CU = kernels.declare(
    "rmsnorm.cu",
    [f"{k}<{t}, {v}>" for k in ("rms_norm", "fused_add_rms_norm") for t in CUDA_TYPE.values() for v in ("true", "false")],
    {"DSV2_RMSNORM_ROW_VECS": ROW_VECS},
)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dimension of ``x [..., d]`` and scale by ``weight [d]`` (PyTorch)."""
    xf = upcast(x)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = residual + x``; returns ``(rms_norm(residual), residual)`` (PyTorch, out of place)."""
    residual = residual + x
    return rms_norm_reference(residual, weight, eps), residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, in_place: bool = False) -> torch.Tensor:
    """RMSNorm of ``x [..., d]``: the CUDA kernel for CUDA tensors, else the reference.

    ``in_place=True`` overwrites ``x`` with the result and returns it: MLA normalises its latent inside
    the projection's output this way, so that output is the step's cache row without a copy. ``x``'s
    rows must then be viewable as ``[rows, d]`` with stride 1 along ``d`` (a 2-D slice like
    ``kv[:, :512]`` is).
    """
    d = x.shape[-1]
    if in_place and x.numel() and (x.stride(-1) != 1 or not _rows_view(x)):
        raise ValueError(f"rms_norm in place: x has strides {x.stride()}; its rows must be viewable as [rows, {d}] "
                         "with stride 1 along the last dimension")
    if not kernels.use_kernels(x):
        y = rms_norm_reference(x, weight, eps)
        return x.copy_(y) if in_place else y
    if x.numel() == 0:  # no rows, or rows of width 0: nothing to launch
        return x if in_place else torch.empty_like(x)
    kernels.check(weight, "rms_norm weight", dtype=x.dtype, shape=(d,), device=x.device)
    rows = x.reshape(-1, d)  # a view when possible: a 2-D slice like latent = kv[:, :512] keeps its row stride
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    kernels.check(rows, "rms_norm input", contiguous=False)
    out = rows if in_place else torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    vec = _vectorizable(rows.stride(0), x.dtype) and _use_vectors(d, x.dtype, rows, weight)
    RMSNORM_CU.launch(f"rms_norm<{CUDA_TYPE[x.dtype]}, {str(vec).lower()}>", x.device, (rows.shape[0],),
                      (_threads(d, x.dtype, vec),),
                      out=kernels.ptr(out), x=kernels.ptr(rows), w=kernels.ptr(weight), dim=np.int32(d),
                      stride=np.int64(rows.stride(0)), out_stride=np.int64(out.stride(0)), eps=np.float32(eps))
    return x if in_place else out.view(x.shape)


def _rows_view(x: torch.Tensor) -> bool:
    """Whether ``x.view(-1, d)`` works (no copy needed), so a kernel writing those rows writes ``x``."""
    try:
        x.view(-1, x.shape[-1])
        return True
    except RuntimeError:
        return False


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` then ``rms_norm(residual)``: one pass instead of two.

    Returns ``(normed, residual)``; the kernel updates ``residual`` in place, the reference does not.
    """
    if not kernels.use_kernels(x):
        return fused_add_rms_norm_reference(x, residual, weight, eps)
    d = x.shape[-1]
    kernels.check(x, "fused_add_rms_norm x")
    kernels.check(residual, "fused_add_rms_norm residual", dtype=x.dtype, shape=tuple(x.shape), device=x.device)
    kernels.check(weight, "fused_add_rms_norm weight", dtype=x.dtype, shape=(d,), device=x.device)
    if x.numel() == 0:
        return torch.empty_like(x), residual
    if residual.data_ptr() == x.data_ptr():
        raise ValueError("fused_add_rms_norm: x and residual are the same tensor; the kernel reads x while writing residual")
    out = torch.empty_like(x)
    vec = _use_vectors(d, x.dtype, x, residual, weight)
    RMSNORM_CU.launch(f"fused_add_rms_norm<{CUDA_TYPE[x.dtype]}, {str(vec).lower()}>", x.device, (x.numel() // d,),
                      (_threads(d, x.dtype, vec),),
                      out=kernels.ptr(out), residual=kernels.ptr(residual), x=kernels.ptr(x), w=kernels.ptr(weight),
                      dim=np.int32(d), eps=np.float32(eps))
    return out, residual


def _vectorizable(n: int, dtype: torch.dtype) -> bool:
    """``n`` elements make whole 16-byte vectors."""
    return n % (16 // dtype.itemsize) == 0


def _use_vectors(d: int, dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    """The register-cached vector variant fits: whole aligned vectors, at most 1024 threads × ROW_VECS."""
    return _vectorizable(d, dtype) and d // (16 // dtype.itemsize) <= 1024 * ROW_VECS and kernels.aligned16(*tensors)


def _threads(d: int, dtype: torch.dtype, vec: bool) -> int:
    """Threads per row: enough for ROW_VECS vectors each (or one element each), whole warps, ≤ 1024."""
    work = -(-d // (16 // dtype.itemsize * ROW_VECS)) if vec else d
    return min(1024, max(32, -(-work // 32) * 32))


class RMSNorm(nn.Module):
    """An RMSNorm layer: the learned scale ``weight [dim]`` and its epsilon."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = empty_param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
