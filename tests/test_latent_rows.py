"""The fused latent-rows op on the CPU: it never claims CPU tensors, and refuses a call it cannot take."""
import pytest
import torch

from dsv2_lib.ops.latent_rows import fused_applies, latent_rows_


def test_cpu_tensors_take_the_three_ops():
    kv, q_pe = torch.zeros(2, 576, dtype=torch.bfloat16), torch.zeros(2, 16, 64, dtype=torch.bfloat16)
    w, cache = torch.ones(512, dtype=torch.bfloat16), torch.zeros(8, 576, dtype=torch.bfloat16)
    assert not fused_applies(kv, q_pe, w, cache)
    with pytest.raises(ValueError, match="need the three separate ops"):
        latent_rows_(kv, q_pe, w, 1e-6, torch.zeros(2, dtype=torch.int64), torch.zeros(8, 64), cache,
                     torch.zeros(2, dtype=torch.int64), max_position=0, max_slot=0)
