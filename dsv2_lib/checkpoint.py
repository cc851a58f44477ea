"""Load an HF-format DeepSeek-V2 checkpoint (``model.safetensors`` or a sharded index) into the model.

Every tensor is checked against the parameter it fills (name, shape, dtype on disk) and every
parameter must be filled exactly once; errors name the file and the tensor. Files are memory-mapped
by the ``safetensors`` package and copied one tensor at a time into the (possibly GPU) parameters,
so the checkpoint is never held in RAM as a whole. The Hub stores each expert separately
(``...mlp.experts.7.up_proj.weight``); those are stacked into ``...mlp.experts.up_proj [E, I, H]``.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from .safetensors_io import SafetensorsFormatError, read_index

DISK_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"\.mlp\.experts\.(gate_proj|up_proj|down_proj)$")
_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")  # a buffer some old exports saved; derived, not a weight


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the file and tensor."""


def checkpoint_files(directory: str | Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it, from the index or the single file."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return _files_from_index(index)
    single = directory / "model.safetensors"
    files = [single] if single.is_file() else sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        if pickles:
            raise CheckpointError(
                f"{directory}: only pickle checkpoints found ({', '.join(pickles[:3])}); they can run arbitrary "
                "code when loaded, so this engine reads safetensors only. Convert them once with "
                "transformers (from_pretrained(...).save_pretrained(dir)) and load that directory."
            )
        raise CheckpointError(f"{directory}: no model.safetensors, no model.safetensors.index.json, no *.safetensors")
    names: dict[str, Path] = {}
    for f in files:
        for name in _open(f).keys():
            if name in names:
                raise CheckpointError(f"{f}: tensor '{name}' also appears in {names[name]}")
            names[name] = f
    return names


def _files_from_index(index: Path) -> dict[str, Path]:
    """The index's ``weight_map`` with every shard checked (chapter 01's parser does the checking)."""
    try:
        return read_index(index.parent)[1]
    except SafetensorsFormatError as e:
        raise CheckpointError(str(e)) from None


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from None


def _target(name: str) -> tuple[str, int | None]:
    """Checkpoint name -> (parameter name, expert index or None)."""
    m = _EXPERT_KEY.match(name)
    return (f"{m[1]}.{m[3]}", int(m[2])) if m else (name, None)


def load_checkpoint(model: nn.Module, directory: str | Path, progress: bool | None = None) -> None:
    """Fill every parameter of ``model`` from the checkpoint in ``directory``, converting dtypes.

    ``progress=None`` shows a progress bar only for checkpoints over 1 GB.
    """
    files = checkpoint_files(directory)
    params = dict(model.named_parameters())
    tied = getattr(getattr(model, "cfg", None), "tie_word_embeddings", False)
    if tied:
        files.pop("lm_head.weight", None)  # tied: the LM head is the embedding
    filled: dict[str, set[int | None]] = {n: set() for n in params}
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        if not _IGNORED.search(name):
            by_file.setdefault(path, []).append(name)

    # the engine's stacked expert names are not checkpoint names: experts come one key each
    unexpected = [n for names in by_file.values() for n in names
                  if _target(n)[0] not in params or (_target(n)[1] is None and _STACKED.search(n))]
    if unexpected:
        raise CheckpointError(
            f"{directory}: {len(unexpected)} tensor(s) the model does not have, e.g. "
            + ", ".join(f"'{n}' in {files[n].name}" for n in unexpected[:3])
        )
    total = sum(p.numel() * p.element_size() for p in params.values())
    bar = tqdm(total=sum(map(len, by_file.values())), unit="tensor", desc="loading",
               disable=not (progress if progress is not None else total > 1 << 30))
    with torch.no_grad():
        for path, names in by_file.items():
            f = _open(path)
            for name in names:
                _copy_tensor(f, path, name, params, filled)
                bar.update()
    bar.close()

    missing = [_source_name(n, e) for n, p in params.items() for e in _expected_entries(n, p) if e not in filled[n]]
    if missing:
        raise CheckpointError(f"{directory}: {len(missing)} tensor(s) missing, e.g. " + ", ".join(f"'{m}'" for m in missing[:3]))


def _expected_entries(param_name: str, param: torch.Tensor) -> list[int | None]:
    """A stacked expert parameter is filled expert by expert; any other in one piece (``None``)."""
    return list(range(param.shape[0])) if _STACKED.search(param_name) else [None]


def _source_name(param_name: str, expert: int | None) -> str:
    """The checkpoint's name for a parameter (or one expert's slice of a stacked one)."""
    if expert is None:
        return param_name
    prefix, proj = param_name.rsplit(".", 1)
    return f"{prefix}.{expert}.{proj}.weight"


def _copy_tensor(f, path: Path, name: str, params: dict, filled: dict) -> None:
    target, expert = _target(name)
    param = params[target]
    dest = param if expert is None else None
    if expert is not None:
        if expert >= param.shape[0]:
            raise CheckpointError(f"{path}: tensor '{name}': expert {expert} but the model has {param.shape[0]} experts")
        dest = param[expert]
    try:
        view = f.get_slice(name)
        dtype, shape = view.get_dtype(), tuple(view.get_shape())
    except SafetensorError as e:
        raise CheckpointError(f"{path}: cannot read tensor '{name}': {e}") from None
    if dtype not in DISK_DTYPES:
        raise CheckpointError(f"{path}: tensor '{name}' has dtype {dtype}; supported: {', '.join(DISK_DTYPES)}")
    if shape != tuple(dest.shape):
        raise CheckpointError(f"{path}: tensor '{name}' has shape {list(shape)}, expected {list(dest.shape)}")
    if expert in filled[target]:
        raise CheckpointError(f"{path}: tensor '{name}' given twice")
    try:
        dest.copy_(f.get_tensor(name))
    except SafetensorError as e:
        raise CheckpointError(f"{path}: cannot read tensor '{name}' (truncated file?): {e}") from None
    filled[target].add(expert)
