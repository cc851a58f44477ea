"""The real DeepSeek-V2-Lite-Chat checkpoint's layout, rebuilt small (Appendix B).

The real weights (31.4 GB) cannot be downloaded in CI, so this test rebuilds everything *about*
them that the engine depends on, except their size and values: the Hub's ``config.json`` with
every field (``auto_map``, ``rope_scaling`` of type ``yarn``, ``q_lora_rank: null``, the training
fields the engine ignores), bf16 tensors under the Hub's names, four shards named as the Hub names
them (``model-00001-of-000004.safetensors``: six digits after ``of``), an index with
``metadata.total_size``, the remote-code ``.py`` files, ``generation_config.json``,
``tokenizer_config.json`` with the real ``chat_template``, and a byte-level BPE ``tokenizer.json``
whose two special tokens sit after the ordinary vocabulary, as the real ones do.

Only sizes are shrunk (hidden 2048 -> 64, 64 experts -> 8, 27 layers -> 3, ...); the structure is
kept: one dense layer then MoE layers, MLA without query compression, YaRN with factor 40.
The real files, their sizes and what the engine reads of each are listed in book/real_model.md.
"""
import json
import math
import re
import shutil
from pathlib import Path

import jinja2
import pytest
import tokenizers
import torch
from hub_files import HUB_CONFIG_JSON
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from dsv2_lib import DEEPSEEK_V2_LITE, LLM
from dsv2_lib.core.checkpoint import CheckpointError, checkpoint_files
from dsv2_lib.core.config import config_from_dict, load_config
from dsv2_lib.core.tokenizer import BOS, EOS, apply_chat_template
from dsv2_lib.tools.random_checkpoint import hub_tensor_shapes, write_random_checkpoint

# ---- the real files' content --------------------------------------------------------------------

REAL_CONFIG = json.loads(HUB_CONFIG_JSON)  # deepseek-ai/DeepSeek-V2-Lite(-Chat)/config.json

REAL_GENERATION_CONFIG = {  # generation_config.json (181 bytes on the Hub, as json.dumps(indent=2) + "\n" gives)
    "_from_model_config": True,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "do_sample": True,
    "temperature": 0.3,
    "top_p": 0.95,
    "transformers_version": "4.39.3",
}

REAL_CHAT_TEMPLATE = (  # tokenizer_config.json's "chat_template", verbatim
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ 'User: ' + message['content'] + '\\n\\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}"
    "{{ message['content'] + '\\n\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ 'Assistant:' }}{% endif %}"
)

REMOTE_CODE = ("configuration_deepseek.py", "modeling_deepseek.py", "tokenization_deepseek_fast.py")
N_SHARDS = 4
SHARD_NAMES = [f"model-{i:05d}-of-{N_SHARDS:06d}.safetensors" for i in range(1, N_SHARDS + 1)]

# ---- the small stand-in -----------------------------------------------------------------------

N_REGULAR = 300  # ordinary BPE tokens; the real tokenizer has 100,000, then its special tokens
VOCAB = 320  # embedding rows, padded past the specials as the real 102,400 are past 100,015
SHRINK = dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_attention_heads=4, num_key_value_heads=4,
    num_hidden_layers=3, n_routed_experts=8, vocab_size=VOCAB,
    bos_token_id=N_REGULAR, eos_token_id=N_REGULAR + 1,
)
CORPUS = [
    "User: What is the capital of France?\n\nAssistant: The capital of France is Paris.",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Mixture-of-experts models route each token to a few experts; latent attention caches 576 values.",
]


def small_tokenizer() -> tokenizers.Tokenizer:
    """Byte-level BPE with N_REGULAR tokens, then BOS and EOS appended (ids N_REGULAR, N_REGULAR + 1),
    adding BOS in front of every encoded text as the real tokenizer's post-processor does."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=N_REGULAR, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() == N_REGULAR, "the corpus must yield N_REGULAR merges + bytes"
    tok.add_special_tokens([BOS, EOS])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, N_REGULAR)])
    return tok


def tokenizer_config() -> dict:
    """The real tokenizer_config.json's fields that matter here (ids shrunk with the vocabulary)."""
    special = {"lstrip": False, "normalized": True, "rstrip": False, "single_word": False, "special": True}
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {str(N_REGULAR): {"content": BOS, **special}, str(N_REGULAR + 1): {"content": EOS, **special}},
        "bos_token": BOS,
        "chat_template": REAL_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "legacy": True,
        "model_max_length": 16384,
        "pad_token": EOS,
        "tokenizer_class": "LlamaTokenizerFast",
        "unk_token": None,
    }


