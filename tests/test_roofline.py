"""Chapter 00's arithmetic: parameter counts, KV-cache sizes and the decode roofline."""
import collections
import dataclasses
import math

import pytest

from dsv2_lib.core.config import DEEPSEEK_V2_LITE, TINY
from dsv2_lib.tools.roofline import (
    active_parameters_per_token,
    attention_parameters_per_layer,
    decode_bytes_breakdown,
    decode_bytes_per_step,
    decode_flops_per_step,
    decode_roofline_tokens_per_s,
    expected_distinct_experts,
    kv_cache_bytes_per_token,
    kv_cache_values_per_token_per_layer,
    parameter_counts,
    prefill_roofline_tokens_per_s,
)

LITE = DEEPSEEK_V2_LITE


def test_v2_lite_totals_match_the_paper():
    # The paper (arXiv:2405.04434) reports 15.7 B total and 2.4 B activated, i.e. to 2-3
    # significant figures. Exact values: 15,706,484,224 and 2,451,435,008; the paper's "2.4" is
    # 2.45 truncated, so the active count gets a 3 % band, the total a 0.5 % band.
    assert parameter_counts(LITE)["total"] == 15_706_484_224
    assert parameter_counts(LITE)["total"] / 1e9 == pytest.approx(15.7, rel=0.005)
    assert active_parameters_per_token(LITE) == 2_451_435_008
    assert active_parameters_per_token(LITE) / 1e9 == pytest.approx(2.4, rel=0.03)


def test_v2_lite_components_by_hand():
    c = parameter_counts(LITE)
    assert c["embedding"] == c["lm_head"] == 102400 * 2048
    attn = attention_parameters_per_layer(LITE)
    assert attn == {
        "q_proj": 16 * 192 * 2048,
        "kv_a_proj_with_mqa": 576 * 2048,
        "kv_a_layernorm": 512,
        "kv_b_proj": 16 * 256 * 512,
        "o_proj": 2048 * 16 * 128,
    }
    assert c["attention"] == 27 * sum(attn.values())
    assert c["dense_mlp"] == 1 * 3 * 2048 * 10944
    assert c["routed_experts"] == 26 * 64 * 3 * 2048 * 1408
    assert c["shared_experts"] == 26 * 3 * 2048 * 2816
    assert c["router"] == 26 * 64 * 2048
    assert c["norms"] == 27 * 2 * 2048 + 2048
    assert c["total"] == sum(v for k, v in c.items() if k != "total")


