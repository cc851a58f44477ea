"""Checkpoint loading: single-file and sharded, dtype conversion, per-expert keys, and bad input.

Every bad checkpoint must raise CheckpointError naming the file (and the tensor where there is one);
nothing a file on disk contains may crash the loader with another exception.
"""
import dataclasses
import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsv2_lib import LLM
from dsv2_lib.core.checkpoint import CheckpointError, checkpoint_files, load_checkpoint
from dsv2_lib.core.config import TINY
from dsv2_lib.core.dtypes import default_dtype
from dsv2_lib.model.deepseek_v2 import DeepseekV2
from dsv2_lib.tools.random_checkpoint import hub_tensor_shapes, write_random_checkpoint

# V2-Lite's structure (dense layer 0, MoE layer 1 with 4 routed + 1 shared experts), very small.
SMALL = dataclasses.replace(
    TINY, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
    n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=64,
    rope=dataclasses.replace(TINY.rope, original_max_position_embeddings=16),
)
EXPERT_KEY = "model.layers.1.mlp.experts.3.up_proj.weight"
GATE_KEY = "model.layers.1.mlp.gate.weight"


def new_model(dtype=torch.float32, cfg=SMALL) -> DeepseekV2:
    with default_dtype(dtype):
        return DeepseekV2(cfg)


def loaded(directory, dtype=torch.float32, cfg=SMALL) -> DeepseekV2:
    model = new_model(dtype, cfg)
    load_checkpoint(model, directory)
    return model


