"""Chapter 10's latent decode kernel with uniform split-KV: ``mla_decode`` over a contiguous cache.

The op is :mod:`dsv2_lib.ops.mla_decode`'s (same shapes, same reference), here over a contiguous cache
``[num_slots, max_len, D]``: entry ``b`` attends over rows ``0 .. lengths[b]-1`` of slot ``slots[b]``. The
kernel (``kernels_cu/lessons/mla_decode_split.cu``) runs the block body the engine's kernel runs
(``attend_rows``, ``kernels_cu/mla_decode.cuh``) and cuts every entry's context into the same number of
chunks, one block each, merged by a second kernel or, fused, by the last block to finish.

The engine does not use it: it decodes over the paged cache with chapter 13's balanced schedule
(:func:`~dsv2_lib.ops.mla_decode.mla_decode_paged`), which keeps every SM busy when lengths are mixed or
bounded by a CUDA graph. This kernel is here to be taught, and measured against that one
(:func:`mla_decode_paged_uniform`: the same uniform splits over the paged cache).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from dsv2_lib.core import kernels
from dsv2_lib.core.kernels import CUDA_TYPE
from dsv2_lib.ops.mla_decode import (
    COMBINE_WARPS,
    HEADER_DEFINES,
    HEADS_PER_BLOCK,
    SHAPES,
    STAGES,
    TILE,
    WARPS,
    _blocks_per_wave,
    _checked_lengths,
    _checked_query,
    _out_buffer,
    _paged_inputs,
    _shared_bytes,
    _sms,
    latent_kernel_applies,
    mla_decode_paged_reference,
    mla_decode_reference,
)

DEFAULT_STAGES = 2  # two stages at two blocks per SM stream best (set by benchmarks/bench_mla_decode.py)
# The default policy fuses the combine up to this many splits (one block merges them): fused ties the combine
# kernel at 2 splits and loses from 4 on, where the last block's serial merge of every split outlasts a
# second launch (set by benchmarks/bench_mla_decode.py).
FUSED_MAX_SPLITS = 2
# A split streams at least this many 32-row tiles: at serving contexts the parallelism matters more than
# amortising each split's query load and partial write (set by benchmarks/bench_mla_decode_paged.py's sweep).
MIN_TILES_PER_SPLIT = 1
COMBINE_WIDTH = 2  # floats per lane of mla_decode_combine's merge (merge_partials<COMBINE_WIDTH>)
COMBINE_COLS = 32 * COMBINE_WIDTH  # output columns of a mla_decode_combine block: 64
MLA_DECODE_SPLIT_CU = kernels.declare(
    "lessons/mla_decode_split.cu",
    [f"mla_decode_split<{t}, {dl}, {dr}, {s}, {p}>" for t in ("__half", "__nv_bfloat16") for dl, dr in SHAPES
     for s in STAGES for p in ("false", "true")] + ["mla_decode_combine"],
    {**HEADER_DEFINES, "DSV2_MLA_SPLIT_COMBINE_WIDTH": COMBINE_WIDTH},
)


def mla_decode_config(batch_size: int, heads: int, max_length: int, sms: int) -> tuple[int | None, int, bool | None]:
    """The default launch configuration ``(num_splits, stages, fused)``; ``num_splits = None`` lets
    :func:`mla_decode_splits` fill one wave at that depth's occupancy, ``fused = None`` fuses the combine
    when there are at most :data:`FUSED_MAX_SPLITS` splits. A module-level function so that
    ``benchmarks/bench_mla_decode.py`` (and a user) can replace it with what measurement says: two
    stages at two blocks per SM stream best at large batch; deeper pipelines and the fused combine are
    the candidates the benchmark compares.
    """
    return None, DEFAULT_STAGES, None


def mla_decode_splits(batch_size: int, heads: int, max_length: int, blocks_per_wave: int) -> tuple[int, int]:
    """``(splits, chunk)``: how many blocks share one entry's context, and the rows each covers.

    ``batch_size × ⌈heads/16⌉`` blocks exist without splitting. When they do not fill one wave of
    ``blocks_per_wave`` resident blocks (SMs × blocks per SM), each entry's context is cut into chunks
    of whole 32-row tiles — at least ``MIN_TILES_PER_SPLIT`` — so that all blocks together fill
    about one wave. ``splits · chunk >= max_length`` always.
    """
    tiles = max(1, -(-max_length // TILE))
    base = batch_size * -(-heads // HEADS_PER_BLOCK)
    want = max(1, blocks_per_wave // max(base, 1))
    chunk_tiles = max(min(MIN_TILES_PER_SPLIT, tiles), -(-tiles // want))
    return -(-tiles // chunk_tiles), chunk_tiles * TILE


def mla_decode_workspace(batch_size: int, heads: int, splits: int, kv_lora_rank: int,
                         device: torch.device | str) -> torch.Tensor:
    """fp32 scratch for the split-KV partials: ``B·h·splits·(kv_lora_rank + 1)`` values (o, then lse).
    Allocate it once (for the largest batch and split count) to keep a decode step free of allocations."""
    return torch.empty(batch_size * heads * splits * (kv_lora_rank + 1), dtype=torch.float32, device=device)


def mla_decode(query: torch.Tensor, cache: torch.Tensor, slots: Sequence[int] | torch.Tensor,
               lengths: Sequence[int] | torch.Tensor, scale: float, kv_lora_rank: int, *,
               max_length: int | None = None, out: torch.Tensor | None = None,
               workspace: torch.Tensor | None = None, num_splits: int | None = None,
               stages: int | None = None, fused: bool | None = None,
               counters: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed decode attention, ``query [B, h, D]`` -> fp32 ``[B, h, kv_lora_rank]`` (see the module doc).

    ``slots``/``lengths`` are either host sequences of ints — checked here (``0 <= slot < num_slots``,
    ``1 <= length <= max_len``) and copied to the GPU — or int32 tensors on the query's device, which
    the host cannot read without a sync: then ``max_length`` (a host bound on every length, e.g. from
    the :class:`~dsv2_lib.model.cache.SequenceBatch`) is required, and the kernel clamps each length to it
    and gives zeros for a slot out of range. ``out``, ``workspace`` (:func:`mla_decode_workspace`) and
    ``num_splits`` let a caller preallocate and fix everything, as a CUDA graph needs.

    ``num_splits``, ``stages`` (pipeline depth, one of :data:`~dsv2_lib.ops.mla_decode.STAGES`) and
    ``fused`` (merge the splits in the last block of each head group instead of a second launch) default
    to :func:`mla_decode_config`. The fused combine takes tickets from ``counters`` (int32, at least
    ``B·⌈h/16⌉`` zeros, :func:`mla_decode_counters`), which every launch leaves at zero again; without
    it a per-device buffer is used (one stream at a time).
    """
    if not kernels.use_kernels(query) or not latent_kernel_applies(cache, kv_lora_rank):
        return mla_decode_reference(query, cache, slots, lengths, scale, kv_lora_rank)
    num_slots, max_len, D = cache.shape if cache.dim() == 3 else (0, 0, 0)
    kernels.check(cache, "mla_decode cache", shape=(None, None, None))
    B = _checked_query(query, cache, D, "mla_decode")
    slots_t, lengths_t, max_length = _entries(slots, lengths, B, num_slots, max_len, max_length, cache.device)
    return _launch(query, cache, kernels.ptr(slots_t), lengths_t, max_length, scale, kv_lora_rank, out, workspace,
                   num_splits, stages, fused, counters, (num_slots, max_len), None)