def write_real_layout(directory: Path) -> Path:
    """A small checkpoint laid out exactly as the Hub's DeepSeek-V2-Lite-Chat directory."""
    raw = {**REAL_CONFIG, **SHRINK}
    cfg = config_from_dict(raw)
    single = write_random_checkpoint(cfg, directory / "single", seed=11, dtype=torch.bfloat16, std=0.05)
    with safe_open(single / "model.safetensors", framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    order = list(hub_tensor_shapes(cfg))  # embedding, layer 0, layer 1, ..., final norm, lm_head
    assert sorted(order) == sorted(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    weight_map, start, done = {}, 0, 0
    for i, name in enumerate(SHARD_NAMES):  # contiguous runs of tensors, about total/4 bytes each
        end, size = start, 0
        while end < len(order) and (i == N_SHARDS - 1 or done + size < total * (i + 1) / N_SHARDS):
            size += tensors[order[end]].numel() * tensors[order[end]].element_size()
            end += 1
        save_file({n: tensors[n] for n in order[start:end]}, directory / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(order[start:end], name))
        start, done = end, done + size
    assert start == len(order) and len(set(weight_map.values())) == N_SHARDS
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    (directory / "generation_config.json").write_text(
        json.dumps({**REAL_GENERATION_CONFIG, "bos_token_id": N_REGULAR, "eos_token_id": N_REGULAR + 1}, indent=2) + "\n")
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False))
    small_tokenizer().save(str(directory / "tokenizer.json"))
    for name in REMOTE_CODE:  # the engine must never import these; a placeholder that fails loudly if run
        (directory / name).write_text(f'raise RuntimeError("{name} was executed")\n')
    for p in (single / "model.safetensors", single / "config.json"):
        p.unlink()
    single.rmdir()
    return directory


@pytest.fixture(scope="module")
def real_layout(tmp_path_factory) -> Path:
    return write_real_layout(tmp_path_factory.mktemp("DeepSeek-V2-Lite-Chat"))


@pytest.fixture(scope="module")
def ours(real_layout) -> LLM:
    return LLM(real_layout, device="cpu", dtype="float32")


# ---- the config --------------------------------------------------------------------------------


def test_gpu_test_writes_the_real_config_values():
    """tests/test_gpu_full_size.py writes its own Hub-form config.json: every field it writes has the
    real value; it leaves out only fields the engine and transformers' inference ignore."""
    from test_gpu_full_size import hub_config

    written = hub_config(DEEPSEEK_V2_LITE)
    assert {k: v for k, v in written.items() if REAL_CONFIG.get(k, "absent") != v} == {}
    assert set(REAL_CONFIG) - set(written) == {
        "attention_dropout", "auto_map", "aux_loss_alpha", "initializer_range", "pretraining_tp", "seq_aux",
        "transformers_version", "use_cache",
    }


def test_shrunk_real_config_keeps_the_structure(real_layout):
    cfg = load_config(real_layout)
    assert cfg.q_lora_rank is None and cfg.first_k_dense_replace == 1
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)] == [False, True, True]
    assert (cfg.rope.kind, cfg.rope.factor, cfg.rope.original_max_position_embeddings) == ("yarn", 40.0, 4096)
    assert (cfg.rope.mscale, cfg.rope.mscale_all_dim, cfg.rope.theta) == (0.707, 0.707, 10000.0)
    assert (cfg.n_shared_experts, cfg.num_experts_per_tok, cfg.topk_method, cfg.norm_topk_prob) == (2, 6, "greedy", False)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.max_position_embeddings) == (N_REGULAR, (N_REGULAR + 1,), 163840)


# ---- the weights -------------------------------------------------------------------------------


def test_layout_has_the_hub_names_dtypes_and_shards(real_layout):
    files = checkpoint_files(real_layout)
    assert sorted({p.name for p in files.values()}) == SHARD_NAMES
    index = json.loads((real_layout / "model.safetensors.index.json").read_text())
    sizes = 0
    for name in SHARD_NAMES:
        with safe_open(real_layout / name, framework="pt") as f:
            for key in f.keys():
                assert f.get_slice(key).get_dtype() == "BF16"
                sizes += math.prod(f.get_slice(key).get_shape()) * 2
    assert index["metadata"]["total_size"] == sizes
    assert "model.layers.0.mlp.gate_proj.weight" in files  # dense layer 0
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in files  # per-expert keys
    assert "model.layers.2.mlp.shared_experts.up_proj.weight" in files
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in files and "model.layers.1.self_attn.q_proj.weight" in files


