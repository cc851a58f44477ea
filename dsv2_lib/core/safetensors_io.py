"""The safetensors format by hand: a validating header parser, zero-copy tensor views, sharded indexes.

A ``.safetensors`` file is three parts, back to back::

    [ 8 bytes: N, unsigned little-endian ][ N bytes: JSON header, utf-8 ][ data section: raw tensor bytes ]

The header is a JSON object. Each entry but ``__metadata__`` describes one tensor::

    "model.norm.weight": {"dtype": "BF16", "shape": [128], "data_offsets": [0, 256]}

``data_offsets = [begin, end]`` count bytes from the first byte of the data section; the tensor's
values are stored row-major (C order), little-endian. ``__metadata__``, optional, maps strings to
strings. The data section must be covered exactly: no tensor may overlap another, and no byte may be
left unused.

The engine loads checkpoints with the ``safetensors`` package (:mod:`dsv2_lib.core.checkpoint`); this
module exists to teach the format (chapter 01) and to check that package on our files. A checkpoint
is untrusted input, so every number in it is checked before it is used, and every problem raises
:class:`SafetensorsFormatError` naming the file and the tensor.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
"""Bytes per element of every dtype this parser accepts (the format's names)."""

TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16,
    "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
    "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64,
}
"""The torch dtype of each format dtype (for :func:`load_tensors`)."""

MAX_HEADER_BYTES = 100_000_000
"""A larger header length is refused as absurd (the ``safetensors`` package has the same limit)."""


class SafetensorsFormatError(ValueError):
    """A file (or index) that is not valid safetensors; the message names the file and the tensor."""


@dataclass(frozen=True)
class TensorInfo:
    """One header entry. ``start``/``end`` are byte offsets into the data section, ``end`` exclusive."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """``object_pairs_hook`` for json: a key given twice would silently keep only the last value."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise SafetensorsFormatError(f"duplicate key {key!r} in a JSON object")
        out[key] = value
    return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_entry(where: str, name: str, entry) -> TensorInfo:
    """Check one tensor entry's fields and types (not yet its place in the data section)."""
    if not isinstance(entry, dict):
        raise SafetensorsFormatError(f"{where}: tensor {name!r}: entry must be an object, got {type(entry).__name__}")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise SafetensorsFormatError(f"{where}: tensor {name!r}: missing field(s) {', '.join(missing)}")
    extra = sorted(set(entry) - {"dtype", "shape", "data_offsets"})
    if extra:
        raise SafetensorsFormatError(f"{where}: tensor {name!r}: unknown field(s) {', '.join(map(repr, extra))}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise SafetensorsFormatError(
            f"{where}: tensor {name!r}: unknown dtype {dtype!r}; known: {', '.join(DTYPE_SIZES)}")
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise SafetensorsFormatError(f"{where}: tensor {name!r}: shape must be a list of integers, got {shape!r}")
    if any(d < 0 for d in shape):
        raise SafetensorsFormatError(f"{where}: tensor {name!r}: negative dimension in shape {shape}")
    if math.prod(max(d, 1) for d in shape) >= 1 << 63:  # even an empty tensor needs int64 strides
        raise SafetensorsFormatError(f"{where}: tensor {name!r}: shape {shape} is too large")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise SafetensorsFormatError(
            f"{where}: tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
    return TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])


