"""The hand-written safetensors parser (chapter 01) against the ``safetensors`` package, and bad files.

* Files written by ``safetensors.torch.save_file`` (every dtype torch has, 0-d, empty, many tensors)
  and the embedded tiny model: same names, dtypes, shapes, metadata and bytes as the package reads.
* Every kind of bad file raises :class:`SafetensorsFormatError` naming the problem.
* Fuzzing (hypothesis): random bytes, mutations of a valid file, random headers — nothing raises
  anything else, and whatever the hand parser accepts the package reads identically.
* Zero copy: the tensors point into the file's memory map.
"""
import ctypes
import json
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsv2_lib.core.config import TINY
from dsv2_lib.core.safetensors_io import (
    DTYPE_SIZES,
    TORCH_DTYPES,
    SafetensorsFormatError,
    TensorInfo,
    load_tensors,
    read_header,
    read_index,
)
from dsv2_lib.tools.random_checkpoint import write_random_checkpoint

TINY_FILE = Path(__import__("dsv2_lib").__file__).parent / "assets" / "tiny" / "model.safetensors"
ALL_TORCH_DTYPES = list(TORCH_DTYPES.values())


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same_as_package(path: Path) -> None:
    """The hand parser reads ``path`` exactly as the safetensors package does."""
    _, metadata, infos = read_header(path)
    ours = load_tensors(path)
    theirs = load_file(path)
    with safe_open(str(path), framework="pt") as f:
        assert (f.metadata() or {}) == metadata
        assert set(f.keys()) == set(infos)
        for name in f.keys():
            sl = f.get_slice(name)
            assert sl.get_dtype() == infos[name].dtype, name
            assert tuple(sl.get_shape()) == infos[name].shape, name
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and ours[name].shape == t.shape, name
        assert as_bytes(ours[name]) == as_bytes(t), name


def write_raw(path: Path, header, data: bytes = b"", header_len: int | None = None) -> Path:
    """A file from a header (dict, str or bytes) and data bytes, built by hand."""
    raw = header if isinstance(header, bytes) else (header if isinstance(header, str) else json.dumps(header)).encode()
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