def test_llm_loads_the_real_layout_and_ignores_the_remote_code(ours):
    """The .py files would raise if imported; the engine reads config, safetensors and tokenizer only."""
    assert ours.config.vocab_size == VOCAB and ours.tokenizer.vocab_size == N_REGULAR + 2
    assert ours.tokenizer.token_to_id(BOS) == ours.config.bos_token_id


def test_logits_match_transformers(real_layout, ours):
    """Both engines upcast the same bf16 weights to fp32 and differ only in the order of their sums
    (~1e-6 on logits of size ~1, as in tests/test_parity.py); 1e-4 leaves room without hiding a bug,
    which moves logits by far more (a wrong YaRN scale or a misplaced expert is visible at 1e-2)."""
    from transformers import DeepseekV2ForCausalLM

    theirs = DeepseekV2ForCausalLM.from_pretrained(real_layout, dtype=torch.float32, attn_implementation="eager").eval()
    ids = ours.tokenizer.encode(apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
                                add_special_tokens=False)
    ids += torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(0)).tolist()  # padded rows too
    with torch.no_grad():
        want = theirs(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours.logits(ids), want, atol=1e-4, rtol=0)


# ---- the chat template -------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"},
     {"role": "user", "content": "Name a prime.\nJust one."}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  spaces  "},
     {"role": "assistant", "content": "ok"}],
]


def render_real_template(messages, add_generation_prompt):
    """The chat_template rendered as transformers renders it (a sandboxed jinja2 environment,
    trim_blocks and lstrip_blocks), with the real special tokens."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    return env.from_string(REAL_CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token=BOS, eos_token=EOS)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_the_real_jinja_template(messages, add_generation_prompt):
    assert apply_chat_template(messages, add_generation_prompt) == render_real_template(messages, add_generation_prompt)


def test_transformers_tokenizer_renders_the_same_ids(real_layout, ours):
    """transformers' own tokenizer, read from tokenizer.json + tokenizer_config.json, renders the
    template and tokenizes it; our text encoded with add_special_tokens=False gives the same ids."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(real_layout)
    for messages in CONVERSATIONS:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text == apply_chat_template(messages)
        assert tok(text, add_special_tokens=False)["input_ids"] == ours.tokenizer.encode(text, add_special_tokens=False)
    assert ours.tokenizer.encode(apply_chat_template(CONVERSATIONS[0]), add_special_tokens=False).count(N_REGULAR) == 1


# ---- a missing shard; the Hugging Face cache --------------------------------------------------


def test_missing_shard_is_named_with_a_tensor_it_holds(real_layout, tmp_path):
    broken = tmp_path / "ckpt"
    shutil.copytree(real_layout, broken)
    (broken / SHARD_NAMES[2]).unlink()
    index = json.loads((real_layout / "model.safetensors.index.json").read_text())
    first = next(n for n, f in index["weight_map"].items() if f == SHARD_NAMES[2])
    with pytest.raises(CheckpointError, match=(
            rf"model\.safetensors\.index\.json: tensor '{re.escape(first)}' is in shard "
            rf"'{re.escape(SHARD_NAMES[2])}', which does not exist")):
        LLM(broken, device="cpu", dtype="float32")


def hub_cache_layout(real_layout: Path, cache: Path) -> Path:
    """The directory ``huggingface_hub.snapshot_download`` returns when no ``local_dir`` is given:
    ``models--deepseek-ai--DeepSeek-V2-Lite-Chat/snapshots/<commit>/<file>``, each file a relative
    symlink to ``../../blobs/<hash>``, where the bytes are."""
    repo = cache / "models--deepseek-ai--DeepSeek-V2-Lite-Chat"
    snapshot = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, p in enumerate(sorted(real_layout.iterdir())):
        blob = repo / "blobs" / f"{i:064x}"
        shutil.copyfile(p, blob)
        (snapshot / p.name).symlink_to(Path("..", "..", "blobs", blob.name))
    return snapshot


def test_llm_loads_a_hugging_face_cache_snapshot(real_layout, tmp_path):
    snapshot = hub_cache_layout(real_layout, tmp_path / "hub")
    llm = LLM(snapshot, device="cpu", dtype="float32")
    assert llm.config.vocab_size == VOCAB
