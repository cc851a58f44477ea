"""Rotary position embedding with YaRN frequency scaling, on interleaved pairs (DeepSeek-V2's layout).

DeepSeek-V2 rotates only ``qk_rope_head_dim`` (64) of each query/key head, and rotates *interleaved*
pairs ``(x[2i], x[2i+1])`` by the angle ``position * inv_freq[i]``. YaRN changes two things:
the per-pair frequencies (interpolated for slow pairs, kept for fast ones, a linear ramp between) and a
magnitude correction ``mscale`` folded into cos/sin (and, squared, into the softmax scale: see
``ModelConfig.softmax_scale``).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from dsv2_lib.core import kernels
from dsv2_lib.core.config import ModelConfig, RopeConfig, yarn_mscale
from dsv2_lib.core.dtypes import upcast
from dsv2_lib.core.kernels import CUDA_TYPE


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

ROPE_CU = kernels.declare("rope.cu", [f"rope<{t}, {v}>" for t in CUDA_TYPE.values() for v in ("true", "false")])


def rope_cos_sin_cache(cfg: ModelConfig, max_positions: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The rotation table ``[max_positions, rope_dim]`` in fp32: row ``p`` is ``[cos(p·f) | sin(p·f)]·m``.

    ``f [rope_dim // 2]`` are the (YaRN) inverse frequencies and ``m`` the cos/sin magnitude of
    :func:`rope_inv_freq`. Built once and gathered by position: the model sizes it to its latent
    cache's length, which bounds every position it can be asked to rotate.
    """
    inv_freq, magnitude = rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim)
    angles = torch.arange(max_positions, dtype=torch.float32, device=device)[:, None] * inv_freq.to(device)[None, :]
    return torch.cat([torch.cos(angles) * magnitude, torch.sin(angles) * magnitude], dim=-1)


def apply_rope_reference_(q_pe: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
                          cache: torch.Tensor) -> None:
    """Rotate ``q_pe [T, h, d]`` and ``k_pe [T, d]`` in place by ``cache[positions]`` (PyTorch).

    Interleaved pairs: ``(a, b) = (x[2i], x[2i+1]) -> (a·cos - b·sin, a·sin + b·cos)``, each product
    and sum rounded in fp32 (or wider), the result rounded once to ``x.dtype``. ``positions [T]``
    int64; ``cache [P, d]`` from :func:`rope_cos_sin_cache`. Raises ``IndexError`` for a position
    outside ``0 .. P-1`` — a host read of the positions, so skipped while a CUDA graph is being
    captured (PyTorch's indexing then still asserts on the device instead of reading out of bounds).
    """
    capturing = positions.is_cuda and torch.cuda.is_current_stream_capturing()
    if positions.numel() and not capturing and not 0 <= int(positions.min()) <= int(positions.max()) < cache.shape[0]:
        raise IndexError(f"rope: positions span {int(positions.min())}..{int(positions.max())}, "
                         f"the cos/sin cache holds 0..{cache.shape[0] - 1}")
    cos, sin = cache[positions].chunk(2, dim=-1)  # [T, d // 2] each
    for x, c, s in ((q_pe, cos[:, None], sin[:, None]), (k_pe, cos, sin)):
        xf = upcast(x).unflatten(-1, (-1, 2))
        a, b = xf[..., 0], xf[..., 1]
        x.copy_(torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2))


def apply_rope_(q_pe: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor,
                max_position: int | None = None) -> None:
    """Rotate ``q_pe [T, h, d]`` and ``k_pe [T, d]`` in place: the CUDA kernel for CUDA tensors, else the reference.

    Both may be strided views (the model passes ``q[..., 128:]`` of ``q [T, h, 192]`` and
    ``kv[:, 512:]`` of ``kv [T, 576]``); only the last dimension must be dense. ``max_position``
    is an upper bound on ``positions`` that the caller knows on the host (the model passes its batch's
    ``last_position``): it is checked against the cache's length without reading the GPU. Left
    ``None``, the kernel path reads ``positions.max()`` (a device sync; not inside a CUDA graph).
    The kernel also never reads outside the cache: a token whose position lies outside it gets NaN.
    """
    if not kernels.use_kernels(q_pe):
        apply_rope_reference_(q_pe, k_pe, positions, cache)
        return
    kernels.check(q_pe, "rope q_pe", shape=(None, None, None), contiguous=False)
    T, h, d = q_pe.shape
    kernels.check(k_pe, "rope k_pe", dtype=q_pe.dtype, shape=(T, d), device=q_pe.device, contiguous=False)
    kernels.check(positions, "rope positions", dtype=torch.int64, shape=(T,), device=q_pe.device)
    kernels.check(cache, "rope cache", dtype=torch.float32, shape=(None, d), device=q_pe.device)
    if d % 2 or q_pe.stride(-1) != 1 or k_pe.stride(-1) != 1:
        raise ValueError(f"rope: the rotated dimension must be even and dense (d = {d}, strides "
                         f"{q_pe.stride()} and {k_pe.stride()})")
    if T == 0 or cache.shape[0] == 0:
        if T and cache.shape[0] == 0:
            raise IndexError("rope: the cos/sin cache is empty")
        return
    if max_position is None:
        max_position = int(positions.max())
    if max_position >= cache.shape[0]:
        raise IndexError(f"rope: positions up to {max_position}, the cos/sin cache holds 0..{cache.shape[0] - 1}")
    n = 16 // q_pe.element_size()  # elements per 16-byte vector
    vec = (d % n == 0 and all(s % n == 0 for s in (q_pe.stride(0), q_pe.stride(1), k_pe.stride(0)))
           and kernels.aligned16(q_pe, k_pe))
    items = (h + 1) * (d // n if vec else d // 2)  # vectors (or pairs) per token, over all heads and k_pe
    ROPE_CU.launch(f"rope<{CUDA_TYPE[q_pe.dtype]}, {str(vec).lower()}>", q_pe.device, (T,),
                   (min(256, max(32, -(-items // 32) * 32)),),
                   q=kernels.ptr(q_pe), q_row_stride=np.int64(q_pe.stride(0)), q_head_stride=np.int64(q_pe.stride(1)),
                   heads=np.int32(h), k=kernels.ptr(k_pe), k_row_stride=np.int64(k_pe.stride(0)),
                   positions=kernels.ptr(positions), cache=kernels.ptr(cache), num_positions=np.int64(cache.shape[0]),
                   dim=np.int32(d))
