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

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from dsv2_lib.core.config import ModelConfig


def block_bytes(cfg: ModelConfig, dtype: torch.dtype, block_size: int = 16) -> int:
    """Bytes of one block over all layers: ``block_size × num_layers × cache_row_dim × itemsize``.

    DeepSeek-V2-Lite in bf16: 16 × 27 × 576 × 2 = 497,664 bytes (0.47 MiB) per 16 tokens.
    """
    return block_size * cfg.num_hidden_layers * cfg.cache_row_dim * dtype.itemsize


def blocks_in_mib(cfg: ModelConfig, dtype: torch.dtype, mib: float, block_size: int = 16) -> int:
    """How many whole blocks a cache of ``mib`` MiB holds (rounded down)."""
    return int(mib * 2**20) // block_bytes(cfg, dtype, block_size)


class _Packed:
    """What every batch description has: ``starts`` (cached tokens) and ``lens`` (new tokens) per sequence."""

    starts: tuple[int, ...]
    lens: tuple[int, ...]
    host_checked = False  # True when the token ids were checked on the host (the embedding then skips its sync)

    @property
    def num_tokens(self) -> int:
        return sum(self.lens)

    @cached_property
    def last_position(self) -> int:
        """The largest position of any new token (-1 for none), known on the host: computed once per
        batch, not once per layer, it bounds the positions RoPE reads without a device sync."""
        return max((s + n - 1 for s, n in zip(self.starts, self.lens)), default=-1)

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Absolute position of every packed token, ``[num_tokens]`` int64: ``starts[i] + j`` for token ``j``
        of sequence ``i``, i.e. the packed index minus where the sequence's tokens begin, plus its start."""
        lens = np.asarray(self.lens, dtype=np.int64)
        shift = np.repeat(np.asarray(self.starts, dtype=np.int64) - (np.cumsum(lens) - lens), lens)
        return PagedBatch.to_device(np.arange(lens.sum(), dtype=np.int64) + shift, torch.int64, device)


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
    (-1: not written). The tensors below are built once per step, on ``device``. ``host_checked``: the
    token ids are known to lie in the vocabulary (the engine checked the prompts; the rest are its own
    samples), so the embedding skips its device check, a sync. ``per_step``: what the layers of one
    forward step compute once and share (the decode kernel's schedule), emptied at each forward.
    """

    starts: tuple[int, ...]
    lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    block_size: int
    slots: tuple[int, ...]
    decode: bool = False
    device: torch.device | str = "cpu"
    host_checked: bool = field(default=False, kw_only=True)
    # What the layers of one forward step share (the decode schedule): emptied by each forward.
    per_step: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def context_lens(self) -> tuple[int, ...]:
        """Tokens each sequence attends over after this step: ``starts[i] + lens[i]``."""
        return tuple(s + n for s, n in zip(self.starts, self.lens))

    def attention_lengths(self) -> tuple[tuple[int, ...], None]:
        """How many rows each new token attends over (``start + i + 1`` for token ``i`` of a sequence),
        as host ints, and no device-side bound (the decode kernel takes the host values)."""
        return tuple(start + i + 1 for start, n in zip(self.starts, self.lens) for i in range(n)), None

    @staticmethod
    def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """Host values (a sequence of numbers or a numpy array) as a new ``dtype`` tensor on ``device``.

        The copy is queued, not waited for: PyTorch's blocking host-to-GPU copy synchronizes the stream,
        so the host would stop queuing work until the GPU caught up, once per copy. From pageable memory
        CUDA stages the values before the call returns, so nothing here must outlive it.
        """
        return torch.tensor(np.asarray(values), dtype=dtype).to(device, non_blocking=True)

    @cached_property
    def slot_mapping(self) -> torch.Tensor:
        """``[num_tokens]`` int64: the row each new token's cache row goes to (-1: skipped)."""
        return self.to_device(self.slots, torch.int64, self.device)

    @cached_property
    def max_slot(self) -> int:
        """The largest slot (-1 for none), on the host: found once per step, for the cache's check of the
        step (:meth:`PagedLatentCache.check_fits`) and every layer's cache write, which refuse a slot
        outside the pool without reading the device."""
        return max(self.slots, default=-1)

    @cached_property
    def block_table(self) -> torch.Tensor:
        """``[num_seqs, max_blocks]`` int32, each sequence's blocks padded with -1 (what a paged kernel reads)."""
        return self.to_device(self._host_table, torch.int32, self.device)

    @cached_property
    def context_rows(self) -> torch.Tensor:
        """``[num_seqs, max_context]`` int64: the row of every position each sequence attends over,
        padded with row 0 (never attended: lengths mask it)."""
        return self.to_device(np.where(self._host_in_context, self._host_context_rows, 0), torch.int64, self.device)

    @cached_property
    def packed_context_rows(self) -> torch.Tensor:
        """``[sum(context_lens)]`` int64: every sequence's context rows, packed one sequence after another."""
        return self.to_device(self._host_context_rows[self._host_in_context], torch.int64, self.device)

    # built on the host (numpy: no device read, and far cheaper than small CPU tensors) from the tuples
    @cached_property
    def _host_table(self) -> np.ndarray:
        table = np.full((len(self.block_tables), max(map(len, self.block_tables), default=0)), -1, dtype=np.int64)
        for row, blocks in zip(table, self.block_tables):
            row[: len(blocks)] = blocks
        return table

    @cached_property
    def _host_context_rows(self) -> np.ndarray:
        pos = np.arange(max(self.context_lens, default=0))
        return self._host_table[:, pos // self.block_size] * self.block_size + pos % self.block_size

    @cached_property
    def _host_in_context(self) -> np.ndarray:
        return np.arange(self._host_context_rows.shape[1]) < np.asarray(self.context_lens, dtype=np.int64)[:, None]


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
    all sequences (which rows a sequence owns is the :class:`~dsv2_lib.engine.block_manager.BlockManager`'s
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

    @classmethod
    def from_gpu_memory(cls, cfg: ModelConfig, dtype: torch.dtype, device, block_size: int, max_len: int,
                        utilization: float, max_step_tokens: int) -> PagedLatentCache:
        """The largest pool that ``utilization`` of the GPU's memory leaves, measured now (after the
        weights are loaded): :meth:`pool_bytes` of the device's total, free and torch-allocated bytes,
        less :meth:`activation_reserve` for steps of ``max_step_tokens`` tokens, in whole blocks.
        Refuses a pool with fewer blocks than one request of ``max_len`` tokens needs."""
        total = torch.cuda.get_device_properties(device).total_memory
        free, _ = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        reserve = cls.activation_reserve(cfg, dtype, max_step_tokens, max_len)
        pool = cls.pool_bytes(total, free, allocated, utilization, reserve)
        one = block_bytes(cfg, dtype, block_size)
        num_blocks, need = max(pool, 0) // one, -(-(max_len - 1) // block_size)
        if num_blocks < need:
            raise ValueError(
                f"gpu_memory_utilization={utilization} leaves the KV cache {pool / 2**20:.1f} MiB = {num_blocks} blocks "
                f"of {block_size} tokens ({one / 2**20:.3f} MiB each): min({utilization} x {total / 2**20:.1f} MiB total "
                f"- {allocated / 2**20:.1f} MiB held by torch, {free / 2**20:.1f} MiB free) - {reserve / 2**20:.1f} MiB "
                f"kept for activations; one request of max_model_len {max_len} tokens needs {need} blocks. Raise "
                "gpu_memory_utilization, or lower max_model_len or max_num_batched_tokens"
            )
        return cls(cfg, num_blocks, block_size, dtype, device, max_len)

    @staticmethod
    def pool_bytes(total: int, free: int, allocated: int, utilization: float, reserve: int) -> int:
        """Bytes for the paged cache: ``min(utilization × total − allocated, free) − reserve``.

        ``utilization × total`` is what the engine may use of the GPU (vLLM's ``gpu_memory_utilization``),
        ``allocated`` what torch already holds (the weights), ``free`` what the device can still give
        (less when another process holds memory), ``reserve`` what each step's activations need. May be
        negative: nothing is left."""
        return int(min(utilization * total - allocated, free)) - reserve

    @staticmethod
    def activation_reserve(cfg: ModelConfig, dtype: torch.dtype, max_step_tokens: int, max_len: int) -> int:
        """Bytes kept free for one step's activations: an estimate of the largest tensors alive at once
        when a step computes ``T = max_step_tokens`` tokens (``b`` = the dtype's bytes), summed:

        * the residual stream and block outputs, ``6 · T · H · b``;
        * MLA's queries, latent rows and attention output, ``T · (h·(qk_head + v_head) + row_dim) · b``,
          the absorbed decode's fp32 latent output ``T · h · kv_lora · 4``;
        * a prefill's decompressed context: the gathered rows and ``kv_b_proj``'s keys and values of one
          sequence of up to ``max_len`` tokens beside the step's own, ``(max_len + T) · (row_dim + h·(qk_nope
          + v_head)) · b`` (several long contexts prefilled in one step would take more);
        * the FFN, the larger of the dense MLP ``T · 3·I · b`` (gate|up and their product) and the MoE:
          every token's top-k copies with their input, gate|up, product and output
          ``T · k · (3·I_moe + 2·H) · b``, the shared experts ``T · 3·n_shared·I_moe · b``, the router's
          fp32 scores ``T · E · 4``;
        * the logits, if every token of the step samples (a decode step of ``T`` requests):
          ``T · vocab · (b + 4)`` (the LM head's output and its fp32 copy);
        * 256 MiB for cuBLAS and kernel workspaces and the allocator's fragmentation.

        DeepSeek-V2-Lite in bf16 with T = 8192 and max_len = 163840: about 7.9 GiB, mostly the logits
        (4.7 GiB) and the 160k-token context (1.5 GiB); lower ``max_num_batched_tokens`` to lower it.
        """
        c, t, b = cfg, max_step_tokens, dtype.itemsize
        h = c.num_attention_heads
        moe = t * (c.num_experts_per_tok * (3 * c.moe_intermediate_size + 2 * c.hidden_size)
                   + 3 * c.n_shared_experts * c.moe_intermediate_size) * b + t * c.n_routed_experts * 4
        return (6 * t * c.hidden_size * b
                + t * (h * (c.qk_head_dim + c.v_head_dim) + c.cache_row_dim) * b + t * h * c.kv_lora_rank * 4
                + (max_len + t) * (c.cache_row_dim + h * (c.qk_nope_head_dim + c.v_head_dim)) * b
                + max(t * 3 * c.intermediate_size * b, moe)
                + t * c.vocab_size * (b + 4)
                + 256 * 2**20)

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
            if table and not (min(table) >= 0 and max(table) < self.num_blocks):  # min/max: C loops, per step
                raise IndexError(f"sequence {i}: block table {table} outside the pool of {self.num_blocks} blocks")
        if batch.slots and not (min(batch.slots) >= -1 and batch.max_slot < self.rows.shape[1]):
            raise IndexError(f"a slot is outside the pool's {self.rows.shape[1]} rows")
