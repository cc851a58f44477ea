"""Dense projections of decode-sized batches as GEMVs (chapter 14).

At a few tokens a projection should cost one read of its weight, yet cuBLAS needs 3–6 µs for any of
V2-Lite's attention projections (2.4–12.6 MB, chapter 05): latency, not bytes. The MoE's GEMV kernels
(chapter 08) give every SM 16 output columns per block and stream their weight rows with 16-byte
loads; with one expert that every token picks (``ids=None``) they are exactly a dense layer:

* :func:`linear`: ``y [T, N] = x [T, K] · W [N, K]ᵀ`` (``moe_gemv_down``), fp32 accumulation and one
  rounding, as ``F.linear``;
* :func:`swiglu`: an MLP ``down(silu(x W_gᵀ) · (x W_uᵀ))`` in two launches (``moe_gemv_gate_up`` fuses
  the activation), rounded where :class:`~dsv2_lib.mlp.MLP` rounds.

:class:`~dsv2_lib.weights.Linear` and :class:`~dsv2_lib.mlp.MLP` call them for CUDA inputs; where the
kernels do not apply (more than ``DENSE_GEMV_MAX_TOKENS`` tokens, fp32, shapes they do not take),
``linear`` is ``F.linear`` and the MLP runs as it does elsewhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels, moe

DENSE_GEMV_MAX_TOKENS = 16  # up to this many rows of x: the GEMV kernels (0: always F.linear)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [T, K] @ weight [N, K]ᵀ -> [T, N]``: the GEMV kernel where it applies, else ``F.linear``."""
    if not (_rows_ok(x) and _weight_ok(weight, x.dtype, x.shape[1])):
        return F.linear(x, weight)
    return moe.gemv_down(x, weight[None])


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``x [T, H] -> [T, H]`` through ``gate_up [2I, H]`` (gate rows, then up rows) and ``down [H, I]``:
    two GEMV launches, where :func:`swiglu_applies`."""
    return moe.gemv_down(moe.gemv_gate_up(x, gate_up[None]), down[None])


def swiglu_applies(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether :func:`swiglu` takes these (else the MLP runs its two projections and the activation)."""
    return (_rows_ok(x) and _weight_ok(gate_up, x.dtype, x.shape[1]) and gate_up.shape[0] % 2 == 0
            and _weight_ok(down, x.dtype, gate_up.shape[0] // 2) and down.shape[0] == x.shape[1])


def _rows_ok(x: torch.Tensor) -> bool:
    """1 to ``DENSE_GEMV_MAX_TOKENS`` rows, 16-bit, on a GPU with kernels on, contiguous, 16-byte aligned."""
    return (x.dim() == 2 and 0 < x.shape[0] <= DENSE_GEMV_MAX_TOKENS and x.dtype in (torch.float16, torch.bfloat16)
            and x.is_cuda and kernels.use_kernels(x) and x.is_contiguous() and kernels.aligned16(x))


def _weight_ok(w: torch.Tensor, dtype: torch.dtype, k: int) -> bool:
    """``[N, k]`` in ``dtype``, contiguous and aligned, ``k`` a multiple of 8 (16-byte loads) whose fp32 copy
    fits a block's 48 KB of shared memory."""
    return (w.dim() == 2 and w.dtype == dtype and w.shape[1] == k and k % 8 == 0 and 4 * k <= 48 * 1024
            and w.is_contiguous() and kernels.aligned16(w))