def read_header(path: str | Path) -> tuple[int, dict[str, str], dict[str, TensorInfo]]:
    """Parse and validate the header of a safetensors file without reading its data.

    Returns ``(N, metadata, tensors)``: the header length in bytes, the ``__metadata__`` strings
    (empty if absent) and ``name -> TensorInfo`` in the header's order. The data section starts at
    byte ``8 + N`` of the file. Raises :class:`SafetensorsFormatError` for anything invalid.
    """
    where = str(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            first = f.read(8)
            if len(first) < 8:
                raise SafetensorsFormatError(f"{where}: {size} bytes, too short for the 8-byte header length")
            (n,) = struct.unpack("<Q", first)
            if n > MAX_HEADER_BYTES:
                raise SafetensorsFormatError(f"{where}: header length {n:,} is absurd (limit {MAX_HEADER_BYTES:,})")
            if 8 + n > size:
                raise SafetensorsFormatError(f"{where}: header length {n:,} runs past the end of the {size:,}-byte file")
            raw = f.read(n)
    except OSError as e:
        raise SafetensorsFormatError(f"{where}: cannot read: {e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SafetensorsFormatError(f"{where}: header is not valid utf-8: {e}") from None
    try:
        header = json.loads(text, object_pairs_hook=_reject_duplicates)
    except SafetensorsFormatError as e:
        raise SafetensorsFormatError(f"{where}: header: {e}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; deep nesting recurses
        raise SafetensorsFormatError(f"{where}: header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsFormatError(f"{where}: header must be a JSON object, got {type(header).__name__}")

    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsFormatError(f"{where}: __metadata__ must map strings to strings, got {metadata!r}")
    tensors = {name: _parse_entry(where, name, entry) for name, entry in header.items()}

    data_size = size - 8 - n
    for name, t in tensors.items():
        if t.end > data_size:
            raise SafetensorsFormatError(
                f"{where}: tensor {name!r}: data_offsets end {t.end:,} is past the {data_size:,}-byte data section")
        expected = math.prod(t.shape) * DTYPE_SIZES[t.dtype]
        if t.nbytes != expected:
            raise SafetensorsFormatError(
                f"{where}: tensor {name!r}: {t.nbytes:,} bytes for {t.dtype} {list(t.shape)}, "
                f"which needs {expected:,}")
    # the tensors, sorted by offsets, must tile the data section: each starts where the last ended
    pos, prev = 0, None
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if t.start < pos:
            raise SafetensorsFormatError(
                f"{where}: tensor {name!r} (bytes {t.start:,}..{t.end:,}) overlaps tensor {prev!r} (ends at {pos:,})")
        if t.start > pos:
            raise SafetensorsFormatError(
                f"{where}: bytes {pos:,}..{t.start:,} of the data section belong to no tensor (before {name!r})")
        pos, prev = t.end, name
    if pos != data_size:
        raise SafetensorsFormatError(
            f"{where}: bytes {pos:,}..{data_size:,} at the end of the data section belong to no tensor")
    return n, metadata, tensors


def load_tensors(path: str | Path, copy: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a CPU tensor: zero-copy views of a memory map of the file,
    or with ``copy=True`` tensors of their own, read from the file.

    The map is copy-on-write (``mmap.ACCESS_COPY``): reading a tensor reads the page cache, nothing is
    copied until a page is written, and writes never reach the file. Each view keeps the map alive and
    reads the file's pages when touched, so the file must stay as it is while a view is in use: a file
    truncated under a live view ends the process with SIGBUS (as any memory-mapped reader, numpy's
    and the ``safetensors`` package's included). ``copy=True`` reads every tensor at once and keeps no
    map, for files that may change (a tensor the file no longer holds is refused). Validation is
    :func:`read_header`'s.
    """
    n, _, infos = read_header(path)
    data_start = 8 + n
    end = data_start + max((t.end for t in infos.values()), default=0)
    with open(path, "rb") as f:
        mm = None if copy else mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if mm is not None and mm.size() < end:
            raise SafetensorsFormatError(f"{path}: file shrank while it was being opened")
        out = {}
        for name, t in infos.items():
            dtype = TORCH_DTYPES[t.dtype]
            if t.nbytes == 0:  # frombuffer refuses a zero-length view; an empty tensor has no bytes to share
                out[name] = torch.empty(t.shape, dtype=dtype)
                continue
            if copy:
                buf = bytearray(t.nbytes)
                f.seek(data_start + t.start)
                if f.readinto(buf) != t.nbytes:
                    raise SafetensorsFormatError(f"{path}: tensor {name!r}: the file shrank while it was being read")
                raw = torch.frombuffer(buf, dtype=torch.uint8)
            else:
                raw = torch.frombuffer(mm, dtype=torch.uint8, count=t.nbytes, offset=data_start + t.start)
            out[name] = raw.view(dtype).reshape(t.shape)
    return out


def read_index(directory: str | Path) -> tuple[dict, dict[str, Path]]:
    """Read ``model.safetensors.index.json`` of a sharded checkpoint.

    Returns ``(metadata, weight_map)`` with ``weight_map: tensor name -> shard path``. Every shard
    must be a relative path inside ``directory`` (not absolute, no ``..``) naming a file that
    exists. The check is on the name as written, so symbolic links are followed: the Hugging Face
    cache keeps each file of a snapshot as a link into its ``blobs/`` folder.
    """
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    try:
        raw = json.loads(index.read_text(encoding="utf-8"), object_pairs_hook=_reject_duplicates)
    except OSError as e:
        raise SafetensorsFormatError(f"{index}: cannot read: {e}") from None
    except (SafetensorsFormatError, ValueError, RecursionError) as e:  # incl. JSON and utf-8 errors
        raise SafetensorsFormatError(f"{index}: not valid JSON: {e}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("weight_map"), dict):
        raise SafetensorsFormatError(f"{index}: need a JSON object with a 'weight_map' object")
    metadata = raw.get("metadata", {})
    if not isinstance(metadata, dict):
        raise SafetensorsFormatError(f"{index}: 'metadata' must be an object, got {type(metadata).__name__}")
    weight_map = {}
    for name, shard in raw["weight_map"].items():
        if not isinstance(shard, str) or not shard or "\0" in shard:
            raise SafetensorsFormatError(f"{index}: tensor {name!r} points to {shard!r}, which is not a file name")
        path = directory / shard
        if Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise SafetensorsFormatError(
                f"{index}: tensor {name!r} points to shard {shard!r}, outside the checkpoint directory")
        if not path.is_file():
            raise SafetensorsFormatError(f"{index}: tensor {name!r} is in shard {shard!r}, which does not exist")
        weight_map[name] = path
    return metadata, weight_map
