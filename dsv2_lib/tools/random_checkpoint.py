"""Write a DeepSeek-V2 checkpoint with random weights in the Hub's layout (per-expert keys).

Used for the embedded tiny model, the parity tests' tiny configs, and the full-size benchmark
model (both engines then load the very same safetensors files).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsv2_lib.core.checkpoint import _expected_entries, _pieces, _source_name
from dsv2_lib.core.config import ModelConfig
from dsv2_lib.model.deepseek_v2 import DeepseekV2


def hub_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the checkpoint in Hub layout -> its shape, in a fixed order."""
    with torch.device("meta"):
        model = DeepseekV2(cfg)
    shapes = {}
    for name, p in model.named_parameters():
        for index in _expected_entries(name, p):
            shapes[_source_name(name, index)] = tuple(_pieces(name, p).shape[len(index):])
    return shapes


def write_random_checkpoint(
    cfg: ModelConfig,
    directory: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    std: float = 0.02,
    shard_bytes: int | None = None,
    device: str = "cpu",
) -> Path:
    """Write ``config.json`` and random weights to ``directory``.

    Matrices are ``N(0, std²)``, norm scales ``1 + N(0, 0.1²)`` (not all ones, so a misplaced norm
    weight shows). Tensors are drawn in :func:`hub_tensor_shapes` order (the model's parameters, each
    expanded to its Hub tensors) from one generator seeded with ``seed`` on ``device``, so the same
    arguments give the same bytes. With ``shard_bytes`` the weights are split
    into ``model-0000i-of-0000n.safetensors`` files plus an index, as large checkpoints are.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    gen = torch.Generator(device=device).manual_seed(seed)
    shards = _plan_shards(hub_tensor_shapes(cfg), dtype.itemsize, shard_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards):
        tensors = {}
        for name, shape in shard.items():
            t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
            t = (1 + 0.1 * t) if name.endswith("norm.weight") else t * std
            tensors[name] = t.to(dtype).cpu()
            total += tensors[name].numel() * dtype.itemsize
        save_file(tensors, directory / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return directory


def _plan_shards(shapes: dict[str, tuple[int, ...]], itemsize: int, shard_bytes: int | None) -> list[dict]:
    """Split tensors, in order, into shards of at most ``shard_bytes`` (one shard if ``None``)."""
    shards: list[dict] = [{}]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if shard_bytes and shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = shape
        size += nbytes
    return shards