def re_path(path) -> str:
    return re.escape(str(path))


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A single-file bf16 checkpoint of SMALL."""
    return write_random_checkpoint(SMALL, tmp_path / "ckpt", seed=3)


def rewrite(path: Path, change) -> None:
    """Load a safetensors file, let ``change(dict)`` edit it, save it back."""
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


# ---- loading what is right ---------------------------------------------------------------------


def test_single_file_and_sharded_load_identical(tmp_path):
    single = write_random_checkpoint(SMALL, tmp_path / "single", seed=7)
    sharded = write_random_checkpoint(SMALL, tmp_path / "sharded", seed=7, shard_bytes=8 << 10)
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 2 and not (sharded / "model.safetensors").exists()
    assert (sharded / "model.safetensors.index.json").is_file()
    # the index maps names to several distinct files
    assert len(set(checkpoint_files(sharded).values())) == len(shards)
    a, b = loaded(single).state_dict(), loaded(sharded).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # and a different seed gives different weights (the comparison above is not vacuous)
    c = loaded(write_random_checkpoint(SMALL, tmp_path / "other", seed=8)).state_dict()
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_sharded_without_index_also_loads(tmp_path):
    """Several *.safetensors files and no index: every file is read."""
    d = write_random_checkpoint(SMALL, tmp_path / "s", seed=7, shard_bytes=8 << 10)
    (d / "model.safetensors.index.json").unlink()
    ref = loaded(write_random_checkpoint(SMALL, tmp_path / "one", seed=7)).state_dict()
    for name, t in loaded(d).state_dict().items():
        assert torch.equal(t, ref[name]), name


@pytest.mark.parametrize("disk", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("want", [torch.bfloat16, torch.float16, torch.float32])
def test_disk_dtypes_convert_to_the_requested_dtype(tmp_path, disk, want):
    d = write_random_checkpoint(SMALL, tmp_path / "c", seed=1, dtype=disk)
    on_disk = load_file(d / "model.safetensors")
    assert on_disk[EXPERT_KEY].dtype == disk
    params = dict(loaded(d, want).named_parameters())
    for name, p in params.items():
        expected_dtype = torch.float32 if name.endswith("mlp.gate.weight") else want
        assert p.dtype == expected_dtype, name
    assert torch.equal(params["model.embed_tokens.weight"], on_disk["model.embed_tokens.weight"].to(want))
    assert torch.equal(params["model.layers.0.self_attn.kv_b_proj.weight"],
                       on_disk["model.layers.0.self_attn.kv_b_proj.weight"].to(want))
    assert torch.equal(params["model.norm.weight"], on_disk["model.norm.weight"].to(want))


def test_router_gate_stays_fp32_in_a_bf16_model(tmp_path):
    d = write_random_checkpoint(SMALL, tmp_path / "c", seed=1, dtype=torch.float32)
    model = loaded(d, torch.bfloat16)
    gate = model.model.layers[1].mlp.gate.weight
    assert gate.dtype == torch.float32
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    # the fp32 gate on disk is kept exactly, not rounded through bf16
    on_disk = load_file(d / "model.safetensors")[GATE_KEY]
    assert torch.equal(gate, on_disk)
    assert not torch.equal(gate, on_disk.bfloat16().float())


def test_per_expert_keys_are_stacked_in_order(ckpt):
    on_disk = load_file(ckpt / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in on_disk.items()} == hub_tensor_shapes(SMALL)  # Hub layout: one key per expert
    experts = loaded(ckpt).model.layers[1].mlp.experts
    i = SMALL.moe_intermediate_size
    assert experts.gate_up_proj.shape == (SMALL.n_routed_experts, 2 * i, SMALL.hidden_size)
    assert experts.down_proj.shape == (SMALL.n_routed_experts, SMALL.hidden_size, i)
    pieces = {"gate_proj": lambda e: experts.gate_up_proj[e, :i], "up_proj": lambda e: experts.gate_up_proj[e, i:],
              "down_proj": lambda e: experts.down_proj[e]}  # gate rows, then up rows, of each expert
    for proj, piece in pieces.items():
        for e in range(SMALL.n_routed_experts):
            assert torch.equal(piece(e), on_disk[f"model.layers.1.mlp.experts.{e}.{proj}.weight"].float()), (proj, e)
    # distinct experts really are distinct (a loader that wrote expert 0 everywhere would fail above)
    assert not torch.equal(experts.gate_up_proj[0, i:], experts.gate_up_proj[3, i:])


@pytest.mark.parametrize("prefix", ["model.layers.0.mlp", "model.layers.1.mlp.shared_experts"])
def test_gate_and_up_fill_the_two_halves_of_gate_up_proj(ckpt, prefix):
    """The dense MLP and the shared experts: ``gate_proj`` fills rows 0..I-1, ``up_proj`` rows I..2I-1."""
    on_disk = load_file(ckpt / "model.safetensors")
    params = dict(loaded(ckpt).named_parameters())
    gate, up = on_disk[f"{prefix}.gate_proj.weight"].float(), on_disk[f"{prefix}.up_proj.weight"].float()
    assert f"{prefix}.gate_proj.weight" not in params and f"{prefix}.up_proj.weight" not in params
    assert torch.equal(params[f"{prefix}.gate_up_proj.weight"], torch.cat([gate, up]))
    assert not torch.equal(gate, up)


def test_llm_loads_a_random_checkpoint(ckpt):
    llm = LLM(ckpt, device="cpu")
    assert llm.config == SMALL
    assert llm.tokenizer is None
    on_disk = load_file(ckpt / "model.safetensors")
    assert torch.equal(llm.model.lm_head.weight, on_disk["lm_head.weight"].float())


def test_tied_embeddings_ignore_a_saved_lm_head(tmp_path):
    cfg = dataclasses.replace(SMALL, tie_word_embeddings=True)
    d = write_random_checkpoint(cfg, tmp_path / "t", seed=2)
    assert "lm_head.weight" not in load_file(d / "model.safetensors")
    model = loaded(d, cfg=cfg)
    assert model.lm_head_weight is model.model.embed_tokens.weight
    # some exports save the tied head anyway: it must not count as unexpected
    rewrite(d / "model.safetensors", lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    loaded(d, cfg=cfg)


def test_rotary_inv_freq_buffers_are_ignored(ckpt):
    rewrite(ckpt / "model.safetensors",
            lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}))
    loaded(ckpt)


# ---- bad directories ----------------------------------------------------------------------------


def test_not_a_directory(tmp_path, ckpt):
    for path in (tmp_path / "nope", ckpt / "model.safetensors"):
        with pytest.raises(CheckpointError, match=re_path(path) + ": not a directory"):
            load_checkpoint(new_model(), path)


def test_directory_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=re_path(tmp_path) + ": no model.safetensors.*index"):
        load_checkpoint(new_model(), tmp_path)


def test_pickle_checkpoint_is_refused(tmp_path):
    torch.save({"model.norm.weight": torch.ones(32)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=re_path(tmp_path) + ".*pytorch_model.bin.*arbitrary code.*safetensors.*save_pretrained"):
        load_checkpoint(new_model(), tmp_path)


def test_llm_on_a_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMALL.to_hf_dict()))
    with pytest.raises(CheckpointError, match=re_path(tmp_path) + ": no model.safetensors"):
        LLM(tmp_path, device="cpu")


# ---- bad tensors --------------------------------------------------------------------------------


def test_missing_expert_tensor(ckpt):
    rewrite(ckpt / "model.safetensors", lambda t: t.pop(EXPERT_KEY))
    with pytest.raises(CheckpointError, match=re_path(ckpt) + ": 1 tensor.* missing.*'" + EXPERT_KEY.replace(".", r"\.")):
        load_checkpoint(new_model(), ckpt)


@pytest.mark.parametrize("name", ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                                  "model.layers.1.mlp.shared_experts.gate_proj.weight",
                                  "model.layers.1.mlp.experts.2.gate_proj.weight",
                                  "model.layers.1.mlp.experts.0.down_proj.weight"])
def test_missing_half_of_a_fused_parameter_names_the_checkpoint_key(ckpt, name):
    """gate and up fill one engine parameter: a missing half is reported by its own checkpoint name."""
    rewrite(ckpt / "model.safetensors", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=re_path(ckpt) + r": 1 tensor\(s\) missing, e\.g\. '" + name.replace(".", r"\.") + "'$"):
        load_checkpoint(new_model(), ckpt)


def test_missing_plain_tensor(ckpt):
    rewrite(ckpt / "model.safetensors", lambda t: t.pop("model.layers.0.self_attn.kv_a_layernorm.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*'model\.layers\.0\.self_attn\.kv_a_layernorm\.weight'"):
        load_checkpoint(new_model(), ckpt)


def test_missing_lm_head_when_untied(ckpt):
    rewrite(ckpt / "model.safetensors", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*'lm_head\.weight'"):
        load_checkpoint(new_model(), ckpt)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.2.self_attn.o_proj.weight",  # a layer the model does not have
        "model.layers.0.mlp.experts.0.up_proj.weight",  # layer 0 is dense
        "model.layers.1.self_attn.q_a_proj.weight",  # q_lora_rank is None
        "model.embed_tokens.bias",
    ],
)
def test_unexpected_tensor(ckpt, name):
    rewrite(ckpt / "model.safetensors", lambda t: t.update({name: torch.zeros(2, 2)}))
    with pytest.raises(CheckpointError, match=re_path(ckpt) + ".*1 tensor.*does not have.*'" + name.replace(".", r"\.") + "' in model.safetensors"):
        load_checkpoint(new_model(), ckpt)


def test_expert_index_out_of_range(ckpt):
    name = "model.layers.1.mlp.experts.4.up_proj.weight"  # the model has experts 0..3
    rewrite(ckpt / "model.safetensors", lambda t: t.update({name: t[EXPERT_KEY].clone()}))
    with pytest.raises(CheckpointError, match=re_path(ckpt / "model.safetensors") + ".*'" + name.replace(".", r"\.") + "'.*expert 4.*4 experts"):
        load_checkpoint(new_model(), ckpt)


@pytest.mark.parametrize(
    "name, shape, expected",
    [
        (EXPERT_KEY, (16, 31), "[16, 32]"),
        ("model.layers.0.self_attn.kv_b_proj.weight", (16, 32), "[32, 16]"),  # transposed
        ("model.norm.weight", (1, 32), "[32]"),
        ("model.layers.0.mlp.up_proj.weight", (96, 32), "[48, 32]"),  # the fused [2I, H], not one half
        ("model.layers.1.mlp.shared_experts.gate_proj.weight", (16, 31), "[16, 32]"),
    ],
)
def test_misshaped_tensor(ckpt, name, shape, expected):
    rewrite(ckpt / "model.safetensors", lambda t: t.update({name: torch.zeros(shape, dtype=torch.bfloat16)}))
    got = str(list(shape))
    with pytest.raises(CheckpointError, match=re_path(ckpt / "model.safetensors") + ": tensor '" + name.replace(".", r"\.")
                       + "' has shape " + got.replace("[", r"\[") + ", expected " + expected.replace("[", r"\[")):
        load_checkpoint(new_model(), ckpt)


@pytest.mark.parametrize("dtype, tag", [(torch.int8, "I8"), (torch.float64, "F64"), (torch.int64, "I64"),
                                        (torch.float8_e4m3fn, "F8_E4M3")])
def test_unsupported_dtype_on_disk(ckpt, dtype, tag):
    name = "model.layers.0.self_attn.o_proj.weight"
    rewrite(ckpt / "model.safetensors", lambda t: t.update({name: t[name].float().to(dtype)}))
    with pytest.raises(CheckpointError, match=re_path(ckpt / "model.safetensors") + ": tensor '" + name.replace(".", r"\.")
                       + f"' has dtype {tag}; supported: BF16, F16, F32"):
        load_checkpoint(new_model(), ckpt)


def test_tensor_given_twice_across_shards(tmp_path):
    d = write_random_checkpoint(SMALL, tmp_path / "s", seed=7, shard_bytes=8 << 10)
    (d / "model.safetensors.index.json").unlink()
    first, second = sorted(d.glob("*.safetensors"))[:2]
    name = next(iter(load_file(first)))
    rewrite(second, lambda t: t.update({name: load_file(first)[name]}))
    with pytest.raises(CheckpointError, match=re_path(second) + ": tensor '" + name.replace(".", r"\.") + "' also appears in " + re_path(first)):
        load_checkpoint(new_model(), d)


def test_expert_given_twice_as_two_hub_keys(ckpt):
    """A zero-padded expert index names the same expert as another key: caught, not silently overwritten."""
    alias = "model.layers.1.mlp.experts.03.up_proj.weight"
    rewrite(ckpt / "model.safetensors", lambda t: t.update({alias: t[EXPERT_KEY].clone()}))
    with pytest.raises(CheckpointError, match=r"experts\.0?3\.up_proj\.weight' given twice"):
        load_checkpoint(new_model(), ckpt)


# ---- bad index files ----------------------------------------------------------------------------


@pytest.fixture
def sharded(tmp_path) -> Path:
    return write_random_checkpoint(SMALL, tmp_path / "s", seed=7, shard_bytes=8 << 10)


def edit_index(directory: Path, change) -> Path:
    index = directory / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    change(doc["weight_map"])
    index.write_text(json.dumps(doc))
    return index


@pytest.mark.parametrize("shard", ["../x.safetensors", "ABS", "sub/../../x.safetensors"])
def test_index_naming_a_shard_outside_the_directory(sharded, shard):
    outside = sharded.parent / "x.safetensors"  # exists, and is a valid safetensors file
    outside.write_bytes(sorted(sharded.glob("*.safetensors"))[0].read_bytes())
    shard = str(outside) if shard == "ABS" else shard
    index = edit_index(sharded, lambda m: m.update({"model.norm.weight": shard}))
    with pytest.raises(CheckpointError, match=re_path(index) + r": tensor 'model\.norm\.weight' points to shard .*outside the checkpoint directory"):
        load_checkpoint(new_model(), sharded)


def test_index_naming_a_symlinked_shard_loads_it(sharded):
    """Containment is checked on the names the index writes, not on link targets: a shard that is a
    link to a file elsewhere (as in the Hugging Face cache, links into ``../../blobs``) loads."""
    first = sorted(sharded.glob("model-*.safetensors"))[0]
    blob = sharded.parent / "blobs" / "0123abcd"
    blob.parent.mkdir()
    first.rename(blob)
    os.symlink(os.path.relpath(blob, sharded), first)
    model = loaded(sharded)
    assert torch.equal(model.model.embed_tokens.weight, load_file(blob)["model.embed_tokens.weight"].float())


def test_index_naming_a_missing_shard(sharded):
    index = edit_index(sharded, lambda m: m.update({"model.norm.weight": "model-00099-of-00099.safetensors"}))
    with pytest.raises(CheckpointError, match=re_path(index) + r": tensor 'model\.norm\.weight' is in shard 'model-00099-of-00099\.safetensors', which does not exist"):
        load_checkpoint(new_model(), sharded)


def test_index_missing_an_entry(sharded):
    """A shard holding a tensor its index does not list: refused, naming the shard and the tensor
    (loading it anyway would trust one of two disagreeing descriptions of the checkpoint)."""
    edit_index(sharded, lambda m: m.pop(EXPERT_KEY))
    with pytest.raises(CheckpointError, match=re_path(sharded) + ".*does not list.*" + EXPERT_KEY.replace(".", r"\.")):
        load_checkpoint(new_model(), sharded)


def test_index_listing_a_tensor_its_shard_lacks(sharded):
    shard = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"][EXPERT_KEY]
    other = next(s for s in sorted(p.name for p in sharded.glob("*.safetensors")) if s != shard)
    edit_index(sharded, lambda m: m.__setitem__(EXPERT_KEY, other))
    with pytest.raises(CheckpointError, match=re.escape(other) + ".*does not hold.*" + EXPERT_KEY.replace(".", r"\.")):
        load_checkpoint(new_model(), sharded)


def test_duplicate_tensor_name_in_a_file_is_refused(tmp_path):
    """The safetensors package keeps the last of two entries with one name (even of another dtype);
    the format forbids it, and the loader refuses it as chapter 01's parser does."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    header = ('{"model.norm.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
              '"model.norm.weight": {"dtype": "F16", "shape": [1], "data_offsets": [4, 6]}}').encode()
    (ckpt / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(6))
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt / "model.safetensors")) + ".*duplicate.*model.norm.weight"):
        load_checkpoint(new_model(), ckpt)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.mkfifo(ckpt / "model.safetensors")  # opening it for reading would wait for a writer forever
    with pytest.raises(CheckpointError, match="model.safetensors: not a regular file"):
        load_checkpoint(new_model(), ckpt)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_unless_asked(ckpt, bad):
    rewrite(ckpt / "model.safetensors", lambda t: t["model.layers.0.input_layernorm.weight"].__setitem__(3, bad))
    with pytest.raises(CheckpointError, match=re_path(ckpt) + ".*NaN or infinite.*model.layers.0.input_layernorm.weight"):
        load_checkpoint(new_model(), ckpt)
    model = new_model()
    load_checkpoint(model, ckpt, check_finite=False)
    assert not model.model.layers[0].input_layernorm.weight.isfinite().all()


