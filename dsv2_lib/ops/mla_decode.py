"""MLA decode attention on the latent cache, with ``W_k`` and ``W_v`` absorbed (chapter 10).

One query per batch entry attends directly over cached rows ``[latent (kv_lora) | k_pe (rope)]``:

* ``query [B, h, D]``, ``D = kv_lora + rope`` (576 for V2-Lite): ``[W_kᵀ q_nope | q_pe]`` per head;
* ``cache [num_slots, max_len, D]``: one layer of :class:`~dsv2_lib.model.cache.LatentCache`;
* ``slots [B]``, ``lengths [B]``: entry ``b`` attends over rows ``0 .. lengths[b]-1`` of slot
  ``slots[b]`` (the new token's row included, already written);
* result ``[B, h, kv_lora]`` in fp32: ``Σ_t softmax_t(scale · query · row_t) · latent_t``, which the
  caller maps through ``W_v``.

The kernel (``kernels_cu/mla_decode.cu``) reads each row once for all 16 heads of a block, runs
both products on the tensor cores and splits long contexts over several blocks (split-KV), merged
by a log-sum-exp combine kernel. It takes bf16 or fp16 (the query in the cache's dtype: the MMA
multiplies that type); an fp32 cache, and shapes without a compiled instantiation, take the
reference.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from dsv2_lib.core import kernels
from dsv2_lib.core.dtypes import upcast
from dsv2_lib.core.kernels import CUDA_TYPE

HEADS_PER_BLOCK, WARPS, TILE = 16, 4, 32  # kernels_cu/mla_decode.cu: mla::HEADS, WARPS, TILE
SS_PITCH = TILE // 8 * 4 + 4  # mla::SS_PITCH: floats per lane of the kernel's partial-score exchange
STAGES = (2, 3, 4, 5)  # pipeline depths compiled (STAGES - 1 tiles of 32 rows in flight per block)
DEFAULT_STAGES = 2
# The default policy fuses the combine up to this many splits (one block merges them). Measured on
# the H200 (benchmarks/bench_mla_decode.py, 2026-11-29): fused only ties the combine kernel at 2 splits
# (128 x 2048: 105.6 vs 105.8 µs) and loses from 4 on (64 x 4096: 103.0 vs 101.1; 32 x 8192, 8 splits:
# 107.3 vs 100.2), where the last block's serial merge of every split outlasts a second launch.
FUSED_MAX_SPLITS = 2
SHAPES = ((512, 64), (64, 16))  # (kv_lora_rank, rope dim) compiled: DeepSeek-V2(-Lite), the tiny model
# A split streams at least this many 32-row tiles. More rows per split would amortise its query load and
# partial write, but at serving contexts the parallelism matters more: benchmarks/bench_mla_decode_paged.py's
# sweep at 513 rows (H200, 2026-11-29) took 10.4 / 12.0 / 15.9 µs at batch 1 and 15.1 / 16.6 / 20.0 at
# batch 8 for 1 / 2 / 4 tiles, and tied (within 0.4 µs) at batch 32 and 128. Long contexts never reach it.
MIN_TILES_PER_SPLIT = 1
SCHEDULES = ("balanced", "uniform")  # mla_decode_paged: tiles dealt evenly over a wave of workers, or chunks per entry
COMBINE_WARPS, COMBINE_COLS = 8, 64  # kernels_cu/mla_decode.cu: block and output columns of mla_decode_combine
COMBINE_WIDTHS = (2, 4, 8, 16)  # floats per lane of mla_decode_combine_balanced<V>: 64 .. 512 columns a block
MLA_DECODE_CU = kernels.declare(
    "mla_decode.cu",
    [f"mla_decode_split<{t}, {dl}, {dr}, {s}, {p}>" for t in ("__half", "__nv_bfloat16") for dl, dr in SHAPES
     for s in STAGES for p in ("false", "true")] + ["mla_decode_combine"]
    + [f"mla_decode_balanced<{t}, {dl}, {dr}, {s}, true>" for t in ("__half", "__nv_bfloat16") for dl, dr in SHAPES
       for s in STAGES] + ["mla_decode_schedule"] + [f"mla_decode_combine_balanced<{v}>" for v in COMBINE_WIDTHS],
)


def mla_decode_reference(query: torch.Tensor, cache: torch.Tensor, slots: Sequence[int] | torch.Tensor,
                         lengths: Sequence[int] | torch.Tensor, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """Absorbed decode attention in fp32 (or wider): ``query [B, h, D]`` -> ``[B, h, kv_lora_rank]``.

    Entry ``b`` scores ``query[b]`` against every row ``[latent | k_pe]`` of ``cache[slots[b], :lengths[b]]``
    (``q_lat · latent + q_pe · k_pe``: one dot product per row and head), softmaxes over the rows and
    returns the weighted sum of the latents.
    """
    slots = slots.tolist() if torch.is_tensor(slots) else list(slots)
    lengths = lengths.tolist() if torch.is_tensor(lengths) else list(lengths)
    q = upcast(query)
    outs = []
    for b, (slot, n) in enumerate(zip(slots, lengths)):
        rows = upcast(cache[slot, :n])  # [n, D]
        p = (torch.einsum("hd,td->ht", q[b], rows) * scale).softmax(dim=-1)
        outs.append(p @ rows[:, :kv_lora_rank])
    return torch.stack(outs) if outs else q.new_zeros(0, query.shape[1], kv_lora_rank)


def mla_decode_query_dtype(cache: torch.Tensor, kv_lora_rank: int) -> torch.dtype:
    """The dtype :func:`mla_decode` wants the absorbed query in: the cache's on the kernel path (the
    tensor cores multiply bf16 or fp16), fp32 or wider on the reference path."""
    if kernels.use_kernels(cache) and latent_kernel_applies(cache, kv_lora_rank):
        return cache.dtype
    return torch.promote_types(cache.dtype, torch.float32)


def mla_decode_config(batch_size: int, heads: int, max_length: int, sms: int) -> tuple[int | None, int, bool | None]:
    """The default launch configuration ``(num_splits, stages, fused)``; ``num_splits = None`` lets
    :func:`mla_decode_splits` fill one wave at that depth's occupancy, ``fused = None`` fuses the combine
    when there are at most :data:`FUSED_MAX_SPLITS` splits. A module-level function so that
    ``benchmarks/bench_mla_decode.py`` (and a user) can replace it with what measurement says.

    Measured on the H200 (2026-11-29): two stages at two blocks per SM streamed best at large batch;
    deeper pipelines and the fused combine are the candidates the benchmark compares.
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


