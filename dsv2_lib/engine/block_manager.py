"""Paged KV cache bookkeeping: a pool of fixed-size blocks, per-sequence block tables, prefix caching.

The paged cache of MLA is one tensor per layer of ``num_blocks * block_size`` rows of
``[latent | k_pe]`` (576 values for DeepSeek-V2-Lite). Token ``p`` of a sequence lives in row

    slot = block_table[p // block_size] * block_size + p % block_size

so a sequence's rows need not be contiguous and no sequence reserves memory for tokens it may never
produce. This module is pure Python: it decides *which* rows each token gets; the tensors and the
kernel that writes rows into their slots live with the model.

Prefix caching: a full block is named by a hash chained over its tokens,
``hash(parent block's hash, this block's token ids)``, so equal names mean equal tokens at equal
positions *and* an equal history before them, hence equal cache rows. A new sequence whose prompt
begins with blocks already in the cache points its block table at them (reference counts say how
many tables share a block) and prefill skips those tokens. Only full blocks are ever shared, and a
sequence only writes at positions past its own length, which lie in blocks that no one else holds,
so a shared block is never written and needs no copy-on-write. A block whose last user has finished
keeps its rows and its name ("evictable"), to be reused by a later request with the same prefix, until
its space is needed: fresh blocks come from never-named blocks first, then from evictable ones,
least recently released first.

A token id may be ``PENDING`` (-1): a token an asynchronous engine has scheduled but not yet read
back from the GPU (:mod:`~dsv2_lib.engine.scheduler`). Its slot is allocated as usual; the block it is in is
named only once every token of the block is known (``set_token``), since a name stands for tokens.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from dsv2_lib.core.config import ModelConfig
from dsv2_lib.model.cache import block_bytes, blocks_in_mib

PENDING = -1  # a token id not known yet (scheduled ahead of the GPU); see set_token


def slot_mapping(block_table: Sequence[int], positions: Sequence[int], block_size: int) -> list[int]:
    """Each position's cache row: ``block_table[p // block_size] * block_size + p % block_size`` (the
    module doc). A position outside the table's blocks, negative ones included, raises ``IndexError``."""
    end = len(block_table) * block_size
    bad = [p for p in positions if not 0 <= p < end]
    if bad:
        raise IndexError(f"position {bad[0]} is outside the {len(block_table)} blocks of the table")
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def block_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The name of a full block: SHA-256 over the parent block's name and this block's token ids.

    A cryptographic hash rather than Python's 64-bit ``hash``: a collision would silently hand a
    request another prompt's cache rows.
    """
    return hashlib.sha256((parent or b"") + array("q", token_ids).tobytes()).digest()


def cached_prefix(cache: Mapping[bytes, int], prompt: Sequence[int], block_size: int) -> list[tuple[bytes, int]]:
    """(name, block) of each full block of ``prompt[:-1]`` found in ``cache`` (name -> block), from the
    first: block i's name chains :func:`block_hash` over block i - 1's, and the walk stops at the first name
    not cached. The last prompt token never counts: its logits must be computed."""
    hits, parent = [], None
    for i in range((len(prompt) - 1) // block_size):
        name = block_hash(parent, prompt[i * block_size: (i + 1) * block_size])
        block = cache.get(name)
        if block is None:
            break
        hits.append((name, block))
        parent = name
    return hits


@dataclass(frozen=True)
class BlockStats:
    """A snapshot of the pool, counted in blocks (``prefix_hit_tokens`` in tokens)."""

    num_blocks: int
    block_size: int
    used_blocks: int  # held by at least one sequence
    free_blocks: int  # allocatable now: never-named plus evictable
    evictable_blocks: int  # free but still holding a cached prefix block
    peak_used_blocks: int
    prefix_hit_blocks: int  # blocks a new sequence found in the prefix cache
    prefix_hit_tokens: int  # prompt tokens whose prefill was skipped thanks to those hits
    evictions: int  # cached blocks whose rows were overwritten to make room


class BlockPoolExhausted(RuntimeError):
    """The pool has too few free blocks for a sequence's new tokens."""


