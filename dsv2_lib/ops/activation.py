"""SwiGLU's activation, ``silu(gate) * up`` on ``[..., 2I] = [gate | up]`` rows: the PyTorch reference
and the CUDA kernel (``kernels_cu/activation.cu``). The MLP that uses it is :mod:`dsv2_lib.model.mlp`.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from dsv2_lib.core import kernels
from dsv2_lib.core.dtypes import upcast
from dsv2_lib.core.kernels import CUDA_TYPE

THREADS = 128  # threads per block of the silu_and_mul kernel; gridDim.y blocks share a row
ACTIVATION_CU = kernels.declare(
    "activation.cu", [f"silu_and_mul<{t}, {v}>" for t in CUDA_TYPE.values() for v in ("true", "false")]
)


def _half_width(x: torch.Tensor) -> int:
    """``I`` for ``x [..., 2I]``; refuses a last dimension that cannot be [gate | up]."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul input: shape {list(x.shape)}, expected [..., 2I] = [gate | up] (even last dim)")
    return x.shape[-1] // 2


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2I] = [gate | up] -> silu(gate) * up [..., I]`` (PyTorch).

    Computed in fp32 (fp64 stays fp64) and rounded once to ``x``'s dtype at the end.
    """
    i = _half_width(x)
    xf = upcast(x)
    return (F.silu(xf[..., :i]) * xf[..., i:]).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation of ``x [..., 2I]``: the CUDA kernel for CUDA tensors, else the reference.

    ``x`` may be a strided view whose last dimension is contiguous (rows any distance apart).
    """
    if not kernels.use_kernels(x):
        return silu_and_mul_reference(x)
    i = _half_width(x)
    kernels.check(x, "silu_and_mul input", contiguous=False)
    if 2 * i >= 1 << 30:
        raise ValueError(f"silu_and_mul input: last dim {2 * i} too large for the kernel's int indices")
    if x.numel() == 0:  # no rows, or I = 0: nothing to launch
        return x.new_empty(*x.shape[:-1], i)
    rows = x.reshape(-1, 2 * i)  # a view when possible: a 2-D strided slice keeps its row stride
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.shape[0] >= 1 << 31:
        raise ValueError(f"silu_and_mul input: {rows.shape[0]} rows, the kernel's grid takes at most 2^31 - 1")
    out = torch.empty(rows.shape[0], i, dtype=x.dtype, device=x.device)
    n = 16 // x.dtype.itemsize  # values per 16-byte vector
    vec = i % n == 0 and rows.stride(0) % n == 0 and kernels.aligned16(rows, out)
    work = i // n if vec else i  # vectors (or elements) per row
    slices = min(-(-work // THREADS), 65535)  # blocks per row (gridDim.y)
    threads = min(THREADS, max(32, -(-work // slices // 32) * 32))  # whole warps, no more than needed
    ACTIVATION_CU.launch(f"silu_and_mul<{CUDA_TYPE[x.dtype]}, {str(vec).lower()}>", x.device, (rows.shape[0], slices),
                         (threads,), out=kernels.ptr(out), x=kernels.ptr(rows), inter=np.int32(i),
                         stride=np.int64(rows.stride(0)))
    return out.view(*x.shape[:-1], i)