@pytest.mark.parametrize("text", ["{not json", "[]", '{"metadata": {}}', '{"weight_map": [1, 2]}', '{"weight_map": {"a": 5}}',
                                  '{"weight_map": {"a": "x\\u0000y"}}'])
def test_malformed_index(sharded, text):
    index = sharded / "model.safetensors.index.json"
    index.write_text(text)
    with pytest.raises(CheckpointError, match=re_path(index)):
        load_checkpoint(new_model(), sharded)


def test_binary_index(sharded):
    index = sharded / "model.safetensors.index.json"
    index.write_bytes(b"\xff\xfe\x00garbage\x89")
    with pytest.raises(CheckpointError, match=re_path(index) + ": not valid JSON"):
        load_checkpoint(new_model(), sharded)


# ---- corrupt safetensors files ------------------------------------------------------------------


@pytest.mark.parametrize("cut", [1, 100, 4096, "header", "all-but-7"])
def test_truncated_file(ckpt, cut):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]
    keep = {"header": 8 + header_len // 2, "all-but-7": 7}.get(cut, None)
    f.write_bytes(data[:keep] if keep is not None else data[:-cut])
    with pytest.raises(CheckpointError, match=re_path(f) + ": not a readable safetensors file"):
        load_checkpoint(new_model(), ckpt)


def _with_header(header: bytes, body: bytes = b"\0" * 64, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + body


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x00" * 3,
        bytes(range(256)) * 4,  # garbage bytes
        _with_header(b"this is not json"),
        _with_header(b"\xff\xfe\xfd\xfc"),  # not UTF-8
        _with_header(b"{}", length=10**6),  # header length past the end of the file
        _with_header(b"{}", length=2**63),
        _with_header(b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1000]}}'),  # data past the end
        _with_header(b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [8, 0]}}'),
        _with_header(b'{"a": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}}', b"\0" * 16),
        _with_header(b'{"a": {"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}}', b"\0" * 16),  # shape vs bytes
        _with_header(b'["a", "b"]'),
    ],
    ids=["empty", "3-bytes", "garbage", "header-not-json", "header-not-utf8", "header-length-past-eof",
         "header-length-2^63", "data-past-eof", "offsets-reversed", "unknown-dtype", "shape-vs-bytes", "header-a-list"],
)
def test_corrupt_file(ckpt, content):
    f = ckpt / "model.safetensors"
    f.write_bytes(content)
    with pytest.raises(CheckpointError, match=re_path(f) + ": not a readable safetensors file"):
        load_checkpoint(new_model(), ckpt)