# ---- agreement with the package ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_TORCH_DTYPES, ids=str)
def test_every_dtype_matches_package(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (3 * 5 * 8,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        base = raw[:15] % 2 == 1
    else:
        base = raw[: 15 * dtype.itemsize].view(dtype)
    tensors = {"matrix": base.reshape(3, 5), "scalar": base[0].clone().reshape(()),
               "empty": base[:0].reshape(0, 4), "vector": base[:7].clone()}
    save_file(tensors, tmp_path / "x.safetensors", metadata={"k": "v"})
    assert_same_as_package(tmp_path / "x.safetensors")
    n, meta, infos = read_header(tmp_path / "x.safetensors")
    assert meta == {"k": "v"} and infos["scalar"].shape == () and infos["empty"].nbytes == 0


def test_many_tensors_and_no_metadata(tmp_path):
    torch.manual_seed(0)
    tensors = {f"layer.{i}.w": torch.randn(i % 5, 3).to([torch.float32, torch.bfloat16, torch.int64][i % 3])
               for i in range(300)}
    save_file(tensors, tmp_path / "many.safetensors")
    assert_same_as_package(tmp_path / "many.safetensors")
    assert read_header(tmp_path / "many.safetensors")[1] == {}


def test_tiny_model_matches_package_bit_for_bit():
    assert_same_as_package(TINY_FILE)
    n, metadata, infos = read_header(TINY_FILE)
    assert metadata == {"format": "pt"}
    assert TINY_FILE.stat().st_size == 8 + n + max(t.end for t in infos.values())


def test_sharded_checkpoint_index(tmp_path):
    d = write_random_checkpoint(TINY, tmp_path / "ck", seed=1, shard_bytes=1 << 20)
    metadata, weight_map = read_index(d)
    shards = sorted(set(weight_map.values()))
    assert len(shards) >= 2
    total = 0
    for shard in shards:
        assert_same_as_package(shard)
        _, _, infos = read_header(shard)
        assert {n for n, s in weight_map.items() if s == shard} == set(infos)
        total += sum(t.nbytes for t in infos.values())
    assert metadata["total_size"] == total


# ---- zero copy --------------------------------------------------------------------------------


def test_tensors_are_views_of_one_memory_map():
    n, _, infos = read_header(TINY_FILE)
    tensors = load_tensors(TINY_FILE)
    names = [k for k in infos if infos[k].nbytes]
    # find the map from the first tensor: its data pointer minus its file offset is the map's base
    base = tensors[names[0]].data_ptr() - (8 + n + infos[names[0]].start)
    for name in names:
        assert tensors[name].data_ptr() == base + 8 + n + infos[name].start, name
    # that base is the start of a mapping of the file: the 8 bytes there are the header length
    assert ctypes.string_at(base, 8) == struct.pack("<Q", n)


def test_writes_stay_private_copy_on_write(tmp_path):
    path = tmp_path / "a.safetensors"
    save_file({"x": torch.arange(6, dtype=torch.float32)}, path)
    before = path.read_bytes()
    t = load_tensors(path)["x"]
    t[0] = 42.0
    assert path.read_bytes() == before
    assert load_tensors(path)["x"][0].item() == 0.0


# ---- bad files: each problem named ------------------------------------------------------------

GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


def bad_cases():
    """(label, header, data, header_len override, expected message fragment)."""
    d8 = bytes(8)
    yield "short file", None, b"", None, "too short"
    yield "absurd length", b"{}", b"", 1 << 40, "absurd"
    yield "length past end", b"{}", b"", 100, "past the end"
    yield "not utf-8", b"{\"\xff\": 1}", b"", None, "utf-8"
    yield "not JSON", "{not json", b"", None, "not valid JSON"
    yield "not an object", "[1, 2]", b"", None, "must be a JSON object"
    yield "duplicate key", '{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, ' \
                           '"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', d8, None, "duplicate key 'a'"
    yield "metadata not str", {"__metadata__": {"k": 1}, **GOOD}, d8, None, "__metadata__"
    yield "entry not object", {"a": [1]}, b"", None, "entry must be an object"
    yield "missing dtype", {"a": {"shape": [2], "data_offsets": [0, 8]}}, d8, None, "missing field(s) dtype"
    yield "unknown field", {"a": {**GOOD["a"], "x": 1}}, d8, None, "unknown field"
    yield "unknown dtype", {"a": {**GOOD["a"], "dtype": "F128"}}, d8, None, "unknown dtype 'F128'"
    yield "dtype not str", {"a": {**GOOD["a"], "dtype": 4}}, d8, None, "unknown dtype 4"
    yield "shape not list", {"a": {**GOOD["a"], "shape": 2}}, d8, None, "shape must be a list"
    yield "float dim", {"a": {**GOOD["a"], "shape": [2.0]}}, d8, None, "shape must be a list"
    yield "bool dim", {"a": {**GOOD["a"], "shape": [True]}}, d8, None, "shape must be a list"
    yield "negative dim", {"a": {**GOOD["a"], "shape": [-2]}}, d8, None, "negative dimension"
    yield "huge empty", {"a": {"dtype": "F32", "shape": [0, 1 << 40, 1 << 40], "data_offsets": [0, 0]}}, b"", None, "too large"
    yield "offsets reversed", {"a": {**GOOD["a"], "data_offsets": [8, 0]}}, d8, None, "data_offsets must be"
    yield "offsets three", {"a": {**GOOD["a"], "data_offsets": [0, 4, 8]}}, d8, None, "data_offsets must be"
    yield "offsets negative", {"a": {**GOOD["a"], "data_offsets": [-8, 0]}}, d8, None, "data_offsets must be"
    yield "end past data", GOOD, bytes(4), None, "past the 4-byte data section"
    yield "wrong size", {"a": {**GOOD["a"], "shape": [3]}}, d8, None, "which needs 12"
    yield "overlap", {"a": GOOD["a"], "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, d8, None, "overlaps"
    yield "gap", {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, d8, None, "belong to no tensor"
    yield "trailing bytes", GOOD, bytes(12), None, "at the end of the data section"


@pytest.mark.parametrize("label, header, data, header_len, fragment", list(bad_cases()), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_files_are_named(tmp_path, label, header, data, header_len, fragment):
    path = tmp_path / "bad.safetensors"
    if header is None:
        path.write_bytes(b"\x01\x02\x03")
    else:
        write_raw(path, header, data, header_len)
    with pytest.raises(SafetensorsFormatError) as e:
        read_header(path)
    assert fragment in str(e.value) and str(path) in str(e.value), str(e.value)
    with pytest.raises(SafetensorsFormatError):
        load_tensors(path)


def test_good_case_of_the_bad_cases_is_good(tmp_path):
    path = write_raw(tmp_path / "good.safetensors", GOOD, struct.pack("<2f", 1.5, -2.0))
    assert load_tensors(path)["a"].tolist() == [1.5, -2.0]
    assert read_header(path)[2] == {"a": TensorInfo("F32", (2,), 0, 8)}


def test_missing_file():
    with pytest.raises(SafetensorsFormatError, match="cannot read"):
        read_header("/nonexistent/x.safetensors")


def test_bad_index(tmp_path):
    d = write_random_checkpoint(TINY, tmp_path / "ck", seed=1, shard_bytes=1 << 20)
    index = d / "model.safetensors.index.json"
    good = json.loads(index.read_text())
    cases = [
        ("{", "not valid JSON"),
        ("[]", "'weight_map'"),
        (json.dumps({"weight_map": {"x": "../../etc/passwd"}}), "outside the checkpoint directory"),
        (json.dumps({"weight_map": {"x": "/etc/passwd"}}), "outside the checkpoint directory"),
        (json.dumps({"weight_map": {"x": 3}}), "not a file name"),
        (json.dumps({"weight_map": {"x": "nope.safetensors"}}), "does not exist"),
        (json.dumps({**good, "metadata": 3}), "'metadata' must be an object"),
        ('{"weight_map": {}, "weight_map": {}}', "duplicate key"),
    ]
    for text, fragment in cases:
        index.write_text(text)
        with pytest.raises(SafetensorsFormatError, match=fragment):
            read_index(d)
    index.unlink()
    with pytest.raises(SafetensorsFormatError, match="cannot read"):
        read_index(d)


# ---- fuzzing ----------------------------------------------------------------------------------

_FUZZ_DIR = Path(tempfile.mkdtemp(prefix="safetensors_fuzz_"))
_FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _small_valid_file() -> bytes:
    p = _FUZZ_DIR / "valid.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16),
               "c": torch.zeros(0, dtype=torch.int64)}, p, metadata={"format": "pt"})
    return p.read_bytes()


VALID = _small_valid_file()


def check_file(content: bytes) -> None:
    """Parse ``content``; only SafetensorsFormatError may come out, and an accepted file must read
    as the package reads it."""
    path = _FUZZ_DIR / "fuzz.safetensors"
    path.write_bytes(content)
    try:
        read_header(path)
    except SafetensorsFormatError:
        with pytest.raises(SafetensorsFormatError):
            load_tensors(path)
        return
    assert_same_as_package(path)


@_FUZZ
@given(st.binary(max_size=256))
def test_fuzz_random_bytes(content):
    check_file(content)


@_FUZZ
@given(st.binary(max_size=200), st.integers(0, (1 << 64) - 1))
def test_fuzz_random_bytes_after_a_plausible_length(body, n):
    check_file(struct.pack("<Q", n % 300) + body)


@_FUZZ
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=6),
       st.integers(0, len(VALID)), st.binary(max_size=8))
def test_fuzz_mutations_of_a_valid_file(edits, cut, tail):
    content = bytearray(VALID)
    for pos, value in edits:
        content[pos] = value
    check_file(bytes(content[:cut]) + tail)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 65), 1 << 65) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
