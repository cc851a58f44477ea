"""Multi-head Latent Attention (MLA): projections, the latent cache write, and two attention paths.

Shapes for DeepSeek-V2-Lite (H = 2048 hidden, h = 16 heads, T packed tokens):

* queries ``q [T, h, 192] = [q_nope 128 | q_pe 64]`` from ``q_proj`` (or ``q_b(norm(q_a(x)))``);
* ``kv_a_proj_with_mqa(x) [T, 576] = [latent 512 | k_pe 64]``; the latent is RMS-normalised,
  ``k_pe`` is one rotary key shared by all heads; both are cached (576 values per token);
* ``kv_b_proj`` decompresses a latent to per-head ``[k_nope 128 | v 128]``: its weight, viewed as
  ``[h, 256, 512]``, splits into ``W_k [h, 128, 512]`` and ``W_v [h, 128, 512]``.

Prefill decompresses the cached latents and runs ordinary causal attention. Decode uses the
identities ``q_nope · (W_k c) = (W_kᵀ q_nope) · c`` and ``Σ a_t W_v c_t = W_v Σ a_t c_t`` to attend
directly over the 576-wide cache rows.
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

from dsv2_lib.core import kernels, streams
from dsv2_lib.core.config import ModelConfig
from dsv2_lib.model.cache import PagedBatch, SequenceBatch, as_paged
from dsv2_lib.model.layers import Linear
from dsv2_lib.model.tuning import Tuning
from dsv2_lib.ops import attention
from dsv2_lib.ops.cache_write import write_cache_rows
from dsv2_lib.ops.latent_rows import fused_applies, latent_rows_
from dsv2_lib.ops.mla_absorb import absorbed_output, absorbed_query
from dsv2_lib.ops.mla_decode import (
    latent_kernel_applies,
    mla_decode_paged,
    mla_decode_query_dtype,
    mla_decode_reference,
)
from dsv2_lib.ops.norm import RMSNorm, rms_norm
from dsv2_lib.ops.rope import apply_rope_


def write_latent_cache(cache: torch.Tensor, batch: SequenceBatch | PagedBatch, rows: torch.Tensor) -> None:
    """Store packed ``rows [T, row_dim]`` in each token's slot of one layer's cache: paged ``[num_rows, row_dim]``
    with a :class:`PagedBatch` (a token whose slot is -1 is skipped), or contiguous ``[S, L, row_dim]`` with a
    :class:`SequenceBatch` (row ``slot * L + position``). CUDA tensors: chapter 12's kernel
    (:func:`~dsv2_lib.ops.cache_write.write_cache_rows`, no host sync); otherwise the masked assignment below,
    its reference."""
    batch, cache = as_paged(batch, cache)
    if kernels.use_kernels(cache):
        write_cache_rows(cache, rows, batch.slot_mapping, max_slot=batch.max_slot)
        return
    keep = batch.slot_mapping >= 0
    cache[batch.slot_mapping[keep]] = rows[keep]


def _joined(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.cat([a, b], dim=-1)``, as a view when ``b`` lies right after ``a`` in the same storage with
    the same strides (the two halves of one tensor split along its last dimension), else a copy."""
    if (a.stride() == b.stride() and a.stride(-1) == 1 and a.dtype == b.dtype and a.shape[:-1] == b.shape[:-1]
            and a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.data_ptr() == a.data_ptr() + a.shape[-1] * a.element_size()):
        return torch.as_strided(a, (*a.shape[:-1], a.shape[-1] + b.shape[-1]), a.stride())
    return torch.cat([a, b], dim=-1)


