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
This module holds what the engine runs: the tiled kernel and the tensor-core variants it launches. The
chapter's naive kernel and its other tensor-core configurations are in ``dsv2_lib.lessons.attention_prefill``,
launched through :func:`kernel_args` and :func:`launch_mma`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from dsv2_lib.core import kernels
from dsv2_lib.core.dtypes import upcast
from dsv2_lib.core.kernels import CUDA_TYPE

D_NOPE, D_ROPE, D_V = 128, 64, 128  # the head sizes the kernels are built for
D_QK, BK = D_NOPE + D_ROPE, 64       # the query/key head size; keys per tile of the tensor-core kernels
ROW_PAD = 8                          # elements of padding per shared row of the tensor-core kernels (16 bytes)
TILED_BQ, TILED_THREADS = 16, 128    # queries and threads per block of the tiled kernel
MMA_BQ = 64                          # kernel_variant counts a launch in tiles of this many queries
MMA_TYPES = ("__half", "__nv_bfloat16")
# The constants of kernels_cu/attention_prefill.cuh, for every kernel file that includes it.
HEADER_DEFINES = {"DSV2_ATTN_D_NOPE": D_NOPE, "DSV2_ATTN_D_ROPE": D_ROPE, "DSV2_ATTN_D_V": D_V, "DSV2_ATTN_BK": BK,
                  "DSV2_ATTN_ROW_PAD": ROW_PAD}


class MmaVariant(NamedTuple):
    """One configuration of the tensor-core template ``attention_prefill_mma<T, NW, QS, ST, MINB>``
    (kernels_cu/attention_prefill.cuh): ``warps`` per block (NW; a block takes 16 NW queries), Q held in
    shared memory instead of registers (QS), ``stages`` K/V buffers (ST), ``min_blocks`` per SM (MINB)."""

    warps: int
    q_in_smem: bool
    stages: int
    min_blocks: int

    def kernel_name(self, ctype: str) -> str:
        """The instantiation for element type ``ctype`` (``"__half"``, ``"__nv_bfloat16"``)."""
        qs = "true" if self.q_in_smem else "false"
        return f"attention_prefill_mma<{ctype}, {self.warps}, {qs}, {self.stages}, {self.min_blocks}>"

    def shared_bytes(self) -> int:
        """Dynamic shared memory of one block: [sQ if QS][ST K tiles][ST V tiles], padded rows."""
        nw, qs, st = self.warps, self.q_in_smem, self.stages
        k_row, v_row = D_QK + ROW_PAD, D_V + ROW_PAD
        return 2 * ((16 * nw * k_row if qs else 0) + st * BK * k_row + st * BK * v_row)


# The tensor-core variants the engine launches (AttentionTuning picks one per launch), both with two K/V
# buffers: K/V(j+1) in flight during all of tile j. The chapter's other configurations, and the versions
# it builds first, are in dsv2_lib/lessons/attention_prefill.py.
MMA_VARIANTS = {
    "mma_w8_st2": MmaVariant(8, False, 2, 1),  # 128 queries per block: half the K/V bytes per FLOP from L2
    "mma_w4_st2": MmaVariant(4, False, 2, 2),  # 64 queries: more blocks for smaller launches
}
VERSIONS = ("tiled", *MMA_VARIANTS, "sdpa")

ATTENTION_CU = kernels.declare(
    "attention_prefill.cu",
    [f"attention_prefill_tiled<{t}>" for t in CUDA_TYPE.values()]
    + [m.kernel_name(t) for m in MMA_VARIANTS.values() for t in MMA_TYPES],
    {**HEADER_DEFINES, "DSV2_ATTN_TILED_BQ": TILED_BQ, "DSV2_ATTN_TILED_THREADS": TILED_THREADS},
)


@dataclass(frozen=True)
class AttentionTuning:
    """Where :func:`prefill_attention` switches path, by shape: defaults for the H200. The two
    ``sdpa_min_*`` thresholds are measured by ``python -m dsv2_lib calibrate`` (one sequence, our kernel
    against SDPA as the engine calls it, the copy of ``k_pe`` to every head included); the two variants
    by ``benchmarks/bench_attention_prefill.py``; ``sdpa_max_calls`` and ``small_tiles`` are set by hand.
    Batches SDPA would need many calls for (mixed lengths or a cached prefix: one call per sequence) take
    our kernel at every length."""

    sdpa_min_tokens: int = 1024   # SDPA at or above this many packed query tokens ...
    sdpa_min_max_len: int = 1024  # ... provided the longest sequence has at least this many ...
    sdpa_max_calls: int = 8       # ... and SDPA needs at most this many calls (1 when all lengths are equal)
    kernel_variant: str = "mma_w8_st2"        # our tensor-core variant from small_tiles on ...
    small_kernel_variant: str = "mma_w4_st2"  # ... and below (a key of MMA_VARIANTS)
    small_tiles: int = 2048       # MMA_BQ-query tiles times heads: 8 x 512 is 1024, 8 x 4096 is 8192

    def __post_init__(self):
        for v in (self.kernel_variant, self.small_kernel_variant):
            if v not in MMA_VARIANTS:
                raise ValueError(f"AttentionTuning: {v!r} is not one of the engine's variants {list(MMA_VARIANTS)}")


