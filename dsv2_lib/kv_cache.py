"""The latent KV cache of MLA and the description of which tokens a forward pass processes.

MLA caches one row per token per layer: ``[latent (kv_lora_rank) | k_pe (qk_rope_head_dim)]``,
576 values for DeepSeek-V2-Lite, instead of 16 heads × (192 + 128) keys and values.
This module holds the contiguous cache (one fixed-length strip per sequence slot).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig


@dataclass(frozen=True)
class SequenceBatch:
    """Which tokens a forward pass processes, as ``len(slots)`` sequences packed one after another.

    Sequence ``i`` owns cache slot ``slots[i]``, already holds ``starts[i]`` cached tokens, and brings
    ``lens[i]`` new tokens at positions ``starts[i] .. starts[i] + lens[i] - 1``. ``decode`` selects
    attention directly on the latent cache (absorbed weights) instead of decompressing it.
    """

    slots: tuple[int, ...]
    starts: tuple[int, ...]
    lens: tuple[int, ...]
    decode: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(self.lens)

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Absolute position of every packed token, ``[num_tokens]`` int64."""
        return torch.cat(
            [torch.arange(s, s + n, dtype=torch.int64) for s, n in zip(self.starts, self.lens)]
        ).to(device)


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