def mla_decode_paged_uniform(query: torch.Tensor, cache: torch.Tensor,
                             block_table: torch.Tensor | Sequence[Sequence[int]], lengths: Sequence[int] | torch.Tensor,
                             block_size: int, scale: float, kv_lora_rank: int, *, max_length: int | None = None,
                             out: torch.Tensor | None = None, workspace: torch.Tensor | None = None,
                             num_splits: int | None = None, stages: int | None = None, fused: bool | None = None,
                             counters: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`mla_decode`'s uniform splits over the paged cache ``[num_rows, D]`` (chapter 13's comparison):
    the inputs of :func:`~dsv2_lib.ops.mla_decode.mla_decode_paged`, the launch options of :func:`mla_decode`.
    The kernel is the same instantiation with ``PAGED = true``, so on the same rows, splits and depth its
    results equal the contiguous kernel's bit for bit."""
    if not kernels.use_kernels(query) or not latent_kernel_applies(cache, kv_lora_rank) or cache.dim() != 2:
        return mla_decode_paged_reference(query, cache, block_table, lengths, block_size, scale, kv_lora_rank)
    block_table, lengths_t, max_length = _paged_inputs(query, cache, block_table, lengths, block_size, max_length,
                                                       "mla_decode_paged")
    return _launch(query, cache, np.uint64(0), lengths_t, max_length, scale, kv_lora_rank, out, workspace,
                   num_splits, stages, fused, counters, (0, 0), (block_table, block_size))


