"""MLA decode attention on the latent cache, with ``W_k`` and ``W_v`` absorbed (chapters 10 and 13).

One query per batch entry attends directly over cached rows ``[latent (kv_lora) | k_pe (rope)]``:

* ``query [B, h, D]``, ``D = kv_lora + rope`` (576 for V2-Lite): ``[W_kᵀ q_nope | q_pe]`` per head;
* ``cache [num_rows, D]``: one layer of the paged cache (:class:`~dsv2_lib.model.cache.PagedLatentCache`),
  entry ``b``'s position ``p`` in row ``block_table[b][p // block_size] * block_size + p % block_size``;
* ``lengths [B]``: entry ``b`` attends over its positions ``0 .. lengths[b]-1`` (the new token's row
  included, already written);
* result ``[B, h, kv_lora]`` in fp32: ``Σ_t softmax_t(scale · query · row_t) · latent_t``, which the
  caller maps through ``W_v``.

The references define the op (:func:`mla_decode_reference` over a contiguous cache, the paged one over
block tables). The kernel (``kernels_cu/mla_decode.cu``, chapter 13) reads each row once for all 16 heads of
a block, runs both products on the tensor cores and deals the batch's 32-row tiles evenly over one wave of
blocks (the balanced schedule), merged by a log-sum-exp combine. It takes bf16 or fp16 (the query in the
cache's dtype: the MMA multiplies that type); an fp32 cache, and shapes without a compiled instantiation,
take the reference. Chapter 10's uniform split-KV kernel is a lesson (:mod:`dsv2_lib.lessons.mla_decode_split`).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np
import torch

from dsv2_lib.core import kernels
from dsv2_lib.core.dtypes import upcast
from dsv2_lib.core.kernels import CUDA_TYPE

HEADS_PER_BLOCK, WARPS, TILE = 16, 4, 32  # heads per block (the MMA's M), warps per block, cache rows per tile
ROW_PAD = 8  # elements of padding per staged cache row (16 bytes: an ldmatrix's 8 rows in 8 bank groups)
SS_PITCH = TILE // 8 * 4 + 4  # floats per lane of the kernel's partial-score exchange: 16 + 4 of padding
STAGES = (2, 3, 4, 5)  # pipeline depths compiled (STAGES - 1 tiles of 32 rows in flight per block)
SHAPES = ((512, 64), (64, 16))  # (kv_lora_rank, rope dim) compiled: DeepSeek-V2(-Lite), the tiny model
COMBINE_WARPS = 8  # warps per block of the combines (merge_partials)
COMBINE_WIDTHS = (2, 4, 8, 16)  # floats per lane of mla_decode_combine_balanced<V>: 64 .. 512 columns a block
SCHEDULE_THREADS = 1024  # the one block of mla_decode_schedule: 32 warps
# The constants of kernels_cu/mla_decode.cuh, for every kernel file that includes it.
HEADER_DEFINES = {"DSV2_MLA_HEADS": HEADS_PER_BLOCK, "DSV2_MLA_WARPS": WARPS, "DSV2_MLA_TILE": TILE,
                  "DSV2_MLA_ROW_PAD": ROW_PAD, "DSV2_MLA_SS_PITCH": SS_PITCH, "DSV2_MLA_COMBINE_WARPS": COMBINE_WARPS}
MLA_DECODE_CU = kernels.declare(
    "mla_decode.cu",
    [f"mla_decode_balanced<{t}, {dl}, {dr}, {s}>" for t in ("__half", "__nv_bfloat16") for dl, dr in SHAPES
     for s in STAGES] + ["mla_decode_schedule"] + [f"mla_decode_combine_balanced<{v}>" for v in COMBINE_WIDTHS],
    {**HEADER_DEFINES, "DSV2_MLA_SCHEDULE_THREADS": SCHEDULE_THREADS},
)


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """How :func:`mla_decode_paged` launches the balanced schedule; the defaults are the H200's, set by
    ``benchmarks/bench_mla_decode_paged.py``.

    * ``stages``: pipeline depth, one of :data:`STAGES` (``stages - 1`` tiles in flight per block): two
      blocks per SM at two stages stream best, deeper pipelines lose.
    * ``min_tiles``: the fewest 32-row tiles a worker takes. More would amortise each worker's query
      load and partial write, but at serving contexts the parallelism matters more (the benchmark's
      ``min_tiles`` sweep at 513 rows); long contexts never reach the floor.
    * ``workers``: blocks per head group that share the batch's tiles; ``None``: one wave (the SMs
      times the blocks each holds). Fewer, deeper workers write fewer partials.
    * ``combine_width``: floats per lane of the combine, one of :data:`COMBINE_WIDTHS`; ``None``:
      :func:`combine_width` picks it from the batch. Every width gives the same bits.
    """

    stages: int = 2
    min_tiles: int = 1
    workers: int | None = None
    combine_width: int | None = None

    def __post_init__(self):
        if self.stages not in STAGES:
            raise ValueError(f"DecodeTuning: stages must be one of {STAGES}, got {self.stages!r}")
        for name in ("min_tiles", "workers"):
            v = getattr(self, name)
            if (v is not None or name == "min_tiles") and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"DecodeTuning: {name} must be an int >= 1, got {v!r}")
        if self.combine_width is not None and self.combine_width not in COMBINE_WIDTHS:
            raise ValueError(f"DecodeTuning: combine_width must be one of {COMBINE_WIDTHS}, got {self.combine_width!r}")


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


def latent_kernel_applies(cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """A compiled instantiation exists: 16-bit cache ``[S, L, kv_lora + rope]`` (or paged ``[num_rows, ...]``)
    with a compiled shape."""
    return (cache.dtype in (torch.float16, torch.bfloat16) and cache.dim() in (2, 3)
            and (kv_lora_rank, cache.shape[-1] - kv_lora_rank) in SHAPES)


def mla_decode_query_dtype(cache: torch.Tensor, kv_lora_rank: int) -> torch.dtype:
    """The dtype the decode op wants the absorbed query in: the cache's on the kernel path (the
    tensor cores multiply bf16 or fp16), fp32 or wider on the reference path."""
    if kernels.use_kernels(cache) and latent_kernel_applies(cache, kv_lora_rank):
        return cache.dtype
    return torch.promote_types(cache.dtype, torch.float32)


def balanced_schedule(lengths: Sequence[int], workers: int,
                      min_tiles: int = DecodeTuning.min_tiles) -> tuple[int, list[int]]:
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
                        min_tiles: int = DecodeTuning.min_tiles) -> torch.Tensor:
    """The balanced schedule of a paged batch, computed on the GPU (no host sync): int32 ``[B + 2]`` =
    ``[per, first[0], ..., first[B]]`` as :func:`balanced_schedule` computes it on the host, from
    ``lengths`` (int32 ``[B]`` on the GPU) clamped to ``max_length``."""
    kernels.check(lengths, "mla_decode_schedule lengths", dtype=torch.int32, shape=(None,))
    B = lengths.shape[0]
    if workers < 1:
        raise ValueError(f"mla_decode_schedule: workers must be >= 1, got {workers}")
    sched = torch.empty(B + 2, dtype=torch.int32, device=lengths.device)
    MLA_DECODE_CU.launch("mla_decode_schedule", lengths.device, (1,), (SCHEDULE_THREADS,), sched=kernels.ptr(sched),
                         lengths=kernels.ptr(lengths), B=np.int32(B), max_length=np.int32(max_length),
                         workers=np.int32(workers), min_tiles=np.int32(min_tiles))
    return sched


def mla_decode_paged(query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor | Sequence[Sequence[int]],
                     lengths: Sequence[int] | torch.Tensor, block_size: int, scale: float, kv_lora_rank: int, *,
                     max_length: int | None = None, out: torch.Tensor | None = None,
                     workspace: torch.Tensor | None = None, tuning: DecodeTuning = DecodeTuning(),
                     per_step: dict | None = None) -> torch.Tensor:
    """Absorbed decode attention over one layer of the paged cache (chapter 13), ``query [B, h, D]`` -> fp32
    ``[B, h, kv_lora_rank]`` (see the module doc): entry ``b`` attends over its positions ``0 .. lengths[b]-1``,
    position ``p`` read from row ``block_table[b][p // block_size] * block_size + p % block_size`` — no gather copy.

    ``block_table`` is ``[B, max_blocks]`` int32 on the query's device, padded with -1
    (:attr:`PagedBatch.block_table <dsv2_lib.model.cache.PagedBatch>`), or host sequences (copied). A -1 or
    out-of-range entry inside a context reads as a zero row (the kernel never reads there). ``lengths`` are
    host ints, checked against ``1 .. max_blocks · block_size``, or an int32 device tensor, which the host
    cannot read without a sync: then ``max_length`` (a host bound) is required and the kernel clamps each
    length to it. ``out`` and ``workspace`` (fp32, ``(B + workers - 1) · h · (kv_lora_rank + 1)`` values)
    let a caller preallocate, as a CUDA graph needs.

    The balanced schedule deals the batch's 32-row tiles evenly over ``tuning.workers`` blocks per head
    group, the schedule computed on the GPU from the lengths (:func:`mla_decode_schedule`), so mixed lengths
    keep every SM busy and a CUDA graph needs no host bound tighter than the table's (:class:`DecodeTuning`).
    ``per_step``: a dict that lives for one forward step (:attr:`PagedBatch.per_step
    <dsv2_lib.model.cache.PagedBatch>`): every layer of the step has the same lengths, so the first layer's
    schedule is kept there and the others reuse it instead of launching the schedule kernel again.
    """
    if not kernels.use_kernels(query) or not latent_kernel_applies(cache, kv_lora_rank) or cache.dim() != 2:
        return mla_decode_paged_reference(query, cache, block_table, lengths, block_size, scale, kv_lora_rank)
    block_table, lengths_t, max_length = _paged_inputs(query, cache, block_table, lengths, block_size, max_length,
                                                       "mla_decode_paged")
    return _launch_balanced(query, cache, lengths_t, max_length, scale, kv_lora_rank, out, workspace, block_table,
                            block_size, tuning, per_step)


def _shared_schedule(per_step: dict | None, lengths: torch.Tensor, max_length: int, workers: int,
                     min_tiles: int) -> torch.Tensor:
    """:func:`mla_decode_schedule`, computed once per step: kept in ``per_step`` under its inputs and reused
    while the lengths are the same tensor (host lengths map to one cached device copy per step)."""
    if per_step is None:
        return mla_decode_schedule(lengths, max_length, workers, min_tiles)
    key = ("mla_decode_schedule", max_length, workers, min_tiles)
    kept = per_step.get(key)
    if kept is None or kept[0] is not lengths:
        kept = per_step[key] = (lengths, mla_decode_schedule(lengths, max_length, workers, min_tiles))
    return kept[1]


def _launch_balanced(query, cache, lengths_t, max_length, scale, kv_lora_rank, out, workspace, table, block_size,
                     tuning: DecodeTuning, per_step: dict | None = None):
    """The balanced schedule over a paged cache (checked inputs): schedule kernel, workers, combine."""
    B, H, D = query.shape
    out = _out_buffer(out, B, H, kv_lora_rank, cache.device)
    if B == 0 or H == 0:
        return out
    name = f"mla_decode_balanced<{CUDA_TYPE[cache.dtype]}, {kv_lora_rank}, {D - kv_lora_rank}, {tuning.stages}>"
    kernel = MLA_DECODE_CU.function(name, cache.device)
    smem = _shared_bytes(tuning.stages, D, cache.dtype)
    groups = -(-H // HEADS_PER_BLOCK)
    wave = max(1, _blocks_per_wave(kernel, smem, cache.device) // groups)  # one wave of blocks in all
    workers = wave if tuning.workers is None else tuning.workers
    sched = _shared_schedule(per_step, lengths_t, max_length, workers, tuning.min_tiles)
    slots = B + workers - 1  # partial results: slot worker + entry (see the kernel file)
    need = slots * H * (kv_lora_rank + 1)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=cache.device)
    kernels.check(workspace, "mla_decode workspace", dtype=torch.float32, device=cache.device)
    if workspace.numel() < need or not kernels.aligned16(workspace):
        raise ValueError(f"mla_decode workspace: {workspace.numel()} values, the balanced schedule needs {need} "
                         f"(batch {B}, {H} heads, {workers} workers, kv_lora_rank {kv_lora_rank}), 16-byte aligned")
    o_part, lse = workspace[: slots * H * kv_lora_rank], workspace[slots * H * kv_lora_rank : need]
    MLA_DECODE_CU.launch(name, cache.device, (workers, 1, groups), (WARPS * 32,), shared_mem=smem,
                         o_part=kernels.ptr(o_part), lse_part=kernels.ptr(lse), out=kernels.ptr(out),
                         q=kernels.ptr(query), cache=kernels.ptr(cache), lengths=kernels.ptr(lengths_t),
                         sched=kernels.ptr(sched), B=np.int32(B), H=np.int32(H), max_length=np.int32(max_length),
                         scale_log2=np.float32(scale * 1.4426950408889634), block_table=kernels.ptr(table),
                         table_width=np.int32(table.shape[1]), block_size=np.int32(block_size),
                         num_rows=np.int64(cache.shape[0]))
    v = tuning.combine_width or combine_width(B * H, kv_lora_rank, _sms(cache.device))
    if kv_lora_rank % v:
        raise ValueError(f"mla_decode_paged: combine width {v} does not divide kv_lora_rank {kv_lora_rank}")
    MLA_DECODE_CU.launch(f"mla_decode_combine_balanced<{v}>", cache.device, (-(-kv_lora_rank // (32 * v)), H, B),
                         (COMBINE_WARPS * 32,), out=kernels.ptr(out), o_part=kernels.ptr(o_part), lse=kernels.ptr(lse),
                         sched=kernels.ptr(sched), dl=np.int32(kv_lora_rank))
    return out


# ---- checks and launch geometry (shared with chapter 10's lesson kernel) ------------------------------------
def _paged_inputs(query: torch.Tensor, cache: torch.Tensor, block_table, lengths, block_size: int,
                  max_length: int | None, op: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(block_table, lengths, max_length)`` for a kernel over the paged ``cache [num_rows, D]``: the table
    as int32 ``[B, max_blocks]`` on the cache's device (host sequences padded with -1 and copied), the
    lengths as an int32 device tensor, and their host bound, all checked against the query and the table."""
    kernels.check(cache, f"{op} cache", shape=(None, None))
    B = _checked_query(query, cache, cache.shape[1], op)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{op}: block_size must be a positive int, got {block_size!r}")
    if not torch.is_tensor(block_table):
        rows = [list(t) for t in block_table]
        width = max(map(len, rows), default=0)
        block_table = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32).view(len(rows), width)
        block_table = block_table.to(cache.device, non_blocking=True)
    kernels.check(block_table, f"{op} block_table", dtype=torch.int32, shape=(B, None), device=cache.device)
    width = block_table.shape[1]
    capacity = width * block_size  # the longest context the table can describe
    if capacity < 1:
        raise ValueError(f"{op}: the block table has no blocks")
    lengths, max_length = _checked_lengths(lengths, B, capacity, max_length, cache.device, op,
                                           f"{width} blocks of {block_size} rows")
    lengths_t = lengths if torch.is_tensor(lengths) else _device_lengths(lengths, cache.device)
    return block_table, lengths_t, max_length


@functools.lru_cache(maxsize=8)
def _device_lengths(lengths: tuple[int, ...], device) -> torch.Tensor:
    """The same host lengths -> the same device tensor: every layer of a decode step reuses one copy."""
    return torch.tensor(lengths, dtype=torch.int32).to(device, non_blocking=True)


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


def _shared_bytes(stages: int, D: int, dtype: torch.dtype) -> int:
    """Dynamic shared memory of ``attend_rows``: row buffers (pitch D + ROW_PAD) and the partial scores."""
    return stages * TILE * (D + ROW_PAD) * dtype.itemsize + WARPS * 32 * SS_PITCH * 4


def _sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


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
    """Resident blocks of ``kernel`` on the whole GPU (SMs × blocks per SM), after opting it in to ``smem``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sms(device) * _occupancy(int(kernel.kernel.ptr), smem, index)