def _hf_parameter_counts(cfg):
    """Build transformers' model on the meta device (no memory) and sum its parameters by component."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**cfg.to_hf_dict()))
    by = collections.Counter()
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            by["embedding"] += p.numel()
        elif name.startswith("lm_head"):
            by["lm_head"] += p.numel()
        elif ".self_attn." in name:
            by["attention"] += p.numel()
        elif ".mlp.experts." in name:
            by["routed_experts"] += p.numel()
        elif ".mlp.shared_experts." in name:
            by["shared_experts"] += p.numel()
        elif ".mlp.gate." in name:
            by["router"] += p.numel()
        elif ".mlp." in name:
            by["dense_mlp"] += p.numel()
        else:
            by["norms"] += p.numel()
    by["total"] = sum(by.values())
    return by


@pytest.mark.parametrize(
    "cfg",
    [
        LITE,
        TINY,
        dataclasses.replace(TINY, q_lora_rank=48, attention_bias=True),
        dataclasses.replace(TINY, first_k_dense_replace=0, n_shared_experts=1),
        dataclasses.replace(TINY, tie_word_embeddings=True),
    ],
    ids=["v2-lite", "tiny", "tiny-q_lora-bias", "tiny-all-moe", "tiny-tied"],
)
def test_counts_match_transformers(cfg):
    ours = {k: v for k, v in parameter_counts(cfg).items() if v}
    assert ours == dict(_hf_parameter_counts(cfg))


def test_active_parameters_tiny_by_hand():
    c = parameter_counts(TINY)
    unused = 5 * (16 - 2) * 3 * 256 * 128  # 5 MoE layers, 14 of 16 experts (3 matrices of 256 x 128) idle per token
    assert active_parameters_per_token(TINY) == c["total"] - c["embedding"] - unused


def test_kv_cache_schemes():
    values = {s: kv_cache_values_per_token_per_layer(LITE, s) for s in ("mha", "gqa", "mla", "mqa")}
    assert values == {"mha": 5120, "gqa": 1280, "mla": 576, "mqa": 320}
    assert kv_cache_values_per_token_per_layer(LITE, "gqa", groups=8) == 2560
    assert kv_cache_bytes_per_token(LITE) == 27 * 576 * 2 == 31104
    with pytest.raises(ValueError, match="scheme"):
        kv_cache_values_per_token_per_layer(LITE, "mla2")
    with pytest.raises(ValueError, match="groups"):
        kv_cache_values_per_token_per_layer(LITE, "gqa", groups=3)


def test_expected_distinct_experts():
    assert expected_distinct_experts(LITE, 0) == 0
    assert expected_distinct_experts(LITE, 1) == pytest.approx(6)
    assert expected_distinct_experts(LITE, 2) == pytest.approx(6 + 6 * 58 / 64)
    assert expected_distinct_experts(LITE, 1000) == pytest.approx(64)
    seq = [expected_distinct_experts(LITE, b) for b in range(1, 200)]
    assert all(a < b for a, b in zip(seq, seq[1:]))


def test_decode_batch1_anchor():
    # DESIGN.md: 4.9 GB read per batch-1 step, ~871 tok/s at 4.2 TB/s. Our accounting (embedding
    # table not read, lm_head read) gives 4.903 GB and 857 tok/s; the anchor's 871 corresponds to
    # 4.82 GB, so the throughput is checked to 2.5 %.
    assert decode_bytes_per_step(LITE, 1, 0) / 1e9 == pytest.approx(4.9, rel=0.01)
    assert decode_roofline_tokens_per_s(LITE, 1, 0, bandwidth=4.2e12) == pytest.approx(871, rel=0.025)
    # bytes per step = 2 × (active parameters + one embedding row)
    assert decode_bytes_per_step(LITE, 1, 0) == 2 * (active_parameters_per_token(LITE) + 2048)


def test_decode_kv_and_batch_terms():
    b = decode_bytes_breakdown(LITE, 4, 1000)
    assert b["kv_cache"] == 4 * 1000 * 27 * 576 * 2
    assert b["embedding_rows"] == 4 * 2048 * 2
    assert decode_bytes_per_step(LITE, 4, 1000, bytes_per_value=4) == pytest.approx(2 * decode_bytes_per_step(LITE, 4, 1000))
    # a large batch touches every expert: all weights but the embedding table are read
    w = parameter_counts(LITE)["total"] - parameter_counts(LITE)["embedding"]
    assert decode_bytes_per_step(LITE, 1024, 0) == pytest.approx(2 * (w + 1024 * 2048))


def test_decode_roofline_is_memory_bound_and_monotone():
    # DESIGN.md anchor: ~14,000 tok/s at batch 128 (context ≈ 2k)
    assert decode_roofline_tokens_per_s(LITE, 128, 2048) == pytest.approx(14_000, rel=0.03)
    assert decode_bytes_per_step(LITE, 128, 2048) / 4.2e12 > 5 * decode_flops_per_step(LITE, 128, 2048) / 790e12
    tps = [decode_roofline_tokens_per_s(LITE, b, 1024) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert all(a < b for a, b in zip(tps, tps[1:]))
    # compute-bound when FLOPs are scarce
    slow = decode_roofline_tokens_per_s(LITE, 64, 0, flops=1e12)
    assert slow == pytest.approx(64 / (decode_flops_per_step(LITE, 64, 0) / 1e12))


def test_prefill_anchor():
    # DESIGN.md: ~176 k tok/s compute limit for prefill at 790 TFLOP/s
    assert prefill_roofline_tokens_per_s(LITE) == pytest.approx(176_000, rel=0.01)
    assert math.isclose(prefill_roofline_tokens_per_s(LITE, flops=1.0) * 2 * (2_451_435_008 - 209_715_200), 1.0)


def test_a_short_prefill_is_bound_by_the_weight_read():
    """512 tokens touch all 64 experts of every MoE layer: the pass reads ~31 GB, 7.4 ms at 4.2 TB/s,
    longer than its arithmetic (2.9 ms); from about 1,300 tokens the arithmetic takes over."""
    short = prefill_roofline_tokens_per_s(LITE, 512)
    assert short == pytest.approx(512 / (decode_bytes_per_step(LITE, 512, 0) / 4.2e12))
    assert 60_000 < short < 80_000
    assert prefill_roofline_tokens_per_s(LITE, 4096) == prefill_roofline_tokens_per_s(LITE)  # compute-bound
    crossing = next(n for n in range(256, 4096, 16)
                    if prefill_roofline_tokens_per_s(LITE, n) == prefill_roofline_tokens_per_s(LITE))
    assert 1_200 < crossing < 1_400
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        prefill_roofline_tokens_per_s(LITE, 0)