def _launch(query, cache, slots_ptr, lengths_t, max_length, scale, kv_lora_rank, out, workspace, num_splits,
            stages, fused, counters, geometry, paged):
    """Configure and launch the split kernel (and the combine) for checked inputs. ``geometry`` is
    ``(num_slots, max_len)`` of a contiguous cache; ``paged`` is ``None`` or ``(block_table, block_size)``
    for a flat paged cache ``[num_rows, D]``."""
    B, H, D = query.shape
    num_slots, max_len = geometry
    if num_splits is None or stages is None or fused is None:
        d_splits, d_stages, d_fused = mla_decode_config(B, H, max_length, _sms(cache.device))
        num_splits = d_splits if num_splits is None else num_splits
        stages = d_stages if stages is None else stages
        fused = d_fused if fused is None else fused
    if stages not in STAGES:
        raise ValueError(f"mla_decode: stages must be one of {STAGES}, got {stages}")
    out = _out_buffer(out, B, H, kv_lora_rank, cache.device)
    if B == 0 or H == 0:
        return out
    name = (f"mla_decode_split<{CUDA_TYPE[cache.dtype]}, {kv_lora_rank}, {D - kv_lora_rank}, {stages}, "
            f"{'true' if paged else 'false'}>")
    kernel = MLA_DECODE_SPLIT_CU.function(name, cache.device)
    smem = _shared_bytes(stages, D, cache.dtype)
    blocks_per_wave = _blocks_per_wave(kernel, smem, cache.device)  # also opts the kernel in to `smem` bytes
    if num_splits is None:
        splits, chunk = mla_decode_splits(B, H, max_length, blocks_per_wave)
    else:
        if num_splits < 1:
            raise ValueError(f"mla_decode: num_splits must be >= 1, got {num_splits}")
        tiles = -(-max_length // TILE)
        chunk = -(-tiles // num_splits) * TILE
        splits = max(1, -(-max_length // chunk))
    grid = (splits, B, -(-H // HEADS_PER_BLOCK))
    null = np.uint64(0)
    if paged is None:
        table_args = dict(block_table=null, table_width=np.int32(0), block_size=np.int32(0), num_rows=np.int64(0))
    else:
        table, block_size = paged
        table_args = dict(block_table=kernels.ptr(table), table_width=np.int32(table.shape[1]),
                          block_size=np.int32(block_size), num_rows=np.int64(cache.shape[0]))
    common = dict(q=kernels.ptr(query), cache=kernels.ptr(cache), slots=slots_ptr, lengths=kernels.ptr(lengths_t),
                  H=np.int32(H), num_slots=np.int32(num_slots), max_len=np.int32(max_len),
                  max_length=np.int32(max_length), chunk=np.int32(chunk),
                  scale_log2=np.float32(scale * 1.4426950408889634), **table_args)
    if splits == 1:  # the block writes the final result; no combine
        MLA_DECODE_SPLIT_CU.launch(name, cache.device, grid, (WARPS * 32,), shared_mem=smem, o_part=kernels.ptr(out),
                                   lse_part=null, final_out=null, counters=null, **common)
        return out
    need = B * H * splits * (kv_lora_rank + 1)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=cache.device)
    kernels.check(workspace, "mla_decode workspace", dtype=torch.float32, device=cache.device)
    if workspace.numel() < need:
        raise ValueError(f"mla_decode workspace: {workspace.numel()} values, this call needs {need} "
                         f"(batch {B}, {H} heads, {splits} splits, kv_lora_rank {kv_lora_rank})")
    o_part = workspace[: B * H * splits * kv_lora_rank]
    lse = workspace[B * H * splits * kv_lora_rank : need]
    if not kernels.aligned16(o_part):
        raise ValueError("mla_decode workspace: must start on a 16-byte boundary")
    groups = -(-H // HEADS_PER_BLOCK)
    if fused is None:
        fused = splits <= FUSED_MAX_SPLITS
    if fused:
        if counters is None:
            counters = _counter_buffer(cache.device, B * groups)
        kernels.check(counters, "mla_decode counters", dtype=torch.int32, device=cache.device)
        if counters.numel() < B * groups:
            raise ValueError(f"mla_decode counters: {counters.numel()} values, this call needs {B * groups}")
        MLA_DECODE_SPLIT_CU.launch(name, cache.device, grid, (WARPS * 32,), shared_mem=smem,
                                   o_part=kernels.ptr(o_part), lse_part=kernels.ptr(lse), final_out=kernels.ptr(out),
                                   counters=kernels.ptr(counters), **common)
        return out
    MLA_DECODE_SPLIT_CU.launch(name, cache.device, grid, (WARPS * 32,), shared_mem=smem, o_part=kernels.ptr(o_part),
                               lse_part=kernels.ptr(lse), final_out=null, counters=null, **common)
    MLA_DECODE_SPLIT_CU.launch("mla_decode_combine", cache.device, (-(-kv_lora_rank // COMBINE_COLS), H, B),
                               (COMBINE_WARPS * 32,), out=kernels.ptr(out), o_part=kernels.ptr(o_part),
                               lse=kernels.ptr(lse), splits=np.int32(splits), dl=np.int32(kv_lora_rank))
    return out


def mla_decode_counters(batch_size: int, heads: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed int32 tickets for the fused combine: one per (entry, group of 16 heads). Every launch
    leaves them at zero, so one buffer serves every call on one stream (and CUDA-graph replays)."""
    return torch.zeros(batch_size * -(-heads // HEADS_PER_BLOCK), dtype=torch.int32, device=device)


_COUNTERS: dict[str, torch.Tensor] = {}


def _counter_buffer(device: torch.device, n: int) -> torch.Tensor:
    """The per-device ticket buffer, grown (outside graph capture) to at least ``n`` counters."""
    key = str(device)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("mla_decode: the fused combine needs `counters` (mla_decode_counters) during CUDA-graph "
                               "capture, or a call of this size before capture")
        buf = _COUNTERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


def _entries(slots, lengths, B: int, num_slots: int, max_len: int, max_length: int | None, device):
    """int32 device tensors of slots and lengths, and the host bound on the lengths, checked."""
    if torch.is_tensor(slots) != torch.is_tensor(lengths):
        raise TypeError("mla_decode: pass slots and lengths both as host sequences or both as device tensors")
    if not torch.is_tensor(slots) and (len(slots) != B or len(lengths) != B):
        raise ValueError(f"mla_decode: {len(slots)} slots and {len(lengths)} lengths for a batch of {B}")
    lengths, max_length = _checked_lengths(lengths, B, max_len, max_length, device, "mla_decode",
                                           "the cache's rows per slot")
    if torch.is_tensor(slots):
        kernels.check(slots, "mla_decode slots", dtype=torch.int32, shape=(B,), device=device)
        return slots, lengths, max_length
    slots = tuple(int(s) for s in slots)
    for s in slots:
        if not 0 <= s < num_slots:
            raise IndexError(f"mla_decode: slot {s} out of range: the cache has {num_slots} slots")
    return (*_device_entries(slots, lengths, device), max_length)


@functools.lru_cache(maxsize=8)
def _device_entries(slots: tuple[int, ...], lengths: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
    """The same host tuples -> the same device tensors: every layer of a decode step reuses one copy."""
    both = torch.tensor([slots, lengths], dtype=torch.int32).to(device, non_blocking=True)
    return both[0], both[1]
