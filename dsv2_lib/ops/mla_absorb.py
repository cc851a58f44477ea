"""The absorbed ``W_k`` and ``W_v`` products of MLA decode (chapters 10 and 14).

Around the decode attention kernel sit two small per-head products:

* before it, ``query [T, h, C + R] = [W_kᵀ q_nope | q_pe]`` (``W_k [h, nope, C]``, ``C = kv_lora_rank``);
* after it, ``out [T, h, V] = round(o) W_vᵀ`` (``o [T, h, C]`` fp32, the attention's output; ``W_v [h, V, C]``).

As einsums they are batched GEMMs of T rows per head; at decode's T (a few tokens) each takes cuBLAS
about 4.4 µs of GPU time on the H200 for V2-Lite's 2 MB of weights (0.5 µs at the copy bandwidth), and
the query adds a ``torch.cat``, the output a dtype copy of ``o`` (and, its result being head-major, a
copy when ``o_proj`` flattens it): about 9 µs per layer, against 5 µs for the kernels at one token. For up
to ``ABSORB_MAX_TOKENS`` tokens of a 16-bit model on the GPU the kernels of ``kernels_cu/mla_absorb.cu``
do each in one launch, on the CUDA cores; beyond, one launch each on the tensor cores
(``mla_absorb_query_mma``, and ``linear_skinny`` with one product per head for the output), which read
the weights once per 32 tokens instead of once per token. Otherwise, and as their reference, the
einsums. All sum in fp32 and round once to the model's dtype, as the einsums do, in another order:
results may differ from them by one rounding.
"""
from __future__ import annotations

import numpy as np
import torch

from dsv2_lib.core import kernels
from dsv2_lib.core.kernels import CUDA_TYPE
from dsv2_lib.ops.gemv import SKINNY_GROUPS, _skinny_kernel

# Up to this many tokens the CUDA-core kernels, beyond the tensor-core ones (benchmarks/bench_mla_absorb.py).
# GPU time per call on an H200 (V2-Lite, bf16) of the CUDA-core kernels, a block per token: query 2.6 / 2.7 /
# 3.1 / 5.2 µs at 1 / 2 / 4 / 8 tokens against 4.7 / 4.8 / 4.8 / 5.1 for einsum + cat; output 2.4 / 2.6 /
# 3.8 / 6.0 against 4.3 / 4.3 / 4.4 / 4.4 for copy + einsum.
ABSORB_MAX_TOKENS = 4
QUERY_COLS, QUERY_THREADS = 128, 256  # q_lat columns and threads per block of mla_absorb_query
OUT_WARPS = 4  # warps per block of mla_absorb_output, two rows of W_v each
QMMA_WARPS = 4  # warps per block of mla_absorb_query_mma, 16 columns of q_lat each
MLA_ABSORB_CU = kernels.declare(
    "mla_absorb.cu",
    [f"{k}<{t}>" for k in ("mla_absorb_query", "mla_absorb_output") for t in ("__half", "__nv_bfloat16")]
    + [f"mla_absorb_query_mma<{t}, {g}>" for t in ("__half", "__nv_bfloat16") for g in SKINNY_GROUPS],
    {"DSV2_ABSORB_QUERY_COLS": QUERY_COLS, "DSV2_ABSORB_QUERY_THREADS": QUERY_THREADS,
     "DSV2_ABSORB_OUT_WARPS": OUT_WARPS, "DSV2_ABSORB_QMMA_WARPS": QMMA_WARPS},
)