entries = st.fixed_dictionaries(
    {"dtype": st.sampled_from(list(DTYPE_SIZES) + ["F128", "C64", 3]),
     "shape": st.lists(st.integers(-1, 4), max_size=3),
     "data_offsets": st.lists(st.integers(-1, 40), min_size=2, max_size=2).map(sorted)},
    optional={"extra": json_values},
)


@_FUZZ
@given(st.dictionaries(st.text(max_size=4), entries | json_values, max_size=4),
       st.one_of(st.none(), st.dictionaries(st.text(max_size=4), st.text(max_size=4) | st.integers(), max_size=2)),
       st.integers(0, 48))
def test_fuzz_random_headers(header, metadata, data_len):
    if metadata is not None:
        header = {"__metadata__": metadata, **header}
    raw = json.dumps(header).encode()
    check_file(struct.pack("<Q", len(raw)) + raw + bytes(range(data_len)))


@_FUZZ
@given(st.lists(st.tuples(st.sampled_from(list(DTYPE_SIZES)), st.lists(st.integers(0, 3), max_size=3)),
                min_size=1, max_size=5), st.booleans())
def test_fuzz_well_formed_headers_are_accepted(specs, shuffle):
    """Headers laid out correctly (tensors back to back) must be accepted and read as the package does."""
    header, pos = {}, 0
    for i, (dtype, shape) in enumerate(specs):
        nbytes = DTYPE_SIZES[dtype] * int(torch.tensor(shape).prod()) if shape else DTYPE_SIZES[dtype]
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    items = list(header.items())
    if shuffle:
        items.reverse()
    raw = json.dumps(dict(items)).encode()
    path = _FUZZ_DIR / "ok.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(i % 251 for i in range(pos)))
    n, _, infos = read_header(path)
    assert list(infos) == [k for k, _ in items]
    assert_same_as_package(path)


