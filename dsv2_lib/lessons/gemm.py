"""A naive tiled GEMM in CUDA C (chapter 05): ``C [M, N] = A [M, K] @ B [K, N]`` with fp32
accumulation, the output in the inputs' dtype.

The engine does not use it: its projections call ``torch.nn.functional.linear``, i.e. cuBLAS,
which runs on the tensor cores and is far faster (chapter 05 measures both). The kernel is here
to show what tiling in shared memory is, and how far that idea alone gets.
"""
from __future__ import annotations

import numpy as np
import torch

from dsv2_lib.core import kernels
from dsv2_lib.core.kernels import CUDA_TYPE

BM, BN, THREADS = 64, 64, 256  # C tile per block and threads per block (a 4 x 4 sub-tile each)
GEMM_CU = kernels.declare("lessons/gemm.cu", [f"tiled_matmul<{t}>" for t in CUDA_TYPE.values()],
                          {"DSV2_GEMM_BM": BM, "DSV2_GEMM_BN": BN, "DSV2_GEMM_THREADS": THREADS})


def tiled_matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b [K, N] -> [M, N]`` computed in fp32 (or wider) and rounded to ``a.dtype``."""
    acc = torch.promote_types(a.dtype, torch.float32)
    return (a.to(acc) @ b.to(acc)).to(a.dtype)


def tiled_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b [K, N] -> [M, N]``: the tiled kernel for CUDA tensors, else the reference.

    Both must be 2-D with the same dtype and matching K; the kernel also needs them contiguous
    (row-major) on the same CUDA device.
    """
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"tiled_matmul: want 2-D a [M, K] and b [K, N], got shapes {list(a.shape)} and {list(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"tiled_matmul: a is {a.dtype} but b is {b.dtype}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"tiled_matmul: a is {list(a.shape)}, b is {list(b.shape)}: K differs ({a.shape[1]} != {b.shape[0]})")
    if not kernels.use_kernels(a):
        return tiled_matmul_reference(a, b)
    (M, K), N = a.shape, b.shape[1]
    kernels.check(a, "tiled_matmul a")
    kernels.check(b, "tiled_matmul b", device=a.device)
    if -(-M // BM) > 65535:
        raise ValueError(f"tiled_matmul: M = {M} needs more than 65535 row blocks of {BM}")
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:  # nothing to compute (K = 0 is launched: the kernel writes zeros)
        return out
    GEMM_CU.launch(f"tiled_matmul<{CUDA_TYPE[a.dtype]}>", a.device, (-(-N // BN), -(-M // BM)), (THREADS,),
                   C=kernels.ptr(out), A=kernels.ptr(a), B=kernels.ptr(b), M=np.int32(M), N=np.int32(N), K=np.int32(K))
    return out