def test_corrupt_shard_is_named(sharded):
    shard = sorted(sharded.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=re_path(shard) + ": not a readable"):
        load_checkpoint(new_model(), sharded)


def test_corrupt_file_through_llm(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-3])
    with pytest.raises(CheckpointError, match=re_path(f)):
        LLM(ckpt, device="cpu")


# ---- fuzzing: whatever bytes are on disk, the loader loads or raises CheckpointError ---------------


@pytest.fixture(scope="module")
def valid_bytes(tmp_path_factory) -> bytes:
    d = write_random_checkpoint(SMALL, tmp_path_factory.mktemp("valid"), seed=11)
    return (d / "model.safetensors").read_bytes()


def _load_bytes(content: bytes) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        Path(d, "model.safetensors").write_bytes(content)
        try:
            load_checkpoint(new_model(), d)
        except CheckpointError as e:
            assert d in str(e)  # every message names the checkpoint or one of its files


FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_MORE = settings(FUZZ, max_examples=150)  # ~1 ms an example


@FUZZ
@given(content=st.binary(max_size=512))
def test_fuzz_random_bytes(content):
    _load_bytes(content)


@FUZZ
@given(content=st.binary(min_size=8, max_size=256).map(lambda b: struct.pack("<Q", len(b) - 8) + b))
def test_fuzz_random_bytes_with_a_plausible_header_length(content):
    _load_bytes(content)


