"""The embedded "tiny" model: reproducible from its seed, and loaded identically by transformers."""
import torch
from safetensors.torch import load_file
from transformers import DeepseekV2ForCausalLM

from dsv2_lib import LLM, SamplingParams
from dsv2_lib.config import TINY, load_config
from dsv2_lib.llm import EMBEDDED_MODELS
from dsv2_lib.random_checkpoint import write_random_checkpoint
from dsv2_lib.tiny import SEED

TINY_DIR = EMBEDDED_MODELS["tiny"]


def test_committed_weights_are_the_seeded_ones(tmp_path):
    write_random_checkpoint(TINY, tmp_path, seed=SEED)
    committed, rebuilt = load_file(TINY_DIR / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert committed.keys() == rebuilt.keys()
    assert all(torch.equal(committed[k], rebuilt[k]) for k in committed)
    assert load_config(TINY_DIR) == TINY


def test_tiny_is_a_deepseek_v2_with_moe_and_yarn():
    cfg = load_config(TINY_DIR)
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    assert not cfg.is_moe_layer(0) and len(moe_layers) >= 2
    assert cfg.rope.kind == "yarn" and cfg.n_shared_experts > 0


def test_text_in_text_out_and_same_greedy_tokens_as_transformers():
    llm = LLM("tiny", device="cpu", dtype="float32")
    out = llm.generate("To be, or not", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt_token_ids[0] == TINY.bos_token_id
    assert isinstance(out.text, str) and out.text == llm.tokenizer.decode(out.token_ids)
    hf = DeepseekV2ForCausalLM.from_pretrained(TINY_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([out.prompt_token_ids])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                          min_new_tokens=24, eos_token_id=None, pad_token_id=0)
    assert out.token_ids == ref[0, len(out.prompt_token_ids):].tolist()
