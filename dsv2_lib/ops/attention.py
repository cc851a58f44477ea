"""Causal prefill attention over packed variable-length sequences (chapter 06).

Layout (DeepSeek-V2-Lite: h = 16, QK head 192 = 128 nope + 64 rope, V head 128):

* ``q [Tq, h, 192]``: the new tokens of all sequences, packed one after another;
* ``k_nope [Tk, h, 128]``, ``v [Tk, h, 128]``: every key/value each sequence attends to (its cached
  tokens and the new ones), packed the same way; strided views are fine (they are the two halves
  of ``kv_b_proj``'s output ``[Tk, h, 256]``);
* ``k_pe [Tk, 64]``: the rotary part of the key, **one per token, shared by all heads**. The
  kernels read it directly instead of taking a ``[Tk, h, 192]`` key that repeats it 16 times;
* ``cu_seqlens_q``, ``cu_seqlens_k`` (int32 ``[B+1]``) prefix sums of the query and key counts.
  Sequence b has ``nq = cu_q[b+1]-cu_q[b]`` new tokens and ``nk = cu_k[b+1]-cu_k[b]`` keys, so it
  had ``start = nk - nq`` cached tokens: its query i sits at position ``start + i`` and sees keys
  ``0 .. start + i``. One pair of prefix sums describes lengths *and* starts.

``prefill_attention`` dispatches: CPU tensors (or ``DSV2_BACKEND=torch``) take the reference;
CUDA tensors take our kernel or torch's ``scaled_dot_product_attention`` by :func:`prefill_backend`.
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from dsv2_lib.core import kernels
from dsv2_lib.core.dtypes import upcast
from dsv2_lib.core.kernels import CUDA_TYPE

D_NOPE, D_ROPE, D_V = 128, 64, 128  # the head sizes the kernels are built for (kernels_cu/attention_prefill.cu)
D_QK, BK = D_NOPE + D_ROPE, 64
TILED_BQ = 16                        # queries per block of the tiled kernel
# The tensor-core kernel's configurations (template parameters of attention_prefill_mma): name ->
# (warps per block NW, Q in shared memory QS, K/V buffers ST, min blocks per SM MINB). A block takes
# 16 NW queries. "mma" is the first version (measured on the H200 on 2026-11-29: 148 TFLOP/s at
# 8 x 4096); benchmarks/bench_attention_prefill.py times them all and prints the winner per shape.
MMA_VARIANTS = {
    "mma": (4, False, 1, 1),
    "mma_w8": (8, False, 1, 1),         # 128 queries: half the K/V bytes per FLOP from L2
    "mma_w8_st2": (8, False, 2, 1),     # ... and K/V(j+1) in flight during all of tile j
    "mma_w4_st2": (4, False, 2, 2),
    "mma_w4_qs": (4, True, 1, 3),       # Q in shared memory: <= 168 registers, 3 blocks (12 warps) per SM
    "mma_w4_qs_st2": (4, True, 2, 2),
    "mma_w2": (2, False, 1, 4),         # 32 queries per block: more blocks for short sequences
    "mma_w2_st2": (2, False, 2, 2),
    "mma_w1": (1, False, 1, 5),         # 16 queries per block
}
MMA_BQ = 16 * MMA_VARIANTS["mma"][0]
VERSIONS = ("naive", "tiled", *MMA_VARIANTS, "sdpa")


def _mma_name(variant: str, ctype: str) -> str:
    nw, qs, st, minb = MMA_VARIANTS[variant]
    return f"attention_prefill_mma<{ctype}, {nw}, {'true' if qs else 'false'}, {st}, {minb}>"


def mma_shared_bytes(variant: str) -> int:
    """Dynamic shared memory of one block of ``variant``: [sQ if QS][ST K tiles][ST V tiles], padded rows."""
    nw, qs, st, _ = MMA_VARIANTS[variant]
    return 2 * ((16 * nw * (D_QK + 8) if qs else 0) + st * BK * (D_QK + 8) + st * BK * (D_V + 8))


ATTENTION_CU = kernels.declare(
    "attention_prefill.cu",
    [f"attention_prefill_{v}<{t}>" for v in ("naive", "tiled") for t in CUDA_TYPE.values()]
    + [_mma_name(v, t) for v in MMA_VARIANTS for t in ("__half", "__nv_bfloat16")],
)

# The engine's choice, per shape, from the H200 measurement of 2026-11-29 (chapter 06's table,
# benchmarks/bench_attention_prefill.py). The comparison is with SDPA as the engine calls it, the k_pe
# broadcast to every head included: our best variant wins up to 512-token sequences (1 x 512: 74.7
# vs 63.5 TFLOP/s; 8 x 512: 144 vs 120), SDPA (cuDNN) from 1024 on (1 x 1024: 159 vs 117; 8 x 4096:
# 427 vs 259). Batches SDPA would need many calls for (mixed lengths or a cached prefix: one call per
# sequence) take our kernel at every length. Its variant is KERNEL_VARIANT, or SMALL_KERNEL_VARIANT
# below SMALL_TILES 64-query tiles (counting every head). The benchmark prints the crossover and
# the winning variants to re-set these.
SDPA_MIN_TOKENS = 1024   # at or above this many packed query tokens, SDPA ...
SDPA_MIN_MAX_LEN = 1024  # ... provided the longest sequence has at least this many ...
SDPA_MAX_CALLS = 8       # ... and SDPA needs at most this many calls (1 when all lengths are equal)
KERNEL_VARIANT = "mma_w8_st2"        # 8 x 4096: 259 TFLOP/s (the first version: 240)
SMALL_KERNEL_VARIANT = "mma_w4_st2"  # 1 x 512: 74.7, 8 x 512: 144 (the first version: 70.4, 141)
SMALL_TILES = 2048       # 8 x 512 (1024 tiles) still takes the small variant, 8 x 4096 (8192) the large


def prefill_backend(num_tokens: int, max_len: int, num_calls: int = 1) -> str:
    """``"sdpa"`` or ``"kernel"`` for ``num_tokens`` packed queries whose longest sequence has
    ``max_len``, where SDPA would take ``num_calls`` calls: the faster one on the H200 by the
    thresholds above (measured: see chapter 06)."""
    return ("sdpa" if num_tokens >= SDPA_MIN_TOKENS and max_len >= SDPA_MIN_MAX_LEN and num_calls <= SDPA_MAX_CALLS
            else "kernel")


def kernel_variant(num_tiles: int) -> str:
    """The tensor-core variant for a launch of ``num_tiles`` (64-query tiles x heads) blocks' worth of work."""
    return SMALL_KERNEL_VARIANT if num_tiles < SMALL_TILES else KERNEL_VARIANT