@FUZZ_MORE
@given(data=st.data())
def test_fuzz_mutations_of_a_valid_file(valid_bytes, data):
    content = bytearray(valid_bytes)
    header_end = 8 + struct.unpack("<Q", valid_bytes[:8])[0]
    for _ in range(data.draw(st.integers(1, 4), label="mutations")):
        kind = data.draw(st.sampled_from(["flip-header", "flip-any", "truncate", "insert", "delete", "digit"]))
        if kind == "truncate":
            del content[data.draw(st.integers(0, len(content))):]
        elif not content:
            continue
        elif kind in ("flip-header", "flip-any"):
            hi = min(header_end, len(content)) if kind == "flip-header" else len(content)
            pos = data.draw(st.integers(0, max(hi - 1, 0)))
            content[pos] = data.draw(st.integers(0, 255))
        elif kind == "insert":
            pos = data.draw(st.integers(0, len(content)))
            content[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            pos = data.draw(st.integers(0, len(content) - 1))
            del content[pos : pos + data.draw(st.integers(1, 8))]
        else:  # change one digit of the JSON header: shapes, offsets, expert or layer numbers
            digits = [i for i in range(8, min(header_end, len(content))) if chr(content[i]).isdigit()]
            if digits:
                content[data.draw(st.sampled_from(digits))] = ord(data.draw(st.sampled_from("0123456789")))
    _load_bytes(bytes(content))


def test_fuzz_reference_file_loads(valid_bytes):
    """The unmutated file loads (so the fuzz tests start from something valid)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        Path(d, "model.safetensors").write_bytes(valid_bytes)
        model = new_model()
        load_checkpoint(model, d)
        with safe_open(str(Path(d, "model.safetensors")), "pt") as f:
            assert torch.equal(model.model.norm.weight, f.get_tensor("model.norm.weight").float())


@pytest.mark.parametrize("name, shape", [("model.layers.1.mlp.experts.gate_up_proj", (4, 32, 32)),
                                         ("model.layers.1.mlp.experts.down_proj", (4, 32, 16)),
                                         ("model.layers.0.mlp.gate_up_proj.weight", (96, 32)),
                                         ("model.layers.1.mlp.shared_experts.gate_up_proj.weight", (32, 32))])
def test_engine_fused_or_stacked_name_is_not_a_checkpoint_name(ckpt, name, shape):
    """``...mlp.experts.gate_up_proj`` and ``...mlp.gate_up_proj.weight`` are the engine's fused and
    stacked parameters, not Hub keys, even with the right shape: refused rather than silently
    overwriting (or being overwritten by) the per-expert and per-projection tensors."""
    rewrite(ckpt / "model.safetensors", lambda t: t.update({name: torch.zeros(shape, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=r"does not have.*'" + name.replace(".", r"\.") + r"' in model\.safetensors"):
        load_checkpoint(new_model(), ckpt)