class BlockManager:
    """The block pool and every sequence's block table.

    ``num_blocks`` blocks of ``block_size`` tokens; sequences are named by any hashable id. Use:
    ``cached = add_sequence(id, prompt)`` (reuses cached prefix blocks; ``cached`` prompt tokens need
    no prefill), then ``append_slots(id, tokens)`` for the tokens each step processes (allocating a
    block only when a token crosses into a new one), then ``free(id)``.

    A block is named, hence shareable, as soon as ``append_slots`` fills it: before the step that
    writes its rows has run. A request admitted later in the same step may already share it, so the
    forward pass must write every token's cache row of a layer before that layer's attention reads the
    cache (write, then attend), as a paged engine does.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self._ref = [0] * num_blocks
        self._name: list[bytes | None] = [None] * num_blocks  # the prefix-cache key of a named block
        self._clean = list(range(num_blocks - 1, -1, -1))  # free and unnamed; a stack: pop() gives block 0 first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free and named, least recently released first
        self._cache: dict[bytes, int] = {}  # name -> block
        self._tables: dict[Hashable, list[int]] = {}
        self._tokens: dict[Hashable, list[int]] = {}  # token ids that have a slot, per sequence
        self._names: dict[Hashable, list[bytes]] = {}  # chained names of the sequence's full blocks
        self._peak = self._hit_blocks = self._evictions = 0

    @classmethod
    def from_mib(cls, cfg: ModelConfig, dtype: torch.dtype, mib: float, block_size: int = 16,
                 prefix_caching: bool = True) -> BlockManager:
        """A pool of as many blocks as ``mib`` MiB of cache holds for this model and dtype."""
        num_blocks = blocks_in_mib(cfg, dtype, mib, block_size)
        if num_blocks < 1:
            raise ValueError(
                f"{mib} MiB holds no block: one block of {block_size} tokens takes "
                f"{block_bytes(cfg, dtype, block_size) / 2**20:.3f} MiB for this model in {dtype}"
            )
        return cls(num_blocks, block_size, prefix_caching)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._clean) + len(self._evictable)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, num_tokens: int, seq_id: Hashable | None = None) -> int:
        """New blocks that ``num_tokens`` more tokens of ``seq_id`` (None: a new sequence) would take."""
        held = len(self._tokens[seq_id]) if seq_id is not None else 0
        return self.blocks_for_tokens(held + num_tokens) - self.blocks_for_tokens(held)

    def can_allocate(self, num_tokens: int, seq_id: Hashable | None = None) -> bool:
        """Whether ``num_tokens`` more tokens of ``seq_id`` (None: a new sequence) fit in the free blocks now."""
        return self.blocks_needed(num_tokens, seq_id) <= self.num_free_blocks

    def blocks_to_admit(self, prompt: Sequence[int], num_tokens: int) -> int:
        """Free blocks a new sequence starting with ``prompt`` takes to grow to ``num_tokens`` tokens.

        Its cached prefix blocks cost nothing while another sequence holds them, one each if they
        must be taken back from the evictable ones; every other block is a fresh one.
        """
        hits = self._match(prompt)
        revived = sum(self._ref[b] == 0 for _, b in hits)
        return revived + self.blocks_for_tokens(num_tokens) - len(hits)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The blocks of ``seq_id`` in position order (a copy)."""
        return list(self._tables[seq_id])

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens of ``seq_id`` that have a slot."""
        return len(self._tokens[seq_id])

    def has_pending(self, seq_id: Hashable) -> bool:
        """Whether a token of ``seq_id`` is still ``PENDING`` (given a slot before its value was known)."""
        return PENDING in self._tokens[seq_id]

    def ref_count(self, block: int) -> int:
        """How many block tables hold ``block``."""
        return self._ref[block]

    def stats(self) -> BlockStats:
        return BlockStats(
            num_blocks=self.num_blocks, block_size=self.block_size,
            used_blocks=self.num_blocks - self.num_free_blocks, free_blocks=self.num_free_blocks,
            evictable_blocks=len(self._evictable), peak_used_blocks=self._peak,
            prefix_hit_blocks=self._hit_blocks, prefix_hit_tokens=self._hit_blocks * self.block_size,
            evictions=self._evictions,
        )

    def reset_counters(self) -> None:
        """Count a new run from here (peak, prefix hits, evictions) over the same pool; the cached
        prefix blocks stay (``LLM`` keeps its pool across runs)."""
        self._peak = self.num_blocks - self.num_free_blocks
        self._hit_blocks = self._evictions = 0

    # ---- sequence lifecycle --------------------------------------------------------------------
    def add_sequence(self, seq_id: Hashable, prompt: Sequence[int]) -> int:
        """Start ``seq_id``: share the cached blocks its prompt begins with; return how many tokens they hold.

        Only full blocks within ``prompt[:-1]`` are looked up: the last prompt token must always be
        computed, since its logits give the first generated token. The remaining prompt tokens get
        their slots from ``append_slots``.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already exists")
        hits = self._match(prompt)
        for _, b in hits:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
        self._tables[seq_id] = [b for _, b in hits]
        self._names[seq_id] = [name for name, _ in hits]
        self._tokens[seq_id] = list(prompt[: len(hits) * self.block_size])
        self._hit_blocks += len(hits)
        self._peak = max(self._peak, self.num_blocks - self.num_free_blocks)
        return len(self._tokens[seq_id])

    def append_slots(self, seq_id: Hashable, token_ids: Sequence[int]) -> list[int]:
        """Slots (cache rows) for the next ``len(token_ids)`` tokens of ``seq_id``, at positions
        ``num_tokens(seq_id)`` onwards; a block is allocated only when a token starts a new one.

        The token ids are needed to name each block that becomes full. Raises
        ``BlockPoolExhausted`` (changing nothing) when the free blocks do not suffice.
        """
        tokens, table, bs = self._tokens[seq_id], self._tables[seq_id], self.block_size
        need = self.blocks_needed(len(token_ids), seq_id)
        if need > self.num_free_blocks:
            raise BlockPoolExhausted(
                f"sequence {seq_id!r} needs {need} new block(s) of {bs} tokens for {len(token_ids)} more token(s) "
                f"(it holds {len(tokens)} tokens in {len(table)} blocks), but only {self.num_free_blocks} "
                f"of {self.num_blocks} blocks are free"
            )
        start, done = len(tokens), 0
        while done < len(token_ids):  # a block at a time: the tokens that fit in the sequence's last block
            if len(tokens) == len(table) * bs:
                table.append(self._take_free_block())
            n = min(bs - len(tokens) % bs, len(token_ids) - done)
            tokens.extend(token_ids[done: done + n])
            done += n
            if self.prefix_caching and len(tokens) % bs == 0:
                self._name_full_blocks(seq_id)
        self._peak = max(self._peak, self.num_blocks - self.num_free_blocks)
        return slot_mapping(table, range(start, len(tokens)), bs)

    def set_token(self, seq_id: Hashable, position: int, token: int) -> None:
        """Replace the ``PENDING`` token at ``position`` of ``seq_id`` by its value, and name the full
        blocks that are now known (in order: a block's name chains its parent's)."""
        tokens = self._tokens[seq_id]
        if tokens[position] != PENDING:
            raise ValueError(f"sequence {seq_id!r}: position {position} holds token {tokens[position]}, not a pending one")
        tokens[position] = token
        if self.prefix_caching:
            self._name_full_blocks(seq_id)

    def forget_cached(self) -> None:
        """Empty the prefix cache of blocks no sequence holds: they become plain free blocks. Costs
        one step per cached block, not per block of the pool (an engine's pool has ~10⁵)."""
        for b in self._evictable:
            del self._cache[self._name[b]]
            self._name[b] = None
        self._clean.extend(reversed(self._evictable))  # the least recently released is taken first
        self._evictable.clear()

    def free(self, seq_id: Hashable) -> None:
        """Release the blocks of ``seq_id``. Named blocks stay in the prefix cache as evictable,
        queued tail first: a block can only be hit after the blocks before it, so heads are worth more."""
        for b in reversed(self._tables.pop(seq_id)):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._name[b] is None:
                    self._clean.append(b)
                else:
                    self._evictable[b] = None
        del self._tokens[seq_id], self._names[seq_id]

    # ---- internals -----------------------------------------------------------------------------
    def _match(self, prompt: Sequence[int]) -> list[tuple[bytes, int]]:
        """(name, block) of the cached full blocks that ``prompt[:-1]`` begins with (:func:`cached_prefix`)."""
        return cached_prefix(self._cache, prompt, self.block_size) if self.prefix_caching else []

    def _take_free_block(self) -> int:
        """A free block for new rows: an unnamed one, else the least recently released cached one."""
        if self._clean:
            block = self._clean.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._cache[self._name[block]]
            self._name[block] = None
            self._evictions += 1
        self._ref[block] = 1
        return block

    def _name_full_blocks(self, seq_id: Hashable) -> None:
        """Name the sequence's full blocks past the last named one, in order, while their tokens are all
        known, and offer each to the prefix cache.

        If an equal block is already cached (another sequence computed the same tokens), that one
        stays the shared copy and this one stays private.
        """
        names, tokens, bs = self._names[seq_id], self._tokens[seq_id], self.block_size
        while len(names) < len(tokens) // bs:
            i = len(names)
            block_tokens = tokens[i * bs: (i + 1) * bs]
            if PENDING in block_tokens:
                return
            name = block_hash(names[-1] if names else None, block_tokens)
            names.append(name)
            block = self._tables[seq_id][i]
            if name not in self._cache:
                self._cache[name] = block
                self._name[block] = name
