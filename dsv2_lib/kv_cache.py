"""The latent KV cache of MLA and the description of which tokens a forward pass processes.

MLA caches one row per token per layer: ``[latent (kv_lora_rank) | k_pe (qk_rope_head_dim)]``,
576 values for DeepSeek-V2-Lite, instead of 16 heads × (192 + 128) keys and values.

Two caches, one way of reading them. :class:`PagedLatentCache` is a pool of blocks of
``block_size`` rows shared by all sequences; a :class:`PagedBatch` says, per sequence, which blocks
hold its tokens (its block table) and, per new token, which row (slot) receives its cache row:
token ``p`` of a sequence lives in row ``block_table[p // block_size] * block_size + p % block_size``.
:class:`LatentCache` is the contiguous special case: one strip of ``max_len`` rows per sequence
slot, i.e. blocks of ``max_len`` rows and the one-block table ``(slot,)``; a :class:`SequenceBatch`
over it becomes a :class:`PagedBatch` (:meth:`SequenceBatch.paged`), so attention has one code path.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .block_manager import block_bytes, blocks_in_mib
from .config import ModelConfig


class _Packed:
    """What every batch description has: ``starts`` (cached tokens) and ``lens`` (new tokens) per sequence."""

    starts: tuple[int, ...]
    lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.lens)

    @cached_property
    def last_position(self) -> int:
        """The largest position of any new token (-1 for none), known on the host: computed once per
        batch, not once per layer, it bounds the positions RoPE reads without a device sync."""
        return max((s + n - 1 for s, n in zip(self.starts, self.lens)), default=-1)

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Absolute position of every packed token, ``[num_tokens]`` int64."""
        return torch.cat(
            [torch.arange(s, s + n, dtype=torch.int64) for s, n in zip(self.starts, self.lens)]
        ).to(device)


@dataclass(frozen=True)
class SequenceBatch(_Packed):
    """Which tokens a forward pass processes, as ``len(slots)`` sequences packed one after another.

    Sequence ``i`` owns cache slot ``slots[i]``, already holds ``starts[i]`` cached tokens, and brings
    ``lens[i]`` new tokens at positions ``starts[i] .. starts[i] + lens[i] - 1``. ``decode`` selects
    attention directly on the latent cache (absorbed weights) instead of decompressing it.
    """

    slots: tuple[int, ...]
    starts: tuple[int, ...]
    lens: tuple[int, ...]
    decode: bool = False

    def paged(self, max_len: int, device: torch.device | str = "cpu") -> PagedBatch:
        """The same batch over the contiguous cache ``[S, max_len, row_dim]`` viewed as ``[S·max_len, row_dim]``:
        blocks of ``max_len`` rows, and the sequence in slot ``s`` has the one-block table ``(s,)``."""
        slots = tuple(s * max_len + p for s, a, n in zip(self.slots, self.starts, self.lens) for p in range(a, a + n))
        return PagedBatch(self.starts, self.lens, tuple((s,) for s in self.slots), max_len, slots, self.decode, device)


