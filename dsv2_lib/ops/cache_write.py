"""The cache write (chapter 12): scatter a step's new cache rows into one layer of the paged cache.

``cache[slot_mapping[t]] = rows[t]`` for every packed token ``t`` whose slot is ``>= 0``; a slot of
``-1`` (a graph's padding entry, which has no row to keep) is skipped. The PyTorch reference is an indexed
assignment through a boolean mask — which makes PyTorch count the kept tokens, a device-to-host
sync per layer per step, and cannot be captured in a CUDA graph. The kernel
(``kernels_cu/cache.cu``) gives each token one warp that copies its row with 16-byte vectors and
reads no count back.

Bounds. A slot ``>= num_rows`` is an error: the reference raises ``IndexError`` (PyTorch's), and
the kernel wrapper raises the same before the launch when the host knows the slots (``slot_mapping``
on the CPU, or ``host_slots`` or their ``max_slot`` passed alongside the device tensor, as the engine
does); otherwise the kernel skips such a token, so no write ever lands outside the cache.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dsv2_lib.core import kernels
from dsv2_lib.core.kernels import CUDA_TYPE

WARPS = 4  # tokens (warps) per block (cache.cu's cache_write::WARPS)
CACHE_CU = kernels.declare(
    "cache.cu", [f"write_cache_rows<{t}, {v}>" for t in CUDA_TYPE.values() for v in ("true", "false")],
    {"DSV2_CACHE_WRITE_WARPS": WARPS},
)


def write_cache_rows_reference(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``cache[slot_mapping[t]] = rows[t]`` for every ``t`` with ``slot_mapping[t] >= 0`` (PyTorch, in place)."""
    keep = slot_mapping >= 0
    cache[slot_mapping[keep]] = rows[keep]


def write_cache_rows(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor, *,
                     host_slots: Sequence[int] | None = None, max_slot: int | None = None) -> None:
    """Write ``rows [T, D]`` into ``cache [R, D]`` at ``slot_mapping [T]`` (int64; -1 = skip), in place.

    The kernel for CUDA tensors, else :func:`write_cache_rows_reference`. ``host_slots`` (the same
    slots as host ints, e.g. :attr:`PagedBatch.slots <dsv2_lib.model.cache.PagedBatch>`) lets the
    kernel path refuse a slot ``>= R`` before the launch without reading the device; ``max_slot``, their
    largest, does the same for a caller that knows it already (the engine: once per step,
    :attr:`PagedBatch.max_slot <dsv2_lib.model.cache.PagedBatch>`, not over every slot in every layer). A CPU
    ``slot_mapping`` is checked and copied to the cache's device. Rows must have the cache's dtype
    (the reference's indexed assignment refuses another one too).
    """
    if not kernels.use_kernels(cache):
        return write_cache_rows_reference(cache, rows, slot_mapping)
    kernels.check(cache, "write_cache_rows cache", shape=(None, None), contiguous=False)
    num_rows, dim = cache.shape
    if rows.dim() != 2 or rows.shape[1] != dim:
        raise ValueError(f"write_cache_rows rows: shape {list(rows.shape)}, expected [T, {dim}]")
    T = rows.shape[0]
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (T,):
        raise ValueError(f"write_cache_rows slot_mapping: {slot_mapping.dtype} {list(slot_mapping.shape)}, "
                         f"expected torch.int64 [{T}]")
    if not slot_mapping.is_cuda:
        host_slots = slot_mapping.tolist() if host_slots is None else host_slots
        slot_mapping = slot_mapping.to(cache.device, non_blocking=True)
    if host_slots is not None:
        if len(host_slots) != T:
            raise ValueError(f"write_cache_rows: {len(host_slots)} host slots for {T} rows")
        max_slot = max(host_slots, default=-1)
    if max_slot is not None and max_slot >= num_rows:
        raise IndexError(f"write_cache_rows: slot {max_slot} out of range: the cache has {num_rows} rows")
    kernels.check(rows, "write_cache_rows rows", dtype=cache.dtype, device=cache.device, contiguous=False)
    kernels.check(slot_mapping, "write_cache_rows slot_mapping", dtype=torch.int64, device=cache.device)
    if cache.stride(1) != 1 or rows.stride(1) != 1:
        raise ValueError("write_cache_rows: cache and rows need contiguous rows (stride 1 along D)")
    if T == 0 or dim == 0:
        return
    if T >= 2**31:
        raise ValueError(f"write_cache_rows: {T} tokens is more than one launch covers (int32 count)")
    n = 16 // cache.element_size()
    vec = (dim % n == 0 and cache.stride(0) % n == 0 and rows.stride(0) % n == 0
           and kernels.aligned16(cache, rows))
    CACHE_CU.launch(f"write_cache_rows<{CUDA_TYPE[cache.dtype]}, {str(vec).lower()}>", cache.device,
                    (-(-T // WARPS),), (WARPS * 32,),
                    cache=kernels.ptr(cache), rows=kernels.ptr(rows), slot_mapping=kernels.ptr(slot_mapping),
                    num_tokens=np.int32(T), dim=np.int32(dim), row_stride=np.int64(rows.stride(0)),
                    cache_stride=np.int64(cache.stride(0)), num_rows=np.int64(num_rows))