def seqlens(cu_seqlens_q: torch.Tensor | Sequence[int], cu_seqlens_k: torch.Tensor | Sequence[int],
            num_q: int, num_k: int) -> tuple[list[int], list[int]]:
    """Check a pair of prefix sums on the host and return them as lists ``(cu_q, cu_k)``.

    Both must have the same length ``B + 1 >= 2``, start at 0, never decrease, end at ``num_q`` /
    ``num_k``, and give every sequence at least as many keys as queries (``start >= 0``).
    """
    out = []
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, num_q), ("cu_seqlens_k", cu_seqlens_k, num_k)):
        if isinstance(cu, torch.Tensor):
            if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name}: want a 1-D int32 tensor, got {cu.dtype} of shape {list(cu.shape)}")
            cu = cu.tolist()
        cu = [int(x) for x in cu]
        if len(cu) < 2 or cu[0] != 0:
            raise ValueError(f"{name}: want prefix sums [0, ...] of length B + 1 >= 2, got {cu[:8]}")
        if any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"{name}: prefix sums decrease: {cu[:8]}...")
        if cu[-1] != total:
            raise ValueError(f"{name}: ends at {cu[-1]} but there are {total} rows")
        if total >= 2**31:
            raise ValueError(f"{name}: {total} rows do not fit the kernels' int32 indices")
        out.append(cu)
    cu_q, cu_k = out
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q has {len(cu_q) - 1} sequences, cu_seqlens_k {len(cu_k) - 1}")
    for b in range(len(cu_q) - 1):
        if cu_k[b + 1] - cu_k[b] < cu_q[b + 1] - cu_q[b]:
            raise ValueError(f"sequence {b}: {cu_q[b + 1] - cu_q[b]} queries but only {cu_k[b + 1] - cu_k[b]} keys")
    return cu_q, cu_k


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Softmax attention (fp32 or wider) for one sequence: ``q [n, h, dq]`` (positions start..start+n-1)
    over ``k [start+n, h, dq]``, ``v [start+n, h, dv]`` -> ``[n, h, dv]``; query i sees keys ≤ start+i."""
    n, m = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", upcast(q), upcast(k)) * scale
    visible = torch.arange(m, device=q.device)[None, :] <= torch.arange(start, start + n, device=q.device)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), upcast(v))


def prefill_attention_reference(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                                cu_seqlens_q, cu_seqlens_k, scale: float) -> torch.Tensor:
    """``[Tq, h, 192] x keys -> [Tq, h, 128]`` in ``q.dtype``: :func:`causal_attention` per sequence."""
    cu_q, cu_k = seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k_nope.shape[0])
    outs = []
    for b in range(len(cu_q) - 1):
        ks = slice(cu_k[b], cu_k[b + 1])
        k = torch.cat([k_nope[ks], k_pe[ks, None, :].expand(-1, k_nope.shape[1], -1)], dim=-1)
        start = (cu_k[b + 1] - cu_k[b]) - (cu_q[b + 1] - cu_q[b])
        outs.append(causal_attention(q[cu_q[b] : cu_q[b + 1]], k, v[ks], start, scale))
    out = torch.cat(outs) if outs else q.new_empty(0, q.shape[1], v.shape[-1])
    return out.to(q.dtype)


def prefill_attention_sdpa(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                           cu_q: list[int], cu_k: list[int], scale: float) -> torch.Tensor:
    """The same attention through ``torch.nn.functional.scaled_dot_product_attention``, one call per
    sequence (one call for the whole batch when all sequences have equal lengths and no cache).
    SDPA wants one key tensor ``[.., h, n, 192]``, so ``k_pe`` is expanded to every head here."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    with sdpa_kernel(SDPA_BACKENDS, set_priority=True):  # cuDNN first: the fastest on the H200 (chapter 06)
        return _sdpa(q, k_nope, k_pe, v, cu_q, cu_k, scale, causal_lower_right)