@dataclass(frozen=True, eq=False)
class PagedBatch(_Packed):
    """Which tokens a forward pass processes over a paged cache (one layer: ``[num_rows, row_dim]``).

    ``len(starts)`` sequences are packed one after another. Sequence ``i`` already holds ``starts[i]``
    cached tokens (its prefix-cache hits included) and brings ``lens[i]`` new tokens at positions
    ``starts[i] ..``; its position ``p`` lives in row ``block_tables[i][p // block_size] * block_size
    + p % block_size``. ``slots[t]`` is the row that packed token ``t``'s cache row is written to
    (-1: not written). The tensors below are built once per step, on ``device``.
    """

    starts: tuple[int, ...]
    lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    block_size: int
    slots: tuple[int, ...]
    decode: bool = False
    device: torch.device | str = "cpu"

    @property
    def context_lens(self) -> tuple[int, ...]:
        """Tokens each sequence attends over after this step: ``starts[i] + lens[i]``."""
        return tuple(s + n for s, n in zip(self.starts, self.lens))

    @cached_property
    def slot_mapping(self) -> torch.Tensor:
        """``[num_tokens]`` int64: the row each new token's cache row goes to (-1: skipped)."""
        return torch.tensor(self.slots, dtype=torch.int64).to(self.device)

    @cached_property
    def block_table(self) -> torch.Tensor:
        """``[num_seqs, max_blocks]`` int32, each sequence's blocks padded with -1 (what a paged kernel reads)."""
        return self._host_table.to(torch.int32).to(self.device)

    @cached_property
    def context_rows(self) -> torch.Tensor:
        """``[num_seqs, max_context]`` int64: the row of every position each sequence attends over,
        padded with row 0 (never attended: lengths mask it)."""
        return self._host_context_rows.masked_fill(~self._host_in_context, 0).to(self.device)

    @cached_property
    def packed_context_rows(self) -> torch.Tensor:
        """``[sum(context_lens)]`` int64: every sequence's context rows, packed one sequence after another."""
        return self._host_context_rows[self._host_in_context].to(self.device)

    # built on the host from the tuples, so that no step reads the device
    @cached_property
    def _host_table(self) -> torch.Tensor:
        width = max(map(len, self.block_tables), default=0)
        return torch.tensor([list(t) + [-1] * (width - len(t)) for t in self.block_tables],
                            dtype=torch.int64).view(len(self.block_tables), width)

    @cached_property
    def _host_context_rows(self) -> torch.Tensor:
        pos = torch.arange(max(self.context_lens, default=0))
        return self._host_table[:, pos // self.block_size] * self.block_size + pos % self.block_size

    @cached_property
    def _host_in_context(self) -> torch.Tensor:
        return torch.arange(self._host_context_rows.shape[1]) < torch.tensor(self.context_lens)[:, None]


def as_paged(batch: SequenceBatch | PagedBatch, cache: torch.Tensor) -> tuple[PagedBatch, torch.Tensor]:
    """``(batch, one layer's cache)`` in paged form: ``(PagedBatch, cache [num_rows, row_dim])``.

    A SequenceBatch comes with a contiguous layer ``[S, L, row_dim]`` (LatentCache.layer), read as
    blocks of ``L`` rows through :meth:`SequenceBatch.paged`; the rows are a view, never a copy.
    """
    if isinstance(batch, SequenceBatch):
        batch = batch.paged(cache.shape[1], cache.device)
    return batch, cache.view(-1, cache.shape[-1])


class LatentCache:
    """Contiguous latent cache ``[num_layers, num_slots, max_len, kv_lora_rank + qk_rope_head_dim]``."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype, device):
        self.max_len = max_len
        self.rows = torch.zeros(
            cfg.num_hidden_layers, num_slots, max_len, cfg.cache_row_dim, dtype=dtype, device=device
        )

    def layer(self, i: int) -> torch.Tensor:
        """Layer ``i``'s cache, ``[num_slots, max_len, row_dim]`` (a view)."""
        return self.rows[i]

    def check_fits(self, batch: SequenceBatch) -> None:
        """Refuse a batch that would write past a slot's strip (instead of failing inside indexing)."""
        for slot, start, n in zip(batch.slots, batch.starts, batch.lens):
            if not 0 <= slot < self.rows.shape[1]:
                raise IndexError(f"cache slot {slot} out of range: the cache has {self.rows.shape[1]} slots")
            if start + n > self.max_len:
                raise ValueError(
                    f"sequence in slot {slot} needs {start + n} cached tokens; the cache holds {self.max_len} per slot"
                )


class PagedLatentCache:
    """Paged latent cache ``[num_layers, num_blocks * block_size, row_dim]``: a pool of blocks shared by
    all sequences (which rows a sequence owns is the :class:`~dsv2_lib.block_manager.BlockManager`'s
    business). ``max_len`` bounds a sequence's length (default: the whole pool), hence its positions."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device,
                 max_len: int | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_len = max_len or num_blocks * block_size
        self.rows = torch.zeros(
            cfg.num_hidden_layers, num_blocks * block_size, cfg.cache_row_dim, dtype=dtype, device=device
        )

    @classmethod
    def from_mib(cls, cfg: ModelConfig, mib: float, dtype: torch.dtype, device, block_size: int = 16,
                 max_len: int | None = None) -> PagedLatentCache:
        """As many whole blocks as ``mib`` MiB hold (over all layers)."""
        num_blocks = blocks_in_mib(cfg, dtype, mib, block_size)
        if num_blocks < 1:
            raise ValueError(f"a KV cache of {mib} MiB holds no block: one block of {block_size} tokens takes "
                             f"{block_bytes(cfg, dtype, block_size) / 2**20:.3f} MiB for this model in {dtype}")
        return cls(cfg, num_blocks, block_size, dtype, device, max_len)

    def layer(self, i: int) -> torch.Tensor:
        """Layer ``i``'s cache, ``[num_blocks * block_size, row_dim]`` (a view)."""
        return self.rows[i]

    def check_fits(self, batch: PagedBatch) -> None:
        """Refuse a batch whose tables or slots point outside the pool, or do not cover its tokens."""
        if batch.block_size != self.block_size:
            raise ValueError(f"batch has blocks of {batch.block_size} tokens, the cache {self.block_size}")
        for i, (table, n) in enumerate(zip(batch.block_tables, batch.context_lens)):
            if n > self.max_len:
                raise ValueError(f"sequence {i} needs {n} cached tokens; the cache holds {self.max_len} per sequence")
            if len(table) * self.block_size < n:
                raise ValueError(f"sequence {i} has {n} tokens but its block table only {len(table)} blocks "
                                 f"of {self.block_size}")
            if not all(0 <= b < self.num_blocks for b in table):
                raise IndexError(f"sequence {i}: block table {table} outside the pool of {self.num_blocks} blocks")
        if not all(-1 <= s < self.rows.shape[1] for s in batch.slots):
            raise IndexError(f"a slot is outside the pool's {self.rows.shape[1]} rows")
