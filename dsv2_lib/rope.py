"""Rotary position embedding with YaRN frequency scaling, on interleaved pairs (DeepSeek-V2's layout).

DeepSeek-V2 rotates only ``qk_rope_head_dim`` (64) of each query/key head, and rotates *interleaved*
pairs ``(x[2i], x[2i+1])`` by the angle ``position * inv_freq[i]``. YaRN changes two things:
the per-pair frequencies (interpolated for slow pairs, kept for fast ones, a linear ramp between) and a
magnitude correction ``mscale`` folded into cos/sin (and, squared, into the softmax scale: see
``ModelConfig.softmax_scale``).
"""
from __future__ import annotations

import math

import torch

from .config import ModelConfig, RopeConfig, yarn_mscale
from .weights import upcast


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    """The (fractional) pair index whose wavelength fits ``num_rotations`` times into ``max_pos``."""
    return dim * math.log(max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies ``[dim // 2]`` (fp32) and the cos/sin magnitude factor.

    Pairs rotating more than ``beta_fast`` times over the original context keep their frequency
    (extrapolation); pairs rotating fewer than ``beta_slow`` times are divided by ``factor``
    (interpolation); a linear ramp blends the pairs in between.
    """
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    pos_freq = rope.theta**exponents
    inv_freq = 1.0 / pos_freq
    if rope.kind != "yarn":
        return inv_freq, 1.0
    orig = rope.original_max_position_embeddings
    low = max(math.floor(_yarn_correction_dim(rope.beta_fast, dim, rope.theta, orig)), 0)
    high = min(math.ceil(_yarn_correction_dim(rope.beta_slow, dim, rope.theta, orig)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: keep the original frequency (fast pairs); 0: interpolate (slow pairs)
    inv_freq = (1.0 / (rope.factor * pos_freq)) * (1 - keep) + inv_freq * keep
    magnitude = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return inv_freq, magnitude


def rope_cos_sin(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[len(positions), qk_rope_head_dim // 2]`` in fp32, mscale folded in."""
    inv_freq, magnitude = rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim)
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    return torch.cos(angles) * magnitude, torch.sin(angles) * magnitude


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x [T, ..., rope_dim]`` by per-token ``cos, sin [T, rope_dim // 2]``.

    ``(a, b) -> (a cos - b sin, a sin + b cos)`` computed in fp32 (or wider), returned in ``x.dtype``.
    """
    xf = upcast(x).unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    c, s = cos.view(shape), sin.view(shape)
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).to(x.dtype)