TUNING = AttentionTuning()


def prefill_backend(num_tokens: int, max_len: int, num_calls: int = 1, tuning: AttentionTuning = TUNING) -> str:
    """``"sdpa"`` or ``"kernel"`` for ``num_tokens`` packed queries whose longest sequence has
    ``max_len``, where SDPA would take ``num_calls`` calls: the faster one by ``tuning``'s thresholds."""
    return ("sdpa" if num_tokens >= tuning.sdpa_min_tokens and max_len >= tuning.sdpa_min_max_len
            and num_calls <= tuning.sdpa_max_calls else "kernel")


def kernel_variant(num_tiles: int, tuning: AttentionTuning = TUNING) -> str:
    """The tensor-core variant for a launch of ``num_tiles`` (64-query tiles x heads) blocks' worth of work."""
    return tuning.small_kernel_variant if num_tiles < tuning.small_tiles else tuning.kernel_variant


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
                      cu_seqlens_q, cu_seqlens_k, scale: float, version: str | None = None,
                      tuning: AttentionTuning = TUNING) -> torch.Tensor:
    """Causal attention of packed queries ``q [Tq, h, 192]`` over keys ``[k_nope [Tk, h, 128] | k_pe [Tk, 64]]``
    and values ``v [Tk, h, 128]`` -> ``[Tq, h, 128]`` in ``q.dtype`` (layout: module docstring).

    ``version`` forces ``"tiled"``, one of the engine's tensor-core variants (the keys of
    :data:`MMA_VARIANTS`) or ``"sdpa"`` (CUDA tensors; the chapter and the benchmark use it). By default:
    the reference on the CPU; on CUDA, :func:`prefill_backend` picks SDPA or our kernel, which is the
    tensor-core one (variant by :func:`kernel_variant`) for bf16/fp16 and the tiled CUDA-core one for fp32
    (or for 16-bit tensors whose rows are not 16-byte aligned), by ``tuning``'s thresholds. Head sizes
    other than 128/64/128 go to SDPA.
    """
    if version is not None and version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    check_shapes(q, k_nope, k_pe, v)
    if version is None and not kernels.use_kernels(q):
        return prefill_attention_reference(q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, scale)
    cu_q, cu_k = cuda_seqlens(q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k)
    Tq, h = q.shape[:2]
    fixed = (k_nope.shape[2], k_pe.shape[1], v.shape[2]) == (D_NOPE, D_ROPE, D_V)
    if version is None:
        lens_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
        lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
        one_call = len(set(lens_q)) == 1 and lens_q == lens_k
        calls = 1 if one_call else sum(n > 0 for n in lens_q)
        if not fixed or prefill_backend(Tq, max(lens_q), calls, tuning) == "sdpa":
            version = "sdpa"
        elif q.dtype != torch.float32 and _aligned(q, k_nope, k_pe, v):
            version = kernel_variant(sum(-(-n // MMA_BQ) for n in lens_q) * h, tuning)
        else:
            version = "tiled"
    if version == "sdpa":
        return prefill_attention_sdpa(q, k_nope, k_pe, v, cu_q, cu_k, scale)
    if version != "tiled":
        return launch_mma(ATTENTION_CU, MMA_VARIANTS[version], q, k_nope, k_pe, v, cu_q, cu_k, scale)
    check_layout(q, k_nope, k_pe, v, "tiled", mma=False)
    out = torch.empty(Tq, h, D_V, dtype=q.dtype, device=q.device)
    if Tq:
        args, tiles = kernel_args(out, q, k_nope, k_pe, v, cu_q, cu_k, scale, TILED_BQ)
        ATTENTION_CU.launch(f"attention_prefill_tiled<{CUDA_TYPE[q.dtype]}>", q.device, (tiles.shape[0], h),
                            (TILED_THREADS,), tiles=kernels.ptr(tiles), **args)
    return out


def check_shapes(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor) -> None:
    """Refuse inputs that are not ``q [Tq, h, dn + dr]``, ``k_nope [Tk, h, dn]``, ``k_pe [Tk, dr]``,
    ``v [Tk, h, dv]``."""
    if q.dim() != 3 or k_nope.dim() != 3 or v.dim() != 3 or k_pe.dim() != 2:
        raise ValueError(f"want q [Tq, h, dq], k_nope [Tk, h, dn], k_pe [Tk, dr], v [Tk, h, dv]; got "
                         f"{list(q.shape)}, {list(k_nope.shape)}, {list(k_pe.shape)}, {list(v.shape)}")
    h, dq, Tk = q.shape[1], q.shape[2], k_nope.shape[0]
    if k_nope.shape[1] != h or v.shape[:2] != (Tk, h) or k_pe.shape[0] != Tk or dq != k_nope.shape[2] + k_pe.shape[1]:
        raise ValueError(f"inconsistent shapes: q {list(q.shape)}, k_nope {list(k_nope.shape)}, "
                         f"k_pe {list(k_pe.shape)}, v {list(v.shape)}")


def cuda_seqlens(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                 cu_seqlens_q, cu_seqlens_k) -> tuple[list[int], list[int]]:
    """What every CUDA path checks first: the prefix sums (:func:`seqlens`, returned as host lists), then
    one dtype and one CUDA device for all four tensors (any strides)."""
    cu_q, cu_k = seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k_nope.shape[0])
    for t, name in ((k_nope, "k_nope"), (k_pe, "k_pe"), (v, "v")):
        kernels.check(t, f"prefill_attention {name}", dtype=q.dtype, device=q.device, contiguous=False)
    kernels.check(q, "prefill_attention q", contiguous=False)
    return cu_q, cu_k


def check_layout(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor, kernel: str,
                 mma: bool) -> None:
    """What our kernels need on top of :func:`cuda_seqlens`: head sizes 128 + 64 / 128 and contiguous
    rows; the tensor-core ones (``mma``) also 16-bit values in 16-byte aligned rows (``cp.async``)."""
    if (k_nope.shape[2], k_pe.shape[1], v.shape[2]) != (D_NOPE, D_ROPE, D_V):
        raise ValueError(f"the {kernel} kernel is built for head sizes {D_NOPE} + {D_ROPE} / {D_V}; got "
                         f"{k_nope.shape[2]} + {k_pe.shape[1]} / {v.shape[2]}")
    for t, name in ((q, "q"), (k_nope, "k_nope"), (k_pe, "k_pe"), (v, "v")):
        if t.stride(-1) != 1:
            raise ValueError(f"prefill_attention {name}: the last dimension must be contiguous (strides {t.stride()})")
    if mma:
        if q.dtype == torch.float32:
            raise TypeError("the mma kernel takes bfloat16 or float16 (fp32 goes to the tiled kernel)")
        if not _aligned(q, k_nope, k_pe, v):
            raise ValueError("the mma kernel needs 16-byte aligned rows: pointers and row/head strides in multiples of 8")


def kernel_args(out: torch.Tensor, q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                cu_q: list[int], cu_k: list[int], scale: float, block_q: int) -> tuple[dict, torch.Tensor]:
    """The arguments every version's kernel takes, by name, and the tiles: ``(args, tiles)``, ``args`` the
    pointers ``out, q, k_nope, k_pe, v, cu_q, cu_k``, the strides and the scale (each launch adds what is its
    own), ``tiles`` the list of :func:`tile_schedule` for blocks of ``block_q`` queries on the GPU
    (``block_q = 0``: none needed)."""
    if block_q and q.shape[1] > 65535:
        raise ValueError(f"{q.shape[1]} heads exceed the grid's y limit")
    cu_dev, tiles = _device_plan(tuple(cu_q), tuple(cu_k), block_q, q.device)
    args = dict(out=kernels.ptr(out), q=kernels.ptr(q), k_nope=kernels.ptr(k_nope), k_pe=kernels.ptr(k_pe),
                v=kernels.ptr(v), cu_q=kernels.ptr(cu_dev[0]), cu_k=kernels.ptr(cu_dev[1]),
                sq_t=np.int64(q.stride(0)), sq_h=np.int64(q.stride(1)), sk_t=np.int64(k_nope.stride(0)),
                sk_h=np.int64(k_nope.stride(1)), spe_t=np.int64(k_pe.stride(0)), sv_t=np.int64(v.stride(0)),
                sv_h=np.int64(v.stride(1)), scale_log2=np.float32(scale * np.log2(np.e)))
    return args, tiles


def launch_mma(kernel_file: kernels.KernelFile, variant: MmaVariant, q: torch.Tensor, k_nope: torch.Tensor,
               k_pe: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int], scale: float) -> torch.Tensor:
    """The tensor-core kernel in configuration ``variant`` (declared by ``kernel_file``) on inputs that passed
    :func:`cuda_seqlens`: one block per tile of ``16 * variant.warps`` queries and head, heaviest first."""
    check_layout(q, k_nope, k_pe, v, "mma", mma=True)
    Tq, h = q.shape[:2]
    out = torch.empty(Tq, h, D_V, dtype=q.dtype, device=q.device)
    if Tq:
        args, tiles = kernel_args(out, q, k_nope, k_pe, v, cu_q, cu_k, scale, 16 * variant.warps)
        name = variant.kernel_name(CUDA_TYPE[q.dtype])
        kernel = kernel_file.function(name, q.device)
        smem = variant.shared_bytes()
        if smem > 48 * 1024 and getattr(kernel, "max_dynamic_shared_size_bytes", 0) < smem:
            kernel.max_dynamic_shared_size_bytes = smem  # above 48 KB is opt-in
        kernel_file.launch(name, q.device, (tiles.shape[0], h), (32 * variant.warps,), shared_mem=smem,
                           tiles=kernels.ptr(tiles), **args)
    return out


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
