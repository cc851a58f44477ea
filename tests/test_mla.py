"""MLA: decoding on the latent cache with absorbed weights equals decompressed attention."""
import dataclasses

import pytest
import torch

from dsv2_lib.core.config import TINY
from dsv2_lib.core.dtypes import default_dtype
from dsv2_lib.model.cache import LatentCache, SequenceBatch
from dsv2_lib.model.mla import MLA, _joined
from dsv2_lib.ops.norm import rms_norm, rms_norm_reference
from dsv2_lib.ops.rope import apply_rope_reference_, rope_cos_sin_cache


def random_mla(cfg, seed=0):
    torch.manual_seed(seed)
    with default_dtype(torch.float64):
        mla = MLA(cfg)
    for name, p in mla.named_parameters():
        p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.2 * torch.randn_like(p))
    return mla


def test_absorbed_decode_equals_decompressed_attention_fp64():
    """The two identities, q_nope·(W_k c) = (W_kᵀ q_nope)·c and Σ a W_v c = W_v Σ a c, hold to fp64 rounding.

    Same MLA layer, same cache: 3 sequences with different cached lengths attend with both paths.
    """
    cfg = dataclasses.replace(TINY, q_lora_rank=24)
    mla = random_mla(cfg)
    starts = (5, 11, 1)
    cache = LatentCache(cfg, 3, 16, torch.float64, "cpu").layer(0)
    prefill = SequenceBatch((0, 1, 2), (0, 0, 0), starts)
    x = torch.randn(prefill.num_tokens, cfg.hidden_size, dtype=torch.float64)
    table = rope_cos_sin_cache(cfg, 16)
    mla(x, prefill.positions(), table, prefill, cache)

    step = torch.randn(3, cfg.hidden_size, dtype=torch.float64)
    outs = {}
    for decode in (False, True):
        batch = SequenceBatch((0, 1, 2), starts, (1, 1, 1), decode=decode)
        outs[decode] = mla(step, batch.positions(), table, batch, cache.clone())
    assert outs[True].abs().max() > 1e-3  # a real signal, not zeros
    torch.testing.assert_close(outs[True], outs[False], atol=1e-12, rtol=1e-10)


def test_prefill_writes_latent_rows_at_each_position():
    """Cache row (slot, pos) = [kv_a_layernorm(latent) | rotated k_pe] of that token, nothing else written."""
    cfg = TINY
    mla = random_mla(cfg, seed=1)
    cache = LatentCache(cfg, 2, 8, torch.float64, "cpu").layer(0)
    batch = SequenceBatch((1, 0), (2, 0), (3, 4))  # slot 1 continues at position 2
    x = torch.randn(batch.num_tokens, cfg.hidden_size, dtype=torch.float64)
    table = rope_cos_sin_cache(cfg, 8)
    mla(x, batch.positions(), table, batch, cache)
    latent, k_pe = mla.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    latent = rms_norm_reference(latent, mla.kv_a_layernorm.weight, 1e-6)

    k_pe = k_pe.clone()
    apply_rope_reference_(torch.empty(batch.num_tokens, 0, k_pe.shape[1], dtype=k_pe.dtype), k_pe, batch.positions(), table)
    rows = torch.cat([latent, k_pe], dim=-1)
    torch.testing.assert_close(cache[1, 2:5], rows[:3])
    torch.testing.assert_close(cache[0, :4], rows[3:])
    assert cache[1, :2].abs().sum() == 0 and cache[1, 5:].abs().sum() == 0 and cache[0, 4:].abs().sum() == 0


def test_cache_rows_turns_kv_into_the_cache_rows_in_place():
    """cache_rows normalises kv's latent and rotates its k_pe and q_pe where they lie, so kv itself is the
    step's rows [latent | k_pe], written to each token's slot with no copy made first."""
    cfg = TINY
    mla = random_mla(cfg, seed=2)
    cache = LatentCache(cfg, 2, 8, torch.float64, "cpu").layer(0)
    batch = SequenceBatch((0, 1), (0, 3), (2, 3))
    x = torch.randn(batch.num_tokens, cfg.hidden_size, dtype=torch.float64)
    table = rope_cos_sin_cache(cfg, 8)
    kv = mla.kv_a_proj_with_mqa(x)
    q_pe = torch.randn(batch.num_tokens, cfg.num_attention_heads, cfg.qk_rope_head_dim, dtype=torch.float64)
    want_latent = rms_norm_reference(kv[:, :cfg.kv_lora_rank], mla.kv_a_layernorm.weight, 1e-6)
    want_q, want_k = q_pe.clone(), kv[:, cfg.kv_lora_rank:].clone()
    apply_rope_reference_(want_q, want_k, batch.positions(), table)
    ptr = kv.data_ptr()
    mla.cache_rows(kv, q_pe, batch.positions(), table, batch, cache)
    assert kv.data_ptr() == ptr and torch.equal(kv[:, :cfg.kv_lora_rank], want_latent)
    assert torch.equal(kv[:, cfg.kv_lora_rank:], want_k) and torch.equal(q_pe, want_q)
    assert torch.equal(cache[0, :2], kv[:2]) and torch.equal(cache[1, 3:6], kv[2:])
    assert cache[0, 2:].abs().sum() == 0 and cache[1, :3].abs().sum() == 0 and cache[1, 6:].abs().sum() == 0


def test_joined_views_adjacent_halves_and_copies_anything_else():
    t = torch.arange(24.0).view(4, 6)
    a, b = t.split([4, 2], dim=-1)
    assert _joined(a, b).data_ptr() == t.data_ptr() and torch.equal(_joined(a, b), t)
    for x, y in ((b, a), (a, torch.ones(4, 2)), (t[:, :2], t[:, 3:])):  # reversed, another tensor, a gap
        out = _joined(x, y)
        assert torch.equal(out, torch.cat([x, y], dim=-1)) and out.data_ptr() not in (t.data_ptr(), x.data_ptr())


def test_rms_norm_in_place_reference_and_refusal():
    kv = torch.randn(3, 10)
    w = torch.randn(8)
    want = rms_norm_reference(kv[:, :8], w, 1e-6)
    latent = kv[:, :8]
    assert rms_norm(latent, w, 1e-6, in_place=True) is latent and torch.equal(kv[:, :8], want)
    with pytest.raises(ValueError, match=r"rows must be viewable as \[rows, 3\]"):
        rms_norm(torch.randn(3, 4).t(), torch.ones(3), 1e-6, in_place=True)
