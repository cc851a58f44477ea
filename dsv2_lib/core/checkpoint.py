"""Load an HF-format DeepSeek-V2 checkpoint (``model.safetensors`` or a sharded index) into the model.

Every tensor is checked against the parameter it fills (name, shape, dtype on disk) and every
parameter must be filled exactly once; errors name the file and the tensor. Files are memory-mapped
by the ``safetensors`` package and copied one tensor at a time into the (possibly GPU) parameters,
so the checkpoint is never held in RAM as a whole.

Two checkpoint tensors can fill one parameter. The engine fuses gate and up into one GEMM
(``...mlp.gate_up_proj.weight [2I, H]``: gate rows, then up rows), and stacks the routed experts
(``...mlp.experts.gate_up_proj [E, 2I, H]``, ``...mlp.experts.down_proj [E, H, I]``), while the Hub
keeps ``...mlp.gate_proj.weight``, ``...mlp.up_proj.weight`` and one key per expert
(``...mlp.experts.7.up_proj.weight``). So a checkpoint name maps to (parameter, index), and the
index selects one piece of the parameter seen as :func:`_pieces` does: gate/up half first, then expert.
"""
from __future__ import annotations

import itertools
import re
import stat
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from dsv2_lib.core.safetensors_io import SafetensorsFormatError, read_header, read_index

DISK_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_GATE_UP_KEY = re.compile(r"^(model\.layers\.\d+\.mlp(?:\.shared_experts)?)\.(gate_proj|up_proj)\.weight$")
_HALVES = ("gate_proj", "up_proj")  # the two halves of gate_up_proj, in order
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
        files = _files_from_index(index)
        for shard in sorted(set(files.values())):
            listed = {n for n, f in files.items() if f == shard}
            present = set(_header_names(shard))
            if present - listed:
                raise CheckpointError(f"{shard}: holds {len(present - listed)} tensor(s) that {index.name} does not "
                                      f"list, e.g. " + ", ".join(f"'{n}'" for n in sorted(present - listed)[:3]))
            if listed - present:
                raise CheckpointError(f"{index}: lists {len(listed - present)} tensor(s) in {shard.name} that the "
                                      f"file does not hold, e.g. " + ", ".join(f"'{n}'" for n in sorted(listed - present)[:3]))
        return files
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
        for name in _header_names(f):
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


