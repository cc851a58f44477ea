"""``python -m dsv2_lib diff``: on a correct engine every step agrees with transformers; with a bug
planted in one step, the tool names that step and no earlier one."""
import subprocess
import sys

import pytest
import torch

from dsv2_lib.engine.llm import EMBEDDED_MODELS
from dsv2_lib.model import mla, mlp
from dsv2_lib.tools.diff import LAYER_STEPS, diff, first_divergence

TINY_DIR = EMBEDDED_MODELS["tiny"]
IDS = [1, 87, 402, 33, 1250, 9, 77, 3001, 12]


def test_the_engine_agrees_with_transformers_at_every_step():
    steps = diff(TINY_DIR, IDS)
    names = [s.name for s in steps]
    # every step of every layer was recorded on both sides and compared (none silently missing)
    assert len(steps) == 1 + 6 * len(LAYER_STEPS) + 2 and names[0] == "embedding" and names[-1] == "logits"
    assert first_divergence(steps) is None, "\n".join(map(str, steps))


def neox_pairing(apply_rope_):
    """RoPE with the wrong pairing: (i, i + d/2) rotated together instead of DeepSeek's (2i, 2i + 1)."""
    def buggy(q_pe, k_pe, *args, **kwargs):
        d = q_pe.shape[-1]
        perm = torch.arange(d).view(2, d // 2).t().reshape(-1)  # interleaved slot j holds half-split index perm[j]
        q, k = q_pe[..., perm].clone(), k_pe[..., perm].clone()
        apply_rope_(q, k, *args, **kwargs)
        q_pe[..., perm], k_pe[..., perm] = q, k
    return buggy


def test_a_wrong_rope_pairing_is_named(monkeypatch):
    monkeypatch.setattr(mla, "apply_rope_", neox_pairing(mla.apply_rope_))
    steps = diff(TINY_DIR, IDS)
    bad = first_divergence(steps)
    assert bad is not None and bad.name == "layer 0 rope q_pe", "\n".join(map(str, steps))
    assert all(s.ok for s in steps[: steps.index(bad)])  # the projections before it still agree


def test_a_wrong_activation_is_named(monkeypatch):
    def gelu_and_mul(x):
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate) * up
    monkeypatch.setattr(mlp, "silu_and_mul", gelu_and_mul)
    bad = first_divergence(diff(TINY_DIR, IDS))
    assert bad is not None and bad.name == "layer 0 mlp"  # the tiny model's layer 0 is its dense MLP


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_16_bit_runs_agree_within_their_tolerance(dtype):
    assert first_divergence(diff(TINY_DIR, IDS, dtype=dtype)) is None


def test_command_line_exit_codes():
    run = [sys.executable, "-m", "dsv2_lib", "diff"]
    r = subprocess.run([*run, "--model", "tiny", "To be, or not"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "no divergence" in r.stdout, r.stderr
    r = subprocess.run([*run, "--model", "/nonexistent", "hi"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "not an embedded model" in r.stderr and "Traceback" not in r.stderr