def balanced_schedule(lengths: Sequence[int], workers: int, min_tiles: int = MIN_TILES_PER_SPLIT) -> tuple[int, list[int]]:
    """The balanced split-KV schedule (``mla_decode_schedule`` in the kernel file), on the host:
    ``(per, first)`` with ``first[b]`` entry ``b``'s first global 32-row tile, ``first[B]`` the total,
    and ``per`` the tiles each of ``workers`` workers takes (at least ``min_tiles``; at least 1).
    ``lengths`` are the effective ones (clamped; 0 for an entry with nothing to attend over)."""
    first = [0]
    for n in lengths:
        first.append(first[-1] + (-(-n // TILE) if n > 0 else 0))
    return max(min_tiles, 1, -(-first[-1] // workers)), first


def balanced_segments(per: int, first: Sequence[int], workers: int) -> list[tuple[int, int, int, int, int | None]]:
    """Every segment of the balanced schedule, as ``mla_decode_balanced`` walks them:
    ``(worker, entry, first tile, end tile, slot)`` with tiles counted from the entry's start and
    ``slot = worker + entry`` for a partial segment (``None``: the segment is the whole entry, whose
    result goes straight to the output). Worker ``i`` takes global tiles ``[i·per, (i+1)·per)``."""
    segments, B = [], len(first) - 1
    for i in range(workers):
        a0, a1 = i * per, min((i + 1) * per, first[B])
        for b in range(B):
            e0, e1 = first[b], first[b + 1]
            s0, s1 = max(a0, e0), min(a1, e1)
            if s0 < s1:
                segments.append((i, b, s0 - e0, s1 - e0, None if (s0, s1) == (e0, e1) else i + b))
    return segments


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

    ``num_splits``, ``stages`` (pipeline depth, one of :data:`STAGES`) and ``fused`` (merge the
    splits in the last block of each head group instead of a second launch) default to
    :func:`mla_decode_config`. The fused combine takes tickets from ``counters`` (int32, at least
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
    stages = _checked_stages(stages)
    out = _out_buffer(out, B, H, kv_lora_rank, cache.device)
    if B == 0 or H == 0:
        return out
    kernel = MLA_DECODE_CU.function(f"mla_decode_split<{CUDA_TYPE[cache.dtype]}, {kv_lora_rank}, {D - kv_lora_rank}, "
                                    f"{stages}, {'true' if paged else 'false'}>", cache.device)
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
    scale_log2 = np.float32(scale * 1.4426950408889634)
    if paged is None:
        tail = (np.uint64(0), np.int32(0), np.int32(0), np.int64(0))
    else:
        table, block_size = paged
        tail = (kernels.ptr(table), np.int32(table.shape[1]), np.int32(block_size), np.int64(cache.shape[0]))
    common = (kernels.ptr(query), kernels.ptr(cache), slots_ptr, kernels.ptr(lengths_t), np.int32(H),
              np.int32(num_slots), np.int32(max_len), np.int32(max_length), np.int32(chunk), scale_log2) + tail
    common_nc = common[:4] + (np.uint64(0),) + common[4:]  # no counters: the combine kernel merges
    if splits == 1:  # the block writes the final result; no combine
        kernels.launch(kernel, grid, (WARPS * 32,), (kernels.ptr(out), np.uint64(0), np.uint64(0)) + common_nc,
                       shared_mem=smem)
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
        kernels.launch(kernel, grid, (WARPS * 32,),
                       (kernels.ptr(o_part), kernels.ptr(lse), kernels.ptr(out)) + common[:4] + (kernels.ptr(counters),)
                       + common[4:], shared_mem=smem)
        return out
    kernels.launch(kernel, grid, (WARPS * 32,), (kernels.ptr(o_part), kernels.ptr(lse), np.uint64(0)) + common_nc,
                   shared_mem=smem)
    combine = MLA_DECODE_CU.function("mla_decode_combine", cache.device)
    kernels.launch(combine, (-(-kv_lora_rank // COMBINE_COLS), H, B), (COMBINE_WARPS * 32,),
                   (kernels.ptr(out), kernels.ptr(o_part), kernels.ptr(lse), np.int32(splits), np.int32(kv_lora_rank)))
    return out


def _checked_stages(stages: int | None) -> int:
    stages = DEFAULT_STAGES if stages is None else stages
    if stages not in STAGES:
        raise ValueError(f"mla_decode: stages must be one of {STAGES}, got {stages}")
    return stages


def _out_buffer(out: torch.Tensor | None, B: int, H: int, kv_lora_rank: int, device) -> torch.Tensor:
    """``out`` checked (fp32 ``[B, H, kv_lora_rank]``, 16-byte aligned), or a new one; the batch fits the grid."""
    if B > 65535:
        raise ValueError(f"mla_decode: batch {B} exceeds the grid's 65535 entries")
    if out is None:
        out = torch.empty(B, H, kv_lora_rank, dtype=torch.float32, device=device)
    kernels.check(out, "mla_decode out", dtype=torch.float32, shape=(B, H, kv_lora_rank), device=device)
    if not kernels.aligned16(out):
        raise ValueError("mla_decode out: must start on a 16-byte boundary")
    return out


def _launch_balanced(query, cache, lengths_t, max_length, scale, kv_lora_rank, out, workspace, stages, table,
                     block_size, workers=None, min_tiles=MIN_TILES_PER_SPLIT):
    """The balanced schedule over a paged cache (checked inputs): schedule kernel, workers, combine."""
    B, H, D = query.shape
    stages = _checked_stages(stages)
    out = _out_buffer(out, B, H, kv_lora_rank, cache.device)
    if B == 0 or H == 0:
        return out
    ct = CUDA_TYPE[cache.dtype]
    kernel = MLA_DECODE_CU.function(f"mla_decode_balanced<{ct}, {kv_lora_rank}, {D - kv_lora_rank}, {stages}, true>",
                                    cache.device)
    smem = _shared_bytes(stages, D, cache.dtype)
    groups = -(-H // HEADS_PER_BLOCK)
    wave = max(1, _blocks_per_wave(kernel, smem, cache.device) // groups)  # one wave of blocks in all
    workers = wave if workers is None else workers
    sched = mla_decode_schedule(lengths_t, max_length, workers, min_tiles)
    slots = B + workers - 1  # partial results: slot worker + entry (see the kernel file)
    need = slots * H * (kv_lora_rank + 1)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=cache.device)
    kernels.check(workspace, "mla_decode workspace", dtype=torch.float32, device=cache.device)
    if workspace.numel() < need or not kernels.aligned16(workspace):
        raise ValueError(f"mla_decode workspace: {workspace.numel()} values, the balanced schedule needs {need} "
                         f"(batch {B}, {H} heads, {workers} workers, kv_lora_rank {kv_lora_rank}), 16-byte aligned")
    o_part, lse = workspace[: slots * H * kv_lora_rank], workspace[slots * H * kv_lora_rank : need]
    kernels.launch(kernel, (workers, 1, groups), (WARPS * 32,),
                   (kernels.ptr(o_part), kernels.ptr(lse), kernels.ptr(out), kernels.ptr(query), kernels.ptr(cache),
                    np.uint64(0), kernels.ptr(lengths_t), kernels.ptr(sched), np.int32(B), np.int32(H), np.int32(0),
                    np.int32(0), np.int32(max_length), np.float32(scale * 1.4426950408889634), kernels.ptr(table),
                    np.int32(table.shape[1]), np.int32(block_size), np.int64(cache.shape[0])), shared_mem=smem)
    v = combine_width(B * H, kv_lora_rank, _sms(cache.device))
    kernels.launch(MLA_DECODE_CU.function(f"mla_decode_combine_balanced<{v}>", cache.device),
                   (-(-kv_lora_rank // (32 * v)), H, B), (COMBINE_WARPS * 32,),
                   (kernels.ptr(out), kernels.ptr(o_part), kernels.ptr(lse), kernels.ptr(sched), np.int32(kv_lora_rank)))
    return out


def combine_width(rows: int, kv_lora_rank: int, sms: int) -> int:
    """Floats per lane ``V`` of the balanced combine for ``rows`` = batch × heads: the widest of
    ``COMBINE_WIDTHS`` (fewest blocks, ``⌈kv_lora_rank / 32V⌉`` per row) that still launches at least two
    blocks per SM. Narrow blocks suit few rows with many partials (batch 1, long context: the partials
    are spread over more SMs); wide ones suit many rows with a few partials each (large batches), where
    most of a narrow block's time is its fixed cost. The same bits for every width (kernel file)."""
    fits = [v for v in COMBINE_WIDTHS if kv_lora_rank % v == 0 and 32 * v <= max(kv_lora_rank, 64)
            and rows * -(-kv_lora_rank // (32 * v)) >= 2 * sms]
    return max(fits, default=COMBINE_WIDTHS[0])


def mla_decode_schedule(lengths: torch.Tensor, max_length: int, workers: int,
                        min_tiles: int = MIN_TILES_PER_SPLIT) -> torch.Tensor:
    """The balanced schedule of a paged batch, computed on the GPU (no host sync): int32 ``[B + 2]`` =
    ``[per, first[0], ..., first[B]]`` as :func:`balanced_schedule` computes it on the host, from
    ``lengths`` (int32 ``[B]`` on the GPU) clamped to ``max_length``."""
    kernels.check(lengths, "mla_decode_schedule lengths", dtype=torch.int32, shape=(None,))
    B = lengths.shape[0]
    if workers < 1:
        raise ValueError(f"mla_decode_schedule: workers must be >= 1, got {workers}")
    sched = torch.empty(B + 2, dtype=torch.int32, device=lengths.device)
    kernels.launch(MLA_DECODE_CU.function("mla_decode_schedule", lengths.device), (1,), (1024,),
                   (kernels.ptr(sched), kernels.ptr(lengths), np.uint64(0), np.int32(B), np.int32(0),
                    np.int32(max_length), np.int32(workers), np.int32(min_tiles)))
    return sched


def mla_decode_paged_reference(query: torch.Tensor, cache: torch.Tensor, block_table, lengths, block_size: int,
                               scale: float, kv_lora_rank: int) -> torch.Tensor:
    """:func:`mla_decode_reference` over a paged cache ``[num_rows, D]``: entry ``b``'s position ``p`` is row
    ``block_table[b][p // block_size] * block_size + p % block_size``; a ``-1`` (or out-of-range) table entry
    reads as a row of zeros, as in the kernel."""
    rows = block_table.tolist() if torch.is_tensor(block_table) else [list(t) for t in block_table]
    width = max(map(len, rows), default=0)
    table = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64).view(len(rows), width)
    lengths = lengths.tolist() if torch.is_tensor(lengths) else list(lengths)
    n = max(lengths, default=0)
    if n > table.shape[1] * block_size:
        raise ValueError(f"mla_decode_paged: a length of {n} needs more than the table's {table.shape[1]} blocks")
    pos = torch.arange(n)
    rows = table[:, pos // block_size] * block_size + pos % block_size  # [B, n]
    valid = (table[:, pos // block_size] >= 0) & (rows < cache.shape[0])
    gathered = cache[rows.clamp(0, max(cache.shape[0] - 1, 0)).to(cache.device)]
    gathered = gathered.masked_fill(~valid.to(cache.device)[..., None], 0)  # [B, n, D]
    return mla_decode_reference(query, gathered, range(len(lengths)), lengths, scale, kv_lora_rank)


def mla_decode_paged(query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor | Sequence[Sequence[int]],
                     lengths: Sequence[int] | torch.Tensor, block_size: int, scale: float, kv_lora_rank: int, *,
                     max_length: int | None = None, out: torch.Tensor | None = None,
                     workspace: torch.Tensor | None = None, num_splits: int | None = None,
                     stages: int | None = None, fused: bool | None = None,
                     counters: torch.Tensor | None = None, schedule: str = "balanced",
                     workers: int | None = None, min_tiles: int = MIN_TILES_PER_SPLIT) -> torch.Tensor:
    """:func:`mla_decode` over one layer of the paged cache (chapter 13): ``cache [num_rows, D]`` flat, and
    entry ``b`` attends over its positions ``0 .. lengths[b]-1``, position ``p`` read from row
    ``block_table[b][p // block_size] * block_size + p % block_size`` — no gather copy.

    ``block_table`` is ``[B, max_blocks]`` int32 on the query's device, padded with -1
    (:attr:`PagedBatch.block_table <dsv2_lib.model.cache.PagedBatch>`), or host sequences (copied). A -1 or
    out-of-range entry inside a context reads as a zero row (the kernel never reads there). ``lengths``
    as in :func:`mla_decode`: host ints, checked against ``1 .. max_blocks · block_size``, or an int32
    device tensor with ``max_length`` (then each length is clamped to it). The other arguments are
    :func:`mla_decode`'s; the kernel is the same instantiation with ``PAGED = true``, so on the same
    rows, splits and depth its results equal the contiguous kernel's bit for bit.

    ``schedule``: ``"balanced"`` (default) deals the batch's 32-row tiles evenly over one wave of
    blocks, the schedule computed on the GPU from the lengths (:func:`mla_decode_schedule`), so mixed
    lengths keep every SM busy and a CUDA graph needs no host bound tighter than the table's; then
    ``num_splits``, ``fused`` and ``counters`` do not apply, and ``workers`` (default: one wave, the SMs
    times the blocks each holds) sets how many blocks share the tiles per head group — fewer, deeper
    workers write fewer partials — and ``min_tiles`` the fewest 32-row tiles a worker takes (more
    spread short contexts over more SMs; each worker also writes a partial result of ``H × DL`` fp32).
    ``"uniform"``: :func:`mla_decode`'s splits.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"mla_decode_paged: schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not kernels.use_kernels(query) or not latent_kernel_applies(cache, kv_lora_rank) or cache.dim() != 2:
        return mla_decode_paged_reference(query, cache, block_table, lengths, block_size, scale, kv_lora_rank)
    kernels.check(cache, "mla_decode_paged cache", shape=(None, None))
    B = _checked_query(query, cache, cache.shape[1], "mla_decode_paged")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"mla_decode_paged: block_size must be a positive int, got {block_size!r}")
    if not torch.is_tensor(block_table):
        rows = [list(t) for t in block_table]
        width = max(map(len, rows), default=0)
        block_table = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32).view(len(rows), width)
        block_table = block_table.to(cache.device, non_blocking=True)
    kernels.check(block_table, "mla_decode_paged block_table", dtype=torch.int32, shape=(B, None), device=cache.device)
    width = block_table.shape[1]
    capacity = width * block_size  # the longest context the table can describe
    if capacity < 1:
        raise ValueError("mla_decode_paged: the block table has no blocks")
    lengths, max_length = _checked_lengths(lengths, B, capacity, max_length, cache.device, "mla_decode_paged",
                                           f"{width} blocks of {block_size} rows")
    lengths_t = lengths if torch.is_tensor(lengths) else _device_lengths(lengths, cache.device)
    if schedule == "balanced":
        if (num_splits, fused, counters) != (None, None, None):
            raise ValueError("mla_decode_paged: num_splits, fused and counters are for schedule='uniform'")
        for name, v in (("workers", workers), ("min_tiles", min_tiles)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"mla_decode_paged: {name} must be an int >= 1, got {v!r}")
        return _launch_balanced(query, cache, lengths_t, max_length, scale, kv_lora_rank, out, workspace, stages,
                                block_table, block_size, workers, min_tiles)
    if workers is not None or min_tiles != MIN_TILES_PER_SPLIT:
        raise ValueError("mla_decode_paged: workers and min_tiles are for schedule='balanced'")
    return _launch(query, cache, np.uint64(0), lengths_t, max_length, scale, kv_lora_rank, out, workspace,
                   num_splits, stages, fused, counters, (0, 0), (block_table, block_size))


@functools.lru_cache(maxsize=8)
def _device_lengths(lengths: tuple[int, ...], device) -> torch.Tensor:
    """The same host lengths -> the same device tensor: every layer of a decode step reuses one copy."""
    return torch.tensor(lengths, dtype=torch.int32).to(device, non_blocking=True)


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


def _sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


def latent_kernel_applies(cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """A compiled instantiation exists: 16-bit cache ``[S, L, kv_lora + rope]`` (or paged ``[num_rows, ...]``)
    with a compiled shape."""
    return (cache.dtype in (torch.float16, torch.bfloat16) and cache.dim() in (2, 3)
            and (kv_lora_rank, cache.shape[-1] - kv_lora_rank) in SHAPES)


def _checked_query(query: torch.Tensor, cache: torch.Tensor, D: int, op: str) -> int:
    """The batch size of ``query [B, h, D]``, checked against the cache (dtype, device, 16-byte start)."""
    if query.dim() != 3:
        raise ValueError(f"{op} query: shape {list(query.shape)}, expected [B, h, {D}]")
    B, H = query.shape[:2]
    kernels.check(query, f"{op} query", dtype=cache.dtype, shape=(B, H, D), device=cache.device)
    if not kernels.aligned16(query, cache):
        raise ValueError(f"{op}: query and cache must start on 16-byte boundaries (the kernel copies 16-byte vectors)")
    return B


def _checked_lengths(lengths, B: int, capacity: int, max_length: int | None, device, op: str, what: str):
    """``(lengths, max_length)``: host lengths as a tuple of ints in ``1..capacity``, or an int32 device
    tensor, which the host cannot read without a sync, so ``max_length`` is then required; and the host
    bound on them, checked against ``1..capacity`` (``what`` says what bounds it, for the messages)."""
    if torch.is_tensor(lengths):
        kernels.check(lengths, f"{op} lengths", dtype=torch.int32, shape=(B,), device=device)
        if max_length is None:
            raise ValueError(f"{op}: lengths on the device need max_length, a host bound on them (no sync)")
    else:
        lengths = tuple(int(n) for n in lengths)
        if len(lengths) != B:
            raise ValueError(f"{op}: {len(lengths)} lengths for a batch of {B}")
        for n in lengths:
            if not 1 <= n <= capacity:
                raise ValueError(f"{op}: length {n} outside 1..{capacity} ({what})")
        bound = max(lengths, default=1)
        if max_length is not None and max_length < bound:
            raise ValueError(f"{op}: max_length {max_length} is below the longest length {bound}")
        max_length = max_length or bound
    if not 1 <= max_length <= capacity:
        raise ValueError(f"{op}: max_length {max_length} outside 1..{capacity} ({what})")
    return lengths, int(max_length)


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


def _shared_bytes(stages: int, D: int, dtype: torch.dtype) -> int:
    """Dynamic shared memory of the split kernel: row buffers (pitch D + 8) and the partial scores."""
    return stages * TILE * (D + 8) * dtype.itemsize + WARPS * 32 * SS_PITCH * 4


@functools.cache
def _occupancy(fn_ptr: int, smem: int, device_index: int) -> int:
    """Opt the kernel in to ``smem`` bytes of dynamic shared memory; return its resident blocks per SM."""
    import cupy

    drv = cupy.cuda.driver
    with cupy.cuda.Device(device_index):
        if smem > 48 * 1024:
            drv.funcSetAttribute(fn_ptr, drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        return max(1, drv.occupancyMaxActiveBlocksPerMultiprocessor(fn_ptr, WARPS * 32, smem))


def _blocks_per_wave(kernel, smem: int, device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sms(device) * _occupancy(int(kernel.kernel.ptr), smem, index)