def _header_names(path: Path) -> list[str]:
    """The tensor names of a safetensors file, read by chapter 01's parser, which refuses what the
    format refuses (a duplicate name, overlapping or out-of-file data, a malformed header). A file
    that is not a regular file (a FIFO, a device) is refused before it is opened: reading one can
    block forever."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path}: not a regular file (a FIFO, a device or a socket?); a checkpoint is made of files")
    try:
        return list(read_header(path)[2])
    except SafetensorsFormatError as e:
        detail = str(e).removeprefix(f"{path}: ")
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt?): {detail}") from None


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from None


def _target(name: str) -> tuple[str, tuple[int, ...]]:
    """Checkpoint name -> (parameter name, index into :func:`_pieces` of it; ``()`` = the whole)."""
    if m := _EXPERT_KEY.match(name):  # ...mlp.experts.7.up_proj.weight
        if m[3] == "down_proj":
            return f"{m[1]}.down_proj", (int(m[2]),)
        return f"{m[1]}.gate_up_proj", (_HALVES.index(m[3]), int(m[2]))
    if m := _GATE_UP_KEY.match(name):  # ...mlp.up_proj.weight, ...mlp.shared_experts.up_proj.weight
        return f"{m[1]}.gate_up_proj.weight", (_HALVES.index(m[2]),)
    return name, ()


def _pieces(param_name: str, param: torch.Tensor) -> torch.Tensor:
    """A view of ``param`` whose leading dims pick one checkpoint tensor: gate/up half, then expert.

    ``gate_up_proj [2I, H] -> [2, I, H]``; stacked ``experts.gate_up_proj [E, 2I, H] -> [2, E, I, H]``;
    stacked ``experts.down_proj [E, H, I]`` as it is (the expert is the leading dim); others whole.
    """
    if param_name.endswith("gate_up_proj.weight"):
        return param.view(2, -1, param.shape[-1])
    if param_name.endswith("experts.gate_up_proj"):
        return param.view(param.shape[0], 2, -1, param.shape[-1]).transpose(0, 1)
    return param


def _lead_dims(param_name: str) -> int:
    """How many leading dims of :func:`_pieces` index the checkpoint tensors of a parameter."""
    return ("gate_up_proj" in param_name) + (".mlp.experts." in param_name)


def load_checkpoint(model: nn.Module, directory: str | Path, progress: bool | None = None,
                    check_finite: bool = True) -> None:
    """Fill every parameter of ``model`` from the checkpoint in ``directory``, converting dtypes.

    ``progress=None`` shows a progress bar only for checkpoints over 1 GB. ``check_finite`` refuses a
    checkpoint with a NaN or infinite weight (one read of every weight where it now lives, on the GPU
    when the model is there, with one host sync for all of them), which would otherwise make every
    logit NaN without a word.
    """
    files = checkpoint_files(directory)
    params = dict(model.named_parameters())
    tied = getattr(getattr(model, "cfg", None), "tie_word_embeddings", False)
    if tied:
        files.pop("lm_head.weight", None)  # tied: the LM head is the embedding
    filled: dict[str, set[tuple[int, ...]]] = {n: set() for n in params}
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        if not _IGNORED.search(name):
            by_file.setdefault(path, []).append(name)

    # the engine's fused/stacked names are not checkpoint names: a piece must come with its full index
    unexpected = [n for names in by_file.values() for n in names
                  if _target(n)[0] not in params or len(_target(n)[1]) != _lead_dims(_target(n)[0])]
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
    if check_finite:
        _check_finite(params, directory)


def _check_finite(params: dict[str, torch.Tensor], directory: str | Path) -> None:
    """Refuse NaN or infinite weights, naming the parameters (one host sync for all of them)."""
    names = [n for n, p in params.items() if p.is_floating_point()]
    if not names:
        return
    with torch.no_grad():
        ok = torch.stack([params[n].isfinite().all() for n in names]).cpu()
    bad = [n for n, good in zip(names, ok.tolist()) if not good]
    if bad:
        raise CheckpointError(f"{directory}: {len(bad)} weight(s) hold NaN or infinite values, e.g. "
                              + ", ".join(f"'{n}'" for n in bad[:3]) + " (load_checkpoint(..., check_finite=False) "
                              "loads them anyway)")


def _expected_entries(param_name: str, param: torch.Tensor) -> list[tuple[int, ...]]:
    """The indices of every checkpoint tensor that fills a parameter (``[()]`` for a parameter stored
    whole), row-major over :func:`_pieces`' leading dims: gate then up; for stacked experts, every
    expert's gate (0, 1, ...) before every expert's up, and ``down_proj`` by expert. It follows the
    engine's layout, not any checkpoint file's; :mod:`dsv2_lib.tools.random_checkpoint` draws its
    tensors in this order."""
    return list(itertools.product(*map(range, _pieces(param_name, param).shape[: _lead_dims(param_name)])))


def _source_name(param_name: str, index: tuple[int, ...]) -> str:
    """The checkpoint's name for the piece ``index`` of a parameter (the inverse of :func:`_target`)."""
    if not index:
        return param_name
    prefix, proj = param_name.removesuffix(".weight").rsplit(".", 1)
    if proj == "gate_up_proj":
        proj, index = _HALVES[index[0]], index[1:]
    return ".".join([prefix, *map(str, index), proj, "weight"])


def _copy_tensor(f, path: Path, name: str, params: dict, filled: dict) -> None:
    target, index = _target(name)
    pieces = _pieces(target, params[target])
    if index and index[-1] >= pieces.shape[len(index) - 1]:  # only an expert number can be out of range
        raise CheckpointError(f"{path}: tensor '{name}': expert {index[-1]} but the model has "
                              f"{pieces.shape[len(index) - 1]} experts")
    dest = pieces[index]  # a view: copying into it fills the parameter
    try:
        view = f.get_slice(name)
        dtype, shape = view.get_dtype(), tuple(view.get_shape())
    except SafetensorError as e:
        raise CheckpointError(f"{path}: cannot read tensor '{name}': {e}") from None
    if dtype not in DISK_DTYPES:
        raise CheckpointError(f"{path}: tensor '{name}' has dtype {dtype}; supported: {', '.join(DISK_DTYPES)}")
    if shape != tuple(dest.shape):
        raise CheckpointError(f"{path}: tensor '{name}' has shape {list(shape)}, expected {list(dest.shape)}")
    if index in filled[target]:
        raise CheckpointError(f"{path}: tensor '{name}' given twice")
    try:
        dest.copy_(f.get_tensor(name))
    except SafetensorError as e:
        raise CheckpointError(f"{path}: cannot read tensor '{name}' (truncated file?): {e}") from None
    filled[target].add(index)
