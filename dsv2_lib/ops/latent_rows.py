"""A step's latent cache rows in one launch (chapter 04): ``kv_a_layernorm``, RoPE and the cache write fused.

Between its projections and its attention, an MLA layer runs three small kernels on the same few
rows: :func:`~dsv2_lib.ops.norm.rms_norm` normalises the latent of ``kv [T, R + d]``
(``kv_a_proj_with_mqa``'s output) in place, :func:`~dsv2_lib.ops.rope.apply_rope_` rotates its
``k_pe`` and the queries' ``q_pe [T, h, d]`` in place, and
:func:`~dsv2_lib.ops.cache_write.write_cache_rows` copies each row ``[latent | k_pe]`` to its slot.
In a decode step each kernel moves a few kilobytes, so its time is its launch and its memory
latency, not its bytes: ``latent_rows`` (``kernels_cu/latent_rows.cu``) does all three in one
launch, with the same device functions (the same bits).

It needs 16-byte vectors everywhere and a latent one warp can hold (at most ``32 * ROW_VECS``
vectors: 1,024 values of a 16-bit type); :func:`fused_applies` says whether a call qualifies, and
the model takes the three ops otherwise.
"""
from __future__ import annotations

import numpy as np
import torch

from dsv2_lib.core import kernels
from dsv2_lib.core.kernels import CUDA_TYPE
from dsv2_lib.ops.norm import ROW_VECS

LATENT_ROWS_CU = kernels.declare("latent_rows.cu", [f"latent_rows<{t}>" for t in CUDA_TYPE.values()],
                                 {"DSV2_RMSNORM_ROW_VECS": ROW_VECS})
MAX_ROPE_THREADS = 224  # threads beside warp 0 that rotate q_pe and k_pe (a 16-head token has 136 vectors)


def fused_applies(kv: torch.Tensor, q_pe: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether :func:`latent_rows_` can take these tensors: CUDA tensors of one kernel dtype with kernels
    on, ``kv [T, R + d]`` and ``cache [rows, R + d]`` with dense rows, ``q_pe [T, h, d]`` dense along
    ``d``, every width and stride whole 16-byte vectors, every pointer 16-byte aligned, and a latent of at
    most ``32 * ROW_VECS`` vectors (one warp holds it, as :func:`~dsv2_lib.ops.norm.rms_norm`'s 32-thread
    block does, so the sums come out in the same order)."""
    if not kernels.use_kernels(kv) or kv.dtype not in CUDA_TYPE:
        return False
    if kv.dim() != 2 or q_pe.dim() != 3 or cache.dim() != 2 or weight.dim() != 1:
        return False
    if any(t.dtype != kv.dtype or t.device != kv.device for t in (q_pe, weight, cache)):
        return False
    n = 16 // kv.element_size()
    r, d = weight.shape[0], q_pe.shape[-1]
    return (kv.shape[1] == cache.shape[1] == r + d and q_pe.shape[0] == kv.shape[0]
            and r % n == 0 and d % n == 0 and r // n <= 32 * ROW_VECS
            and kv.stride(1) == q_pe.stride(2) == cache.stride(1) == weight.stride(0) == 1
            and all(s % n == 0 for s in (kv.stride(0), q_pe.stride(0), q_pe.stride(1), cache.stride(0)))
            and kernels.aligned16(kv, q_pe, weight, cache))


def latent_rows_(kv: torch.Tensor, q_pe: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                 rope_cache: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, *, max_position: int,
                 max_slot: int) -> None:
    """Normalise the latent ``kv[:, :R]`` (``weight [R]``, ``eps``), rotate ``kv[:, R:]`` and ``q_pe [T, h, d]``
    by ``positions [T]`` (int64; ``rope_cache [P, d]`` fp32), all in place, and copy each row ``kv[t]`` to
    ``cache[slot_mapping[t]]`` (int64; -1 = skip): one kernel launch, for tensors :func:`fused_applies` accepts.

    ``max_position`` and ``max_slot`` bound the positions and the slots on the host, as the three ops take
    them: a position past the table or a slot past the cache raises before the launch, without reading the
    device (in a CUDA graph the kernel also never reads or writes outside them).
    """
    if not fused_applies(kv, q_pe, weight, cache):
        raise ValueError("latent_rows_: these tensors need the three separate ops (fused_applies is False)")
    T, h, d = q_pe.shape
    kernels.check(positions, "latent_rows positions", dtype=torch.int64, shape=(T,), device=kv.device)
    kernels.check(slot_mapping, "latent_rows slot_mapping", dtype=torch.int64, shape=(T,), device=kv.device)
    kernels.check(rope_cache, "latent_rows rope_cache", dtype=torch.float32, shape=(None, d), device=kv.device)
    if T == 0:
        return
    if max_position >= rope_cache.shape[0]:
        raise IndexError(f"rope: positions up to {max_position}, the cos/sin cache holds 0..{rope_cache.shape[0] - 1}")
    if max_slot >= cache.shape[0]:
        raise IndexError(f"write_cache_rows: slot {max_slot} out of range: the cache has {cache.shape[0]} rows")
    items = (h + 1) * (d // (16 // kv.element_size()))  # vectors to rotate
    threads = 32 + min(MAX_ROPE_THREADS, -(-items // 32) * 32)
    LATENT_ROWS_CU.launch(f"latent_rows<{CUDA_TYPE[kv.dtype]}>", kv.device, (T,), (threads,),
                          kv=kernels.ptr(kv), kv_stride=np.int64(kv.stride(0)), w=kernels.ptr(weight),
                          latent_dim=np.int32(weight.shape[0]), eps=np.float32(eps),
                          q=kernels.ptr(q_pe), q_row_stride=np.int64(q_pe.stride(0)),
                          q_head_stride=np.int64(q_pe.stride(1)), heads=np.int32(h), rope_dim=np.int32(d),
                          positions=kernels.ptr(positions), cos_sin=kernels.ptr(rope_cache),
                          num_positions=np.int64(rope_cache.shape[0]), cache=kernels.ptr(cache),
                          cache_stride=np.int64(cache.stride(0)), slot_mapping=kernels.ptr(slot_mapping),
                          num_rows=np.int64(cache.shape[0]))
