"""RoPE with YaRN on the CPU: frequencies against transformers, the cos/sin table, the in-place
reference rotation (on the model's strided views), its errors, and how the model holds the table."""
import dataclasses
import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import _compute_yarn_parameters

from dsv2_lib.core.config import DEEPSEEK_V2_LITE, TINY, RopeConfig
from dsv2_lib.core.dtypes import default_dtype
from dsv2_lib.model.cache import LatentCache, SequenceBatch
from dsv2_lib.model.deepseek_v2 import DeepseekV2
from dsv2_lib.ops.rope import apply_rope_, apply_rope_reference_, rope_cos_sin_cache, rope_inv_freq


def hf_config(cfg):
    d = cfg.to_hf_dict()
    return transformers.DeepseekV2Config(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})


@pytest.mark.parametrize("cfg", [DEEPSEEK_V2_LITE, TINY], ids=["lite", "tiny"])
def test_yarn_frequencies_equal_transformers(cfg):
    inv_hf, scaling_hf = _compute_yarn_parameters(hf_config(cfg))
    inv, magnitude = rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim)
    assert torch.equal(inv, inv_hf.float()) and magnitude == pytest.approx(scaling_hf, rel=1e-12)


def test_yarn_keeps_fast_pairs_and_interpolates_slow_ones():
    """V2-Lite: pair 0 keeps theta^0 = 1; the slowest pairs are divided by exactly the factor 40."""
    plain, _ = rope_inv_freq(RopeConfig(theta=1e4), 64)
    yarn, magnitude = rope_inv_freq(DEEPSEEK_V2_LITE.rope, 64)
    assert magnitude == 1.0  # mscale == mscale_all_dim: the magnitudes cancel
    assert torch.equal(yarn[:10], plain[:10])
    torch.testing.assert_close(yarn[-6:], plain[-6:] / 40, rtol=1e-6, atol=0)
    assert bool((yarn <= plain).all())


def test_cache_rows_are_cos_and_sin_times_magnitude():
    cfg = dataclasses.replace(TINY, rope=dataclasses.replace(TINY.rope, mscale=1.0, mscale_all_dim=0.5))
    inv, m = rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim)
    assert m != 1.0
    table = rope_cos_sin_cache(cfg, 50)
    assert table.shape == (50, cfg.qk_rope_head_dim) and table.dtype == torch.float32
    angles = torch.arange(50, dtype=torch.float64)[:, None] * inv.double()[None, :]
    torch.testing.assert_close(table.double(), torch.cat([angles.cos(), angles.sin()], -1) * m, atol=1e-5, rtol=0)
    assert torch.equal(rope_cos_sin_cache(cfg, 80)[:50], table)  # a row does not depend on the table's length


def rotate_naive(x, pos, inv, m):
    """Pair by pair, as complex numbers: (a + ib) · m·e^{i·pos·f}, in fp64 except the angle pos·f,
    which is rounded to fp32 as in transformers and in the table (at position 4999 that rounding alone
    moves the angle by up to 2.4e-4 rad, far more than any later rounding)."""
    z = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    angle = (pos.float()[:, None] * inv[None, :]).double()
    rot = torch.polar(torch.full_like(angle, m), angle)
    if x.dim() == 3:
        rot = rot[:, None]
    return torch.view_as_real(z * rot).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_reference_rotates_the_models_strided_views_in_place(dtype):
    cfg = DEEPSEEK_V2_LITE
    table = rope_cos_sin_cache(cfg, 5000)
    pos = torch.tensor([0, 4999, 3, 3, 1024])
    q = torch.randn(5, 16, 192).to(dtype)
    kv = torch.randn(5, 576).to(dtype)
    q0, kv0 = q.clone(), kv.clone()
    q_pe, k_pe = q[..., 128:], kv[:, 512:]
    apply_rope_(q_pe, k_pe, pos, table, max_position=4999)  # CPU tensors: the reference
    assert torch.equal(q[..., :128], q0[..., :128]) and torch.equal(kv[:, :512], kv0[:, :512])
    inv, m = rope_inv_freq(cfg.rope, 64)
    tol = {torch.float64: 1e-5, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]  # fp32 table; bf16 output
    torch.testing.assert_close(q_pe.double(), rotate_naive(q0[..., 128:], pos, inv, m), atol=tol * 4, rtol=tol)
    torch.testing.assert_close(k_pe.double(), rotate_naive(kv0[:, 512:], pos, inv, m), atol=tol * 4, rtol=tol)


def test_score_depends_only_on_the_distance():
    """q rotated to m and k rotated to n: q·k is the same for every (m, n) with the same m - n.

    The table is built in fp64 here: fp32 angles (rounded by up to 1.2e-4 rad at position 2000)
    would blur the identity, which is exact in real arithmetic."""
    inv, _ = rope_inv_freq(DEEPSEEK_V2_LITE.rope, 64)
    angles = torch.arange(3000, dtype=torch.float64)[:, None] * inv.double()[None, :]
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    q, k = torch.randn(1, 1, 64, dtype=torch.float64), torch.randn(1, 64, dtype=torch.float64)

    def score(m, n):
        qr, kr = q.clone(), k.clone()
        apply_rope_reference_(qr, torch.empty(1, 64, dtype=torch.float64), torch.tensor([m]), table)
        apply_rope_reference_(torch.empty(1, 0, 64, dtype=torch.float64), kr, torch.tensor([n]), table)
        return float(qr[0, 0] @ kr[0])

    for dist in (0, 7, 500):
        scores = [score(n + dist, n) for n in (0, 13, 2000)]
        assert max(scores) - min(scores) < 1e-9 * max(1.0, abs(scores[0]))


@pytest.mark.parametrize("positions", [[0, 10], [-1, 3]])
def test_reference_refuses_positions_outside_the_table(positions):
    with pytest.raises(IndexError, match=r"the cos/sin cache holds 0\.\.9"):
        apply_rope_reference_(torch.zeros(2, 1, 4), torch.zeros(2, 4), torch.tensor(positions), torch.zeros(10, 4))


def test_no_tokens_is_a_no_op():
    apply_rope_(torch.zeros(0, 2, 4), torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64), torch.zeros(10, 4))


def test_model_builds_the_table_once_as_long_as_the_latent_cache():
    cfg = TINY
    torch.manual_seed(0)
    with default_dtype(torch.float32):
        model = DeepseekV2(cfg)
    for p in model.parameters():
        p.copy_(0.05 * torch.randn_like(p))
    cache = LatentCache(cfg, 1, 24, torch.float32, "cpu")
    model(torch.tensor([1, 2, 3]), SequenceBatch((0,), (0,), (3,)), cache)
    table = model._rope_cache
    assert table.shape == (24, cfg.qk_rope_head_dim)
    model(torch.tensor([4]), SequenceBatch((0,), (3,), (1,), decode=True), cache)
    assert model._rope_cache is table  # reused, not rebuilt
    model(torch.tensor([1]), SequenceBatch((0,), (0,), (1,)), LatentCache(cfg, 1, 40, torch.float32, "cpu"))
    assert model._rope_cache.shape[0] == 40 and "_rope_cache" not in model.state_dict()


def test_softmax_scale_has_the_squared_mscale():
    m = 0.1 * 0.707 * math.log(40) + 1
    assert DEEPSEEK_V2_LITE.softmax_scale == pytest.approx(m * m / math.sqrt(192), rel=1e-12)
    assert round(DEEPSEEK_V2_LITE.softmax_scale, 6) == 0.114721