def absorbed_query_reference(q_nope: torch.Tensor, q_pe: torch.Tensor, w_k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[W_kᵀ q_nope | q_pe]`` in ``dtype`` by einsum: ``q_nope [T, h, nope]``, ``q_pe [T, h, R]``,
    ``w_k [h, nope, C]`` -> ``[T, h, C + R]``, one dot product per cached row ``[latent | k_pe]``."""
    q_lat = torch.einsum("thn,hnc->thc", q_nope.to(dtype), w_k.to(dtype))
    return torch.cat([q_lat, q_pe.to(dtype)], dim=-1)


def absorbed_output_reference(o: torch.Tensor, w_v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``o [T, h, C]`` (the attention's fp32 output over latents) through ``w_v [h, V, C]``: ``[T, h, V]``
    in ``dtype``, ``o`` rounded to ``dtype`` first."""
    return torch.einsum("thc,hvc->thv", o.to(dtype), w_v.to(dtype))


def absorbed_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_k: torch.Tensor, dtype: torch.dtype,
                   max_tokens: int = ABSORB_MAX_TOKENS) -> torch.Tensor:
    """``[W_kᵀ q_nope | q_pe]`` ``[T, h, C + R]`` in ``dtype``: the kernel :func:`_query_path` names
    (``mla_absorb_query`` up to ``max_tokens`` tokens, ``mla_absorb_query_mma`` beyond), else
    :func:`absorbed_query_reference`."""
    path = _query_path(q_nope, q_pe, w_k, dtype, max_tokens)
    if path == "einsum":
        return absorbed_query_reference(q_nope, q_pe, w_k, dtype)
    (t, h, nope), (c, r) = q_nope.shape, (w_k.shape[2], q_pe.shape[2])
    query = torch.empty(t, h, c + r, dtype=dtype, device=q_nope.device)
    if not t:
        return query
    args = dict(query=kernels.ptr(query), q_nope=kernels.ptr(q_nope), q_pe=kernels.ptr(q_pe), w_k=kernels.ptr(w_k),
                NOPE=np.int32(nope), C=np.int32(c), R=np.int32(r), nope_t=np.int64(q_nope.stride(0)),
                nope_h=np.int64(q_nope.stride(1)), pe_t=np.int64(q_pe.stride(0)), pe_h=np.int64(q_pe.stride(1)),
                w_head_stride=np.int64(w_k.stride(0)))
    if path == "kernel":
        MLA_ABSORB_CU.launch(f"mla_absorb_query<{CUDA_TYPE[dtype]}>", q_nope.device, (h, c // QUERY_COLS, t),
                             (QUERY_THREADS,), **args)
    else:  # "mma": blocks of 16 QMMA_WARPS columns and 8, 16 or 32 tokens (more blocks beyond 32)
        groups = next((g for g in SKINNY_GROUPS if 8 * g >= t), SKINNY_GROUPS[-1])
        vec8 = r % 8 == 0 and q_pe.stride(0) % 8 == 0 and q_pe.stride(1) % 8 == 0 and kernels.aligned16(q_pe, query)
        MLA_ABSORB_CU.launch(f"mla_absorb_query_mma<{CUDA_TYPE[dtype]}, {groups}>", q_nope.device,
                             (c // (16 * QMMA_WARPS), -(-t // (8 * groups)), h), (32 * QMMA_WARPS,),
                             tokens=np.int32(t), vec8=np.int32(vec8), **args)
    return query


def absorbed_output(o: torch.Tensor, w_v: torch.Tensor, dtype: torch.dtype,
                    max_tokens: int = ABSORB_MAX_TOKENS) -> torch.Tensor:
    """``round(o) W_vᵀ`` ``[T, h, V]`` in ``dtype``: the kernel :func:`_output_path` names
    (``mla_absorb_output`` up to ``max_tokens`` tokens, ``linear_skinny`` per head beyond), else
    :func:`absorbed_output_reference`."""
    path = _output_path(o, w_v, dtype, max_tokens)
    if path == "einsum":
        return absorbed_output_reference(o, w_v, dtype)
    (t, h, c), v = o.shape, w_v.shape[1]
    out = torch.empty(t, h, v, dtype=dtype, device=o.device)
    if not t:
        return out
    if path == "kernel":
        MLA_ABSORB_CU.launch(f"mla_absorb_output<{CUDA_TYPE[dtype]}>", o.device, (h, -(-v // (2 * OUT_WARPS)), t),
                             (32 * OUT_WARPS,), out=kernels.ptr(out), o=kernels.ptr(o), w_v=kernels.ptr(w_v),
                             V=np.int32(v), C=np.int32(c), w_head_stride=np.int64(w_v.stride(0)))
    else:  # "mma": W_v[h]'s rows are the skinny GEMM's weight rows, o[t, h] its inputs
        _skinny_kernel(out, o, w_v)
    return out


def _rows_contiguous(w: torch.Tensor) -> bool:
    """``w [h, rows, C]`` with contiguous, 16-byte aligned rows (a view of ``kv_b_proj``'s weight is)."""
    return w.stride(2) == 1 and w.stride(1) == w.shape[2] and w.stride(1) * w.element_size() % 16 == 0 \
        and w.stride(0) * w.element_size() % 16 == 0 and kernels.aligned16(w)


def _query_path(q_nope, q_pe, w_k, dtype, max_tokens: int = ABSORB_MAX_TOKENS) -> str:
    """``"kernel"``, ``"mma"`` or ``"einsum"``. The kernels take: 16-bit ``dtype`` that every input already
    has, CUDA tensors, matching shapes, inputs whose last dimension is contiguous and ``W_k`` rows as
    :func:`_rows_contiguous`. ``mla_absorb_query`` takes up to ``max_tokens`` tokens and ``C`` a
    multiple of ``QUERY_COLS``; ``mla_absorb_query_mma`` more tokens, ``nope`` a multiple of 16, ``C`` of
    ``16 QMMA_WARPS``, and (4-byte loads and stores of value pairs) even strides, ``R`` and addresses."""
    if not (q_nope.dim() == q_pe.dim() == w_k.dim() == 3 and q_nope.is_cuda and kernels.use_kernels(q_nope)):
        return "einsum"
    (t, h, nope), (hw, nw, c), r = q_nope.shape, w_k.shape, q_pe.shape[2]
    if not (dtype in (torch.float16, torch.bfloat16) and q_nope.dtype == q_pe.dtype == w_k.dtype == dtype
            and q_pe.device == w_k.device == q_nope.device and q_pe.shape[:2] == (t, h) and (hw, nw) == (h, nope)
            and q_nope.stride(2) == 1 and q_pe.stride(2) == 1 and _rows_contiguous(w_k)):
        return "einsum"
    if t <= max_tokens:
        return "kernel" if c % QUERY_COLS == 0 else "einsum"
    pairs = (q_nope.stride(0), q_nope.stride(1), r, q_nope.data_ptr() // q_nope.element_size())
    return "mma" if nope % 16 == 0 and c % (16 * QMMA_WARPS) == 0 and all(v % 2 == 0 for v in pairs) else "einsum"


def _output_path(o, w_v, dtype, max_tokens: int = ABSORB_MAX_TOKENS) -> str:
    """``"kernel"``, ``"mma"`` or ``"einsum"``. The kernels take: 16-bit ``dtype`` (``w_v``'s), a contiguous
    fp32 ``o`` on the same GPU, 16-byte aligned, matching shapes, ``C`` a multiple of 8 and ``W_v`` rows
    as :func:`_rows_contiguous`. ``mla_absorb_output`` takes up to ``max_tokens`` tokens; the
    per-head ``linear_skinny`` more, with ``C`` a multiple of 64 (a warp's k-step) and ``V`` of 16 (a
    block's rows)."""
    if not (o.dim() == w_v.dim() == 3 and o.is_cuda and kernels.use_kernels(o)):
        return "einsum"
    (t, h, c), (hw, v, cw) = o.shape, w_v.shape
    if not (dtype in (torch.float16, torch.bfloat16) and w_v.dtype == dtype and o.dtype == torch.float32
            and o.device == w_v.device and (hw, cw) == (h, c) and c % 8 == 0 and o.is_contiguous()
            and kernels.aligned16(o) and _rows_contiguous(w_v)):
        return "einsum"
    if t <= max_tokens:
        return "kernel"
    return "mma" if c % 64 == 0 and v % 16 == 0 else "einsum"
