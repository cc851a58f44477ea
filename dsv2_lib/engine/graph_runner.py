"""CUDA-graph steps (chapter 14): a step captured once per number of tokens, replayed with new inputs.

A DeepSeek-V2-Lite decode step is hundreds of kernel launches; launched one by one from Python each
costs microseconds of CPU time, more than the GPU needs for most of them at small batch. A CUDA graph
records the launches once and replays them with one call. What a replay may not do is change any
launch: the grid, the pointers and the host-side decisions are those of the capture. So the step's
inputs live in fixed device buffers, written before each replay:

* ``input_ids``, ``positions``, ``slot_mapping`` ``[n]`` (int64) and ``lengths`` ``[n]`` (int32): the token
  of each entry, its position, the cache row it writes and the rows it attends over;
* ``block_table`` ``[n, width]`` (int32): each entry's blocks, padded with -1;
* ``logits`` ``[n, vocab]`` (fp32): the graph's output.

An entry is one token: a decode token, or one of a prompt chunk's tokens, which attends over the rows
up to its own position like any decode token (:mod:`~dsv2_lib.engine.model_runner` lays a step out so).
A step of ``B`` entries runs in the graph of the smallest captured size ``n >= B`` (``BUCKETS``); the
``n - B`` padding entries write no cache row (slot -1), attend over nothing (length 0) and their logits
are dropped. Everything the model decides on the host is fixed per size: every entry brings one token,
the attention bound is the cache's ``max_len`` (the balanced schedule of chapter 13 follows the real
lengths on the GPU), and the ids, positions, slots and tables were checked here before being copied in.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dsv2_lib.model.cache import PagedBatch, PagedLatentCache

# Every size up to 8, where a step is bound by weight bytes and a padding entry's own expert picks
# would cost the most (doubling, a step of 3 padded to 4 reads ~21 % more: chapter 14), then about ×1.5,
# up to 512 entries: a step's prompt chunks ride in the graph too, a token per entry (model_runner).
BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def bucket(n: int, buckets: Sequence[int] = BUCKETS) -> int:
    """The smallest captured batch size that holds ``n`` entries."""
    for b in sorted(buckets):
        if b >= n:
            return b
    raise ValueError(f"a decode batch of {n} exceeds the largest CUDA-graph size {max(buckets)}")


@dataclass
class DecodeBuffers:
    """The fixed device tensors of one captured size ``n`` (see the module docstring)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    lengths: torch.Tensor
    block_table: torch.Tensor
    source: torch.Tensor  # [n] int64: row of an earlier step's picks that gives the token, or -1 (fill)
    logits: torch.Tensor | None = None  # the graph's output, set by the capture
    columns: int = 0  # leading columns of block_table that may hold a block id; the rest are all -1

    @classmethod
    def allocate(cls, n: int, width: int, device) -> DecodeBuffers:
        z = dict(device=device)
        return cls(torch.zeros(n, dtype=torch.int64, **z), torch.zeros(n, dtype=torch.int64, **z),
                   torch.full((n,), -1, dtype=torch.int64, **z), torch.zeros(n, dtype=torch.int32, **z),
                   torch.full((n, width), -1, dtype=torch.int32, **z), torch.full((n,), -1, dtype=torch.int64, **z))

    def fill(self, token_ids: Sequence[int], starts: Sequence[int], block_tables: Sequence[Sequence[int]],
             slots: Sequence[int], earlier: tuple[torch.Tensor, Sequence[int]] | None = None) -> None:
        """Write a step of ``B <= n`` entries (entry ``b`` at position ``starts[b]``, its row written to
        ``slots[b]``) and pad the rest; host values, one copy per buffer, no sync.

        ``earlier = (picks, rows)``: the tokens an earlier step sampled, still on the GPU; entry ``b`` with
        ``rows[b] >= 0`` takes ``picks[rows[b]]`` instead of ``token_ids[b]`` (a gather on the GPU, so the
        host need not wait for that step: asynchronous scheduling, :mod:`~dsv2_lib.engine.llm`).

        Only the table's first ``cols`` columns are written: those this step's tables need and those an
        earlier step left entries in. The table is as wide as the longest context the cache allows
        (10,240 columns for V2-Lite's 163,840 tokens in blocks of 16): writing all of it would cost the
        host more than a batch-128 step takes on the GPU.
        """
        n = self.block_table.shape[0]
        B = len(token_ids)
        widest = max(map(len, block_tables), default=0)
        cols = max(self.columns, widest)
        rows = np.zeros((n, 5), dtype=np.int64)  # NumPy: element-wise filling from lists is cheaper than torch's
        rows[:B, 0], rows[:B, 1], rows[:B, 2], rows[B:, 2] = token_ids, starts, slots, -1
        rows[:B, 3] = rows[:B, 1] + 1
        rows[:, 4] = -1
        if earlier is not None:
            rows[:B, 4] = earlier[1]
        table = np.full((n, cols), -1, dtype=np.int32)
        for b, t in enumerate(block_tables):
            table[b, : len(t)] = t
        rows, table = torch.from_numpy(rows), torch.from_numpy(table)
        if self.input_ids.is_cuda:  # page-locked: the copies below run asynchronously
            rows, table = rows.pin_memory(), table.pin_memory()
        self.input_ids.copy_(rows[:, 0], non_blocking=True)
        self.positions.copy_(rows[:, 1], non_blocking=True)
        self.slot_mapping.copy_(rows[:, 2], non_blocking=True)
        self.lengths.copy_(rows[:, 3], non_blocking=True)
        self.block_table[:, :cols].copy_(table, non_blocking=True)
        self.columns = widest
        if earlier is not None:
            self.source.copy_(rows[:, 4], non_blocking=True)
            self.input_ids[:B] = self.take_earlier(self.input_ids[:B], self.source[:B], earlier[0])

    @staticmethod
    def take_earlier(tokens: torch.Tensor, rows: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
        """``tokens [n]`` with entry ``b`` replaced by ``picks[rows[b]]`` where ``rows[b] >= 0``: tokens an
        earlier step sampled, gathered on the GPU without the host reading them (asynchronous scheduling;
        the eager step of :mod:`~dsv2_lib.engine.model_runner` uses it too)."""
        return torch.where(rows >= 0, picks[rows.clamp(min=0)], tokens)


@dataclass(frozen=True, eq=False)
class StaticDecodeBatch(PagedBatch):
    """A decode :class:`PagedBatch` of ``n`` entries whose device tensors are ``buffers``: what the model
    reads during capture and every replay. Its host tuples are placeholders that pass the model's host
    checks (one token each at position 0, block 0, no row written); the real step is in the buffers."""

    buffers: DecodeBuffers | None = field(default=None, kw_only=True)
    bound: int = field(default=1, kw_only=True)  # no entry attends over more rows: the cache's max_len
    host_checked: bool = field(default=True, kw_only=True)  # the runner checked the ids: no device check (a sync)

    @classmethod
    def over(cls, buffers: DecodeBuffers, cache: PagedLatentCache) -> StaticDecodeBatch:
        n = buffers.input_ids.shape[0]
        return cls(starts=(0,) * n, lens=(1,) * n, block_tables=((0,),) * n, block_size=cache.block_size,
                   slots=(-1,) * n, decode=True, device=buffers.input_ids.device, buffers=buffers, bound=cache.max_len)

    @property
    def last_position(self) -> int:
        return self.bound - 1

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return self.buffers.positions

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.buffers.slot_mapping

    @property
    def block_table(self) -> torch.Tensor:
        return self.buffers.block_table

    def attention_lengths(self) -> tuple[torch.Tensor, int]:
        return self.buffers.lengths, self.bound


class DecodeGraphRunner:
    """Steps of a model over one :class:`PagedLatentCache`, a token per entry, through CUDA graphs captured lazily,
    one per size in ``buckets`` (``capture=False``: the same padded static step, run eagerly — for
    debugging and for the book's comparison). ``runner(token_ids, starts, block_tables, slots)`` returns
    the logits ``[B, vocab]`` (fp32) of a step of ``B`` entries."""

    def __init__(self, model, cache: PagedLatentCache, buckets: Sequence[int] = BUCKETS, capture: bool = True):
        if cache.rows.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model and cache on a GPU, not {cache.rows.device}")
        self.model, self.cache, self.buckets, self.capture = model, cache, tuple(sorted(buckets)), capture
        self.width = -(-cache.max_len // cache.block_size)  # table entries an entry may need
        self.vocab = model.cfg.vocab_size
        self._steps: dict[int, tuple[DecodeBuffers, StaticDecodeBatch, torch.cuda.CUDAGraph | None]] = {}
        self._pool = None

    def __call__(self, token_ids: Sequence[int], starts: Sequence[int], block_tables: Sequence[Sequence[int]],
                 slots: Sequence[int], earlier: tuple[torch.Tensor, Sequence[int]] | None = None) -> torch.Tensor:
        """``earlier``: tokens taken from an earlier step's picks on the GPU (:meth:`DecodeBuffers.fill`)."""
        B = len(token_ids)
        self.check(token_ids, starts, block_tables, slots, earlier)
        buffers, batch, graph = self._step(bucket(B, self.buckets))
        buffers.fill(token_ids, starts, block_tables, slots, earlier)
        if graph is None:
            buffers.logits = self._forward(buffers, batch)
        else:
            graph.replay()
        return buffers.logits[:B]

    def check(self, token_ids, starts, block_tables, slots, earlier=None) -> None:
        """What the graph cannot check, refused here on the host: ids in the vocabulary (or rows inside
        the earlier step's picks), tables that fit the buffers, and — as for any step, by
        :meth:`PagedLatentCache.check_fits` — positions within the cache, tables that cover each
        position inside the pool, slots inside the pool."""
        if not len(starts) == len(block_tables) == len(slots) == len(token_ids):
            raise ValueError(f"decode step: {len(token_ids)} tokens, {len(starts)} starts, {len(block_tables)} tables, "
                             f"{len(slots)} slots")
        rows = earlier[1] if earlier is not None else [-1] * len(token_ids)
        if len(rows) != len(token_ids):
            raise ValueError(f"decode step: {len(token_ids)} tokens but {len(rows)} rows of earlier picks")
        for b, (t, row, table) in enumerate(zip(token_ids, rows, block_tables)):
            if row >= 0 and row >= earlier[0].shape[0]:
                raise ValueError(f"decode entry {b}: row {row} of an earlier step's {earlier[0].shape[0]} picks")
            if row < 0 and not 0 <= t < self.vocab:
                raise ValueError(f"decode entry {b}: token id {t} outside the vocabulary [0, {self.vocab})")
            if len(table) > self.width:
                raise ValueError(f"decode entry {b}: a table of {len(table)} blocks; the buffers hold {self.width}")
        self.cache.check_fits(PagedBatch(tuple(starts), (1,) * len(starts), tuple(map(tuple, block_tables)),
                                         self.cache.block_size, tuple(slots), decode=True))

    def _forward(self, buffers: DecodeBuffers, batch: StaticDecodeBatch) -> torch.Tensor:
        return self.model.compute_logits(self.model(buffers.input_ids, batch, self.cache))

    def _step(self, n: int):
        """The buffers, static batch and graph of size ``n``, captured on first use."""
        if n not in self._steps:
            buffers = DecodeBuffers.allocate(n, self.width, self.cache.rows.device)
            batch = StaticDecodeBatch.over(buffers, self.cache)
            graph = None
            if self.capture:
                buffers.logits = self._forward(buffers, batch)  # warm-up: kernels compiled, workspaces made
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                self._pool = self._pool or torch.cuda.graph_pool_handle()  # one memory pool for every size
                with torch.cuda.graph(graph, pool=self._pool):
                    buffers.logits = self._forward(buffers, batch)
            self._steps[n] = (buffers, batch, graph)
        return self._steps[n]