SDPA_BACKENDS = None  # set below: cuDNN, FlashAttention, memory-efficient, math (in this order of priority)


def sdpa_prep(k_nope: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """The key SDPA needs, ``[Tk, h, 192]``: ``k_pe`` copied to every head (the SDPA path's extra cost)."""
    h = k_nope.shape[1]
    return torch.cat([k_nope, k_pe[:, None, :].expand(-1, h, -1)], dim=-1)


def _sdpa(q, k_nope, k_pe, v, cu_q, cu_k, scale, causal_lower_right):
    h = k_nope.shape[1]
    k = sdpa_prep(k_nope, k_pe)
    lens_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    if len(set(lens_q)) == 1 and lens_q == lens_k and lens_q[0] > 0:  # equal lengths, nothing cached: one batch
        n, B = lens_q[0], len(lens_q)
        o = F.scaled_dot_product_attention(*(x.reshape(B, n, h, -1).transpose(1, 2) for x in (q, k, v)),
                                           is_causal=True, scale=scale)
        return o.transpose(1, 2).reshape(B * n, h, -1)
    out = q.new_empty(q.shape[0], h, v.shape[-1])
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        if nq == 0:
            continue
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        mask = True if nq == nk else causal_lower_right(nq, nk)
        args = (x.transpose(0, 1)[None] for x in (q[qs], k[ks], v[ks]))
        o = F.scaled_dot_product_attention(*args, is_causal=mask is True, attn_mask=None if mask is True else mask,
                                           scale=scale)
        out[qs] = o[0].transpose(0, 1)
    return out


def _sdpa_backends():
    from torch.nn.attention import SDPBackend

    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


SDPA_BACKENDS = _sdpa_backends()


def tile_schedule(cu_q: list[int], cu_k: list[int], block_q: int) -> list[tuple[int, int]]:
    """The query tiles ``(sequence b, first query q0)`` of ``block_q`` queries, heaviest first.

    A tile's work is the number of keys its last query sees, ``start + min(q0 + block_q, nq)``;
    launching the long tiles first lets the short ones fill the GPU at the end.
    """
    tiles = []
    for b in range(len(cu_q) - 1):
        nq, nk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        tiles += [(nk - nq + min(q0 + block_q, nq), b, q0) for q0 in range(0, nq, block_q)]
    return [(b, q0) for _, b, q0 in sorted(tiles, key=lambda x: -x[0])]


def prefill_attention(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                      cu_seqlens_q, cu_seqlens_k, scale: float, version: str | None = None) -> torch.Tensor:
    """Causal attention of packed queries ``q [Tq, h, 192]`` over keys ``[k_nope [Tk, h, 128] | k_pe [Tk, 64]]``
    and values ``v [Tk, h, 128]`` -> ``[Tq, h, 128]`` in ``q.dtype`` (layout: module docstring).

    ``version`` forces ``"naive"``, ``"tiled"``, one of the tensor-core variants (``"mma"``, ... : the keys of
    :data:`MMA_VARIANTS`) or ``"sdpa"`` (CUDA tensors; the chapter and the benchmark use it). By default:
    the reference on the CPU; on CUDA, :func:`prefill_backend` picks SDPA or our kernel, which is the
    tensor-core one (variant by :func:`kernel_variant`) for bf16/fp16 and the tiled CUDA-core one for fp32
    (or for 16-bit tensors whose rows are not 16-byte aligned). Head sizes other than 128/64/128 go to SDPA.
    """
    if version is not None and version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    if q.dim() != 3 or k_nope.dim() != 3 or v.dim() != 3 or k_pe.dim() != 2:
        raise ValueError(f"want q [Tq, h, dq], k_nope [Tk, h, dn], k_pe [Tk, dr], v [Tk, h, dv]; got "
                         f"{list(q.shape)}, {list(k_nope.shape)}, {list(k_pe.shape)}, {list(v.shape)}")
    Tq, h, dq = q.shape
    Tk = k_nope.shape[0]
    if k_nope.shape[1] != h or v.shape[:2] != (Tk, h) or k_pe.shape[0] != Tk or dq != k_nope.shape[2] + k_pe.shape[1]:
        raise ValueError(f"inconsistent shapes: q {list(q.shape)}, k_nope {list(k_nope.shape)}, "
                         f"k_pe {list(k_pe.shape)}, v {list(v.shape)}")
    if version is None and not kernels.use_kernels(q):
        return prefill_attention_reference(q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, scale)
    cu_q, cu_k = seqlens(cu_seqlens_q, cu_seqlens_k, Tq, Tk)
    for t, name in ((k_nope, "k_nope"), (k_pe, "k_pe"), (v, "v")):
        kernels.check(t, f"prefill_attention {name}", dtype=q.dtype, device=q.device, contiguous=False)
    kernels.check(q, "prefill_attention q", contiguous=False)
    fixed = (k_nope.shape[2], k_pe.shape[1], v.shape[2]) == (D_NOPE, D_ROPE, D_V)
    if version is None:
        lens_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
        lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
        one_call = len(set(lens_q)) == 1 and lens_q == lens_k
        calls = 1 if one_call else sum(n > 0 for n in lens_q)
        if not fixed or prefill_backend(Tq, max(lens_q), calls) == "sdpa":
            version = "sdpa"
        elif q.dtype != torch.float32 and _aligned(q, k_nope, k_pe, v):
            version = kernel_variant(sum(-(-n // MMA_BQ) for n in lens_q) * h)
        else:
            version = "tiled"
    if version == "sdpa":
        return prefill_attention_sdpa(q, k_nope, k_pe, v, cu_q, cu_k, scale)
    if not fixed:
        raise ValueError(f"the {version} kernel is built for head sizes {D_NOPE} + {D_ROPE} / {D_V}; got "
                         f"{k_nope.shape[2]} + {k_pe.shape[1]} / {v.shape[2]}")
    for t, name in ((q, "q"), (k_nope, "k_nope"), (k_pe, "k_pe"), (v, "v")):
        if t.stride(-1) != 1:
            raise ValueError(f"prefill_attention {name}: the last dimension must be contiguous (strides {t.stride()})")
    mma = version in MMA_VARIANTS
    if mma:
        if q.dtype == torch.float32:
            raise TypeError("the mma kernel takes bfloat16 or float16 (fp32 goes to the tiled kernel)")
        if not _aligned(q, k_nope, k_pe, v):
            raise ValueError("the mma kernel needs 16-byte aligned rows: pointers and row/head strides in multiples of 8")
    out = torch.empty(Tq, h, D_V, dtype=q.dtype, device=q.device)
    if Tq == 0:
        return out
    block_q = 0 if version == "naive" else 16 * MMA_VARIANTS[version][0] if mma else TILED_BQ
    cu_dev, tiles_dev = _device_plan(tuple(cu_q), tuple(cu_k), block_q, q.device)
    strides = (q.stride(0), q.stride(1), k_nope.stride(0), k_nope.stride(1), k_pe.stride(0), v.stride(0), v.stride(1))
    tail = (*(np.int64(s) for s in strides), np.float32(scale * np.log2(np.e)))
    ptrs = (kernels.ptr(out), kernels.ptr(q), kernels.ptr(k_nope), kernels.ptr(k_pe), kernels.ptr(v),
            kernels.ptr(cu_dev[0]), kernels.ptr(cu_dev[1]))
    if version == "naive":
        kernel = ATTENTION_CU.function(f"attention_prefill_naive<{CUDA_TYPE[q.dtype]}>", q.device)
        threads = 128
        kernels.launch(kernel, (-(-Tq * h // threads),), (threads,),
                       (*ptrs, np.int32(len(cu_q) - 1), np.int32(Tq), np.int32(h), *tail))
        return out
    if h > 65535:
        raise ValueError(f"{h} heads exceed the grid's y limit")
    if not mma:
        kernel = ATTENTION_CU.function(f"attention_prefill_tiled<{CUDA_TYPE[q.dtype]}>", q.device)
        kernels.launch(kernel, (tiles_dev.shape[0], h), (128,), (*ptrs, kernels.ptr(tiles_dev), *tail))
        return out
    kernel = _mma_kernel(version, CUDA_TYPE[q.dtype], q.device)
    kernels.launch(kernel, (tiles_dev.shape[0], h), (32 * MMA_VARIANTS[version][0],),
                   (*ptrs, kernels.ptr(tiles_dev), *tail), shared_mem=mma_shared_bytes(version))
    return out


def _mma_kernel(variant: str, ctype: str, device: torch.device):
    """The compiled tensor-core variant, allowed the dynamic shared memory it needs (above 48 KB is opt-in)."""
    kernel = ATTENTION_CU.function(_mma_name(variant, ctype), device)
    smem = mma_shared_bytes(variant)
    if smem > 48 * 1024 and getattr(kernel, "max_dynamic_shared_size_bytes", 0) < smem:
        kernel.max_dynamic_shared_size_bytes = smem
    return kernel


@functools.lru_cache(maxsize=64)
def _device_plan(cu_q: tuple, cu_k: tuple, block_q: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cu_seqlens`` and the tile list on the GPU, kept for the next call with the same lengths: a
    repeated shape then copies nothing from the host, so a benchmark can capture it in a CUDA graph."""
    cu = torch.tensor([cu_q, cu_k], dtype=torch.int32).to(device, non_blocking=True)
    tiles = tile_schedule(list(cu_q), list(cu_k), block_q) if block_q else [(0, 0)]
    return cu, torch.tensor(tiles, dtype=torch.int32).reshape(-1, 2).to(device, non_blocking=True)


def _aligned(*tensors: torch.Tensor) -> bool:
    """16-byte aligned pointers and row/head strides (in elements) that keep every row 16-byte aligned."""
    return kernels.aligned16(*tensors) and all(s % (16 // t.element_size()) == 0
                                               for t in tensors for s in t.stride()[:-1])
