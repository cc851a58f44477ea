"""The absorbed ``W_k`` and ``W_v`` products of MLA decode (chapters 10 and 14).

Around the decode attention kernel sit two small per-head products:

* before it, ``query [T, h, C + R] = [W_kᵀ q_nope | q_pe]`` (``W_k [h, nope, C]``, ``C = kv_lora_rank``);
* after it, ``out [T, h, V] = round(o) W_vᵀ`` (``o [T, h, C]`` fp32, the attention's output; ``W_v [h, V, C]``).

As einsums they are batched GEMMs of T rows per head; at decode's T (a few tokens) each takes cuBLAS
about 4.4 µs of GPU time on the H200 for V2-Lite's 2 MB of weights (0.5 µs at the copy bandwidth), and
the query adds a ``torch.cat``, the output a dtype copy of ``o``: about 9 µs per layer, against 5 µs for
the kernels at one token. For up to ``ABSORB_MAX_TOKENS`` tokens of a 16-bit model on the GPU the
kernels of ``kernels_cu/mla_absorb.cu`` do each in one launch; otherwise, and as their reference, the
einsums. Both sum in fp32 and round once to
the model's dtype, as the einsums do, in another order: results may differ from them by one rounding.
"""
from __future__ import annotations

import numpy as np
import torch

from dsv2_lib.core import kernels
from dsv2_lib.core.kernels import CUDA_TYPE

# Up to this many tokens the kernels, beyond the einsums. GPU time per call on an H200 (V2-Lite,
# bf16): query kernel 2.6 / 2.7 / 3.1 / 5.2 µs at 1 / 2 / 4 / 8 tokens against 4.7 / 4.8 / 4.8 / 5.1
# for einsum + cat; output kernel 2.4 / 2.6 / 3.8 / 6.0 against 4.3 / 4.3 / 4.4 / 4.4 for copy + einsum.
ABSORB_MAX_TOKENS = 4
QUERY_COLS, QUERY_THREADS = 128, 256  # q_lat columns and threads per block of mla_absorb_query
OUT_WARPS = 4  # warps per block of mla_absorb_output, two rows of W_v each
MLA_ABSORB_CU = kernels.declare(
    "mla_absorb.cu",
    [f"{k}<{t}>" for k in ("mla_absorb_query", "mla_absorb_output") for t in ("__half", "__nv_bfloat16")],
    {"DSV2_ABSORB_QUERY_COLS": QUERY_COLS, "DSV2_ABSORB_QUERY_THREADS": QUERY_THREADS,
     "DSV2_ABSORB_OUT_WARPS": OUT_WARPS},
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


def absorbed_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[W_kᵀ q_nope | q_pe]`` ``[T, h, C + R]`` in ``dtype``: ``mla_absorb_query`` where it applies
    (:func:`_query_kernel_applies`), else :func:`absorbed_query_reference`."""
    if not _query_kernel_applies(q_nope, q_pe, w_k, dtype):
        return absorbed_query_reference(q_nope, q_pe, w_k, dtype)
    (t, h, nope), (c, r) = q_nope.shape, (w_k.shape[2], q_pe.shape[2])
    query = torch.empty(t, h, c + r, dtype=dtype, device=q_nope.device)
    if t:
        MLA_ABSORB_CU.launch(f"mla_absorb_query<{CUDA_TYPE[dtype]}>", q_nope.device, (h, c // QUERY_COLS, t),
                             (QUERY_THREADS,),
                             query=kernels.ptr(query), q_nope=kernels.ptr(q_nope), q_pe=kernels.ptr(q_pe),
                             w_k=kernels.ptr(w_k), NOPE=np.int32(nope), C=np.int32(c), R=np.int32(r),
                             nope_t=np.int64(q_nope.stride(0)), nope_h=np.int64(q_nope.stride(1)),
                             pe_t=np.int64(q_pe.stride(0)), pe_h=np.int64(q_pe.stride(1)),
                             w_head_stride=np.int64(w_k.stride(0)))
    return query


def absorbed_output(o: torch.Tensor, w_v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``round(o) W_vᵀ`` ``[T, h, V]`` in ``dtype``: ``mla_absorb_output`` where it applies
    (:func:`_output_kernel_applies`), else :func:`absorbed_output_reference`."""
    if not _output_kernel_applies(o, w_v, dtype):
        return absorbed_output_reference(o, w_v, dtype)
    (t, h, c), v = o.shape, w_v.shape[1]
    out = torch.empty(t, h, v, dtype=dtype, device=o.device)
    if t:
        MLA_ABSORB_CU.launch(f"mla_absorb_output<{CUDA_TYPE[dtype]}>", o.device, (h, -(-v // (2 * OUT_WARPS)), t),
                             (32 * OUT_WARPS,), out=kernels.ptr(out), o=kernels.ptr(o), w_v=kernels.ptr(w_v),
                             V=np.int32(v), C=np.int32(c), w_head_stride=np.int64(w_v.stride(0)))
    return out


def _rows_contiguous(w: torch.Tensor) -> bool:
    """``w [h, rows, C]`` with contiguous, 16-byte aligned rows (a view of ``kv_b_proj``'s weight is)."""
    return w.stride(2) == 1 and w.stride(1) == w.shape[2] and w.stride(1) * w.element_size() % 16 == 0 \
        and w.stride(0) * w.element_size() % 16 == 0 and kernels.aligned16(w)


def _query_kernel_applies(q_nope, q_pe, w_k, dtype) -> bool:
    """The kernel takes: 16-bit ``dtype`` that every input already has, CUDA tensors, at most
    ``ABSORB_MAX_TOKENS`` tokens, matching shapes, ``C`` a multiple of ``QUERY_COLS``, inputs whose last
    dimension is contiguous and ``W_k`` rows as :func:`_rows_contiguous`."""
    if not (q_nope.dim() == q_pe.dim() == w_k.dim() == 3 and q_nope.is_cuda and kernels.use_kernels(q_nope)):
        return False
    (t, h, nope), (hw, nw, c) = q_nope.shape, w_k.shape
    return dtype in (torch.float16, torch.bfloat16) and q_nope.dtype == q_pe.dtype == w_k.dtype == dtype \
        and q_pe.device == w_k.device == q_nope.device and t <= ABSORB_MAX_TOKENS and q_pe.shape[:2] == (t, h) \
        and (hw, nw) == (h, nope) and c % QUERY_COLS == 0 and q_nope.stride(2) == 1 and q_pe.stride(2) == 1 \
        and _rows_contiguous(w_k)


def _output_kernel_applies(o, w_v, dtype) -> bool:
    """The kernel takes: 16-bit ``dtype`` (``w_v``'s), a contiguous fp32 ``o`` on the same GPU, 16-byte
    aligned, at most ``ABSORB_MAX_TOKENS`` tokens, matching shapes, ``C`` a multiple of 8 and ``W_v``
    rows as :func:`_rows_contiguous`."""
    if not (o.dim() == w_v.dim() == 3 and o.is_cuda and kernels.use_kernels(o)):
        return False
    (t, h, c), (hw, _, cw) = o.shape, w_v.shape
    return dtype in (torch.float16, torch.bfloat16) and w_v.dtype == dtype and o.dtype == torch.float32 \
        and o.device == w_v.device and t <= ABSORB_MAX_TOKENS and (hw, cw) == (h, c) and c % 8 == 0 \
        and o.is_contiguous() and kernels.aligned16(o) and _rows_contiguous(w_v)
