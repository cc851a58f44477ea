"""The DeepSeek-V2 model: embedding, pre-norm decoder layers (MLA + dense MLP or MoE), final norm, LM head.

Parameter names equal the HF checkpoint's (``model.layers.3.self_attn.kv_b_proj.weight``), except
that routed experts are stacked per layer and gate/up fused (``model.layers.3.mlp.experts.gate_up_proj [E, 2I, H]``).
"""
from __future__ import annotations

import torch
from torch import nn

from dsv2_lib.core.config import ModelConfig
from dsv2_lib.model.cache import LatentCache, PagedBatch, PagedLatentCache, SequenceBatch
from dsv2_lib.model.layers import Embedding, Linear
from dsv2_lib.model.mla import MLA
from dsv2_lib.model.mlp import MLP
from dsv2_lib.model.moe import MoE
from dsv2_lib.model.tuning import Tuning
from dsv2_lib.ops.gemv import linear
from dsv2_lib.ops.norm import RMSNorm
from dsv2_lib.ops.rope import rope_cos_sin_cache


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + ffn(norm(x))``; ffn is a dense MLP or a MoE.

    The residual stream travels separately from the block outputs so that each add is fused into
    the RMSNorm after it: the layer takes ``(out, residual)`` of the previous block and returns its own.
    """

    def __init__(self, cfg: ModelConfig, index: int, tuning: Tuning = Tuning()):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg, tuning)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        g, s = tuning.gemv_max_tokens, tuning.skinny_max_tokens
        self.mlp = (MoE(cfg, tuning.moe, g, s) if cfg.is_moe_layer(index)
                    else MLP(cfg.hidden_size, cfg.intermediate_size, g, s))

    def forward(self, out, residual, positions, rope_cache, batch: SequenceBatch | PagedBatch, cache: torch.Tensor):
        """``out [T, H]`` (previous block's output), ``residual [T, H]`` (None before layer 0)."""
        if residual is None:
            h, residual = self.input_layernorm(out), out
        else:
            h, residual = self.input_layernorm(out, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, positions, rope_cache, batch, cache), residual)
        return self.mlp(h), residual


class Backbone(nn.Module):
    """Everything but the LM head (HF's ``model.*``)."""

    def __init__(self, cfg: ModelConfig, tuning: Tuning = Tuning()):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tuning) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV2(nn.Module):
    """The whole model. ``forward`` maps packed token ids to final hidden states, updating the cache.
    ``tuning``: where its ops switch kernel paths (:class:`~dsv2_lib.model.tuning.Tuning`)."""

    def __init__(self, cfg: ModelConfig, tuning: Tuning = Tuning()):
        super().__init__()
        self.cfg, self.logits_thresholds = cfg, (tuning.gemv_max_tokens, tuning.skinny_max_tokens)
        self.model = Backbone(cfg, tuning)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, tuning.gemv_max_tokens, tuning.skinny_max_tokens)
        self._rope_cache: torch.Tensor | None = None  # [P, rope_dim] fp32, built by the first forward

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[vocab, H]``; the embedding matrix itself when ``tie_word_embeddings``."""
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: SequenceBatch | PagedBatch,
                cache: LatentCache | PagedLatentCache) -> torch.Tensor:
        """``input_ids [T]`` (packed as ``batch`` describes) -> final-normed hidden ``[T, H]``.

        A SequenceBatch goes with a contiguous LatentCache, a PagedBatch with a PagedLatentCache; the
        former is turned into the latter's form once here (:meth:`SequenceBatch.paged`), not in every layer.
        """
        if input_ids.shape != (batch.num_tokens,):
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}, the batch describes {batch.num_tokens} tokens")
        cache.check_fits(batch)
        # One cos/sin table for all layers, as long as the latent cache: it covers every position check_fits allows.
        rope_cache = self._rope_cache
        if rope_cache is None or rope_cache.shape[0] < cache.max_len or rope_cache.device != input_ids.device:
            rope_cache = self._rope_cache = rope_cos_sin_cache(self.cfg, cache.max_len, input_ids.device)
        positions = batch.positions(input_ids.device)
        if isinstance(batch, SequenceBatch):
            batch = batch.paged(cache.max_len, input_ids.device)
        batch.per_step.clear()  # a batch object may serve several steps (a CUDA graph's): nothing carries over
        out, residual = self.model.embed_tokens(input_ids, check=not batch.host_checked), None
        for i, layer in enumerate(self.model.layers):
            out, residual = layer(out, residual, positions, rope_cache, batch, cache.layer(i))
        return self.model.norm(out, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [T, H] -> logits [T, vocab]`` in fp32. The LM head (a 419 MB read for V2-Lite), tied or not,
        takes the paths every ``Linear`` takes by token count (:func:`~dsv2_lib.ops.gemv.linear`: the GEMV, the
        skinny GEMM or ``F.linear``; chapter 14)."""
        return linear(hidden, self.lm_head_weight, *self.logits_thresholds).float()