class MLA(nn.Module):
    """One MLA attention layer (weights named as in the HF checkpoint); ``tuning``: its projections' GEMV
    threshold and side stream, prefill attention's paths and the decode kernel's schedule."""

    def __init__(self, cfg: ModelConfig, tuning: Tuning = Tuning()):
        super().__init__()
        self.cfg, self.tuning = cfg, tuning
        h, qk, g, s = cfg.num_attention_heads, cfg.qk_head_dim, tuning.gemv_max_tokens, tuning.skinny_max_tokens
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, h * qk, g, s)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, g, s)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * qk, g, s)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.cache_row_dim, g, s)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), g, s)
        self.o_proj = Linear(h * cfg.v_head_dim, cfg.hidden_size, g, s)

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H] -> q [T, h, qk_head_dim]``."""
        q = self.q_proj(x) if self.cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.cfg.num_attention_heads, self.cfg.qk_head_dim)

    def cache_rows(self, kv: torch.Tensor, q_pe: torch.Tensor, positions: torch.Tensor, rope_cache: torch.Tensor,
                   batch: SequenceBatch | PagedBatch, cache: torch.Tensor) -> None:
        """Make ``kv_a_proj_with_mqa``'s output ``kv [T, row_dim] = [latent | k_pe]`` the step's cache rows and
        write them to each token's slot: normalise the latent (``kv_a_layernorm``), rotate ``k_pe`` and the
        queries' ``q_pe [T, h, rope_dim]`` (a view of ``q``) with RoPE, all in place, then write ``kv``'s rows.

        Three ops, chapters 03, 04 and 12; on the GPU one kernel does all three
        (:func:`~dsv2_lib.ops.latent_rows.latent_rows_`, chapter 04), with the same bits."""
        c, norm = self.cfg, self.kv_a_layernorm
        if fused_applies(kv, q_pe, norm.weight, cache.view(-1, cache.shape[-1])):
            paged, rows = as_paged(batch, cache)
            latent_rows_(kv, q_pe, norm.weight, norm.eps, positions, rope_cache, rows, paged.slot_mapping,
                         max_position=batch.last_position, max_slot=paged.max_slot)
            return
        latent, k_pe = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        rms_norm(latent, norm.weight, norm.eps, in_place=True)
        apply_rope_(q_pe, k_pe, positions, rope_cache, batch.last_position)
        write_latent_cache(cache, batch, kv)

    def split_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj.weight`` as ``W_k [h, qk_nope, kv_lora]`` and ``W_v [h, v_head, kv_lora]`` (views)."""
        c = self.cfg
        w = self.kv_b_proj.weight.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rope_cache: torch.Tensor, batch: SequenceBatch | PagedBatch,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``; writes this step's rows into the cache before attending: ``cache``
        is one layer, ``[S, L, row_dim]`` for a SequenceBatch, ``[rows, row_dim]`` for a PagedBatch.

        ``positions [T]`` (int64, on x's device) index ``rope_cache [P, rope_dim]`` (rope_cos_sin_cache).
        """
        c = self.cfg
        side = kernels.use_kernels(x) and x.shape[0] <= self.tuning.q_stream_max_tokens  # two small GEMMs and a norm, side by side
        with streams.fork(x.device, side) as q_ready:
            q = self.project_q(x)
        kv = self.kv_a_proj_with_mqa(x)  # [T, row_dim] = [latent | k_pe], raw
        streams.join(q_ready, x.device)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        self.cache_rows(kv, q_pe, positions, rope_cache, batch, cache)  # normalise, rotate (q_pe too), write
        attend = self.decode_attention if batch.decode else self.prefill_attention
        out = attend(q_nope, q_pe, batch, cache)
        return self.o_proj(out.to(x.dtype).flatten(1))

    def prefill_attention(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: SequenceBatch | PagedBatch, cache: torch.Tensor
    ) -> torch.Tensor:
        """Decompress each sequence's cached latents with ``kv_b_proj`` and attend causally: ``[T, h, v_head]``.

        ``cache`` is one layer, paged ``[num_rows, row_dim]`` or contiguous ``[S, L, row_dim]``
        (:func:`~dsv2_lib.model.cache.as_paged`); each sequence's context rows, its cached prefix included,
        are gathered through its block table into ``[Σ context, row_dim]``. CUDA tensors: all sequences'
        latents are decompressed by one GEMM and attended by :func:`attention.prefill_attention` (our
        kernel or SDPA, chapter 06), with ``k_pe`` passed once per token instead of expanded to every
        head. Otherwise (the reference path) one sequence at a time with :func:`~dsv2_lib.ops.attention.causal_attention`.
        """
        c, h = self.cfg, self.cfg.num_attention_heads
        batch, cache = as_paged(batch, cache)
        q = _joined(q_nope, q_pe)  # the two halves of project_q's [T, h, 192]: viewed again, not copied
        rows = cache[batch.packed_context_rows]
        if kernels.use_kernels(q):
            latent, k_pe = rows.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
            kv = self.kv_b_proj(latent).view(-1, h, c.qk_nope_head_dim + c.v_head_dim)
            k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
            cu_q = [0, *itertools.accumulate(batch.lens)]
            cu_k = [0, *itertools.accumulate(batch.context_lens)]
            return attention.prefill_attention(q, k_nope, k_pe, v, cu_q, cu_k, c.softmax_scale,
                                               tuning=self.tuning.attention)
        outs, offset = [], 0
        for seq_rows, start, n in zip(rows.split(batch.context_lens), batch.starts, batch.lens):
            latent, k_pe = seq_rows.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
            kv = self.kv_b_proj(latent).view(-1, h, c.qk_nope_head_dim + c.v_head_dim)
            k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, h, -1)], dim=-1)
            outs.append(attention.causal_attention(q[offset : offset + n], k, v, start, c.softmax_scale))
            offset += n
        return torch.cat(outs)

    def decode_attention(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: SequenceBatch | PagedBatch, cache: torch.Tensor
    ) -> torch.Tensor:
        """Attention on the latent cache with ``W_k``/``W_v`` absorbed: ``[T, h, v_head]``.

        ``q_lat = W_kᵀ q_nope [T, h, kv_lora]``; scores against each cached row ``[latent | k_pe]``
        are ``q_lat · latent + q_pe · k_pe`` (:mod:`~dsv2_lib.ops.mla_decode`: the kernel for CUDA
        tensors, else the fp32 reference); the softmax-weighted sum of latents is mapped to each
        head's value space by ``W_v`` once at the end. The two absorbed products are
        :func:`~dsv2_lib.ops.mla_absorb.absorbed_query` and :func:`~dsv2_lib.ops.mla_absorb.absorbed_output`
        (einsums, or for a few tokens one kernel each: chapter 14). Token ``i`` of a sequence at ``start`` attends
        over its first ``start + i + 1`` rows. CUDA tensors (16-bit, a compiled shape): chapter 13's paged
        kernel (:func:`~dsv2_lib.ops.mla_decode.mla_decode_paged`) reads the rows through ``batch.block_table``
        where they lie. Otherwise the fp32 reference takes rows as ``[entries, length, row_dim]``: when every
        context lies in one block (the contiguous cache) that is the cache itself, viewed; else each context
        is gathered through its block table (a copy).
        """
        c = self.cfg
        batch, cache = as_paged(batch, cache)
        w_k, w_v = self.split_kv_b()
        lengths, bound = batch.attention_lengths()  # host ints; or, in a CUDA graph, a device tensor and a bound
        if kernels.use_kernels(cache) and latent_kernel_applies(cache, c.kv_lora_rank):
            dtype = cache.dtype
            query = absorbed_query(q_nope, q_pe, w_k, dtype)
            table = batch.block_table  # [num_seqs, max_blocks]: one entry per sequence
            if any(n != 1 for n in batch.lens):  # several tokens of a sequence: one table row per token
                seq_of_token = [i for i, n in enumerate(batch.lens) for _ in range(n)]
                table = table[torch.tensor(seq_of_token, device=table.device)]
            out_lat = mla_decode_paged(query, cache, table, lengths, batch.block_size, c.softmax_scale, c.kv_lora_rank,
                                       max_length=bound, tuning=self.tuning.decode, per_step=batch.per_step)
        else:
            if bound is not None:  # device lengths: only the kernel path reads them (a CUDA-graph step)
                raise ValueError("a decode batch with lengths on the device (StaticDecodeBatch) needs the CUDA kernel "
                                 "path: a 16-bit cache on the GPU with kernels on")
            if all(len(t) == 1 for t in batch.block_tables):
                rows, entries = cache.view(-1, batch.block_size, cache.shape[-1]), [t[0] for t in batch.block_tables]
            else:
                rows, entries = cache[batch.context_rows], range(len(batch.lens))  # [num_seqs, max_context, row_dim]
            dtype = mla_decode_query_dtype(rows, c.kv_lora_rank)  # fp32 (or wider): the reference path
            query = absorbed_query(q_nope, q_pe, w_k, dtype)
            slots = tuple(e for e, n in zip(entries, batch.lens) for _ in range(n))
            out_lat = mla_decode_reference(query, rows, slots, lengths, c.softmax_scale, c.kv_lora_rank)
        return absorbed_output(out_lat, w_v, dtype)