def test_copied_tensors_outlive_a_truncated_file_and_views_share_the_map(tmp_path):
    """``copy=True``: every tensor is read into memory of its own, so truncating (or rewriting) the file
    afterwards changes nothing; the zero-copy views (the default) share one map of the file instead, the
    contract under which a truncated file is the reader's SIGBUS (the docstring). A file that shrank
    between the header check and the read is refused by name."""
    path = tmp_path / "a.safetensors"
    want = {"x": torch.arange(6, dtype=torch.float32), "y": torch.ones(3, 2, dtype=torch.bfloat16)}
    save_file(want, path)
    copied = load_tensors(path, copy=True)
    views = load_tensors(path)
    buffers = {t.untyped_storage().data_ptr() for t in copied.values()}
    assert len(buffers) == 2 and not buffers & {t.untyped_storage().data_ptr() for t in views.values()}
    del views
    with open(path, "r+b") as f:
        f.truncate(16)
    for name, t in want.items():
        assert torch.equal(copied[name], t), name
    copied["x"][0] = 5.0  # its own memory: writable
    assert copied["x"][0] == 5.0


def test_a_file_that_shrinks_under_a_copying_read_is_refused(tmp_path, monkeypatch):
    import dsv2_lib.core.safetensors_io as io

    path = tmp_path / "a.safetensors"
    save_file({"x": torch.arange(6, dtype=torch.float32)}, path)
    header = io.read_header(path)

    def read_then_truncate(p):
        with open(p, "r+b") as f:
            f.truncate(8 + header[0] + 4)  # keeps one of x's six floats
        return header

    monkeypatch.setattr(io, "read_header", read_then_truncate)
    with pytest.raises(SafetensorsFormatError, match="tensor 'x': the file shrank while it was being read") as e:
        load_tensors(path, copy=True)
    assert str(path) in str(e.value)
