"""The embedded "tiny" model: a DeepSeek-V2 trained on Shakespeare, loaded identically by transformers."""
import json

import torch
from transformers import DeepseekV2ForCausalLM

from dsv2_lib import LLM, SamplingParams
from dsv2_lib.core.config import TINY, load_config
from dsv2_lib.engine.llm import EMBEDDED_MODELS
from dsv2_lib.tools.roofline import parameter_counts

TINY_DIR = EMBEDDED_MODELS["tiny"]

# The Tempest, I.2: part of the training text; ln(4096) = 8.3 nats is the loss of a uniform guess.
SPEECH = """MIRANDA.
If by your art, my dearest father, you have
Put the wild waters in this roar, allay them.
The sky, it seems, would pour down stinking pitch,
But that the sea, mounting to th' welkin's cheek,
Dashes the fire out.
"""


def test_tiny_is_a_deepseek_v2_with_moe_and_yarn_within_budget():
    cfg = load_config(TINY_DIR)
    assert cfg == TINY
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    assert not cfg.is_moe_layer(0) and len(moe_layers) >= 2
    assert cfg.rope.kind == "yarn" and cfg.n_shared_experts > 0
    n = parameter_counts(cfg)["total"]
    assert n <= 15_000_000 and (TINY_DIR / "model.safetensors").stat().st_size <= 30_000_000


def test_training_record_ships_with_the_weights():
    """training.json: the loss curve and settings of the run that produced these weights (appendix A)."""
    record = json.loads((TINY_DIR / "training.json").read_text())
    assert record["parameters"] == parameter_counts(TINY)["total"]
    assert record["best_step"] in record["val_step"]
    assert min(record["val_loss"]) < 4.5 < record["val_loss"][0]


def test_weights_are_trained_on_the_corpus():
    """Mean next-token loss on a known speech: far below a uniform guess (8.3 nats; random weights
    score about that or worse). The shipped weights score 3.94, near their validation loss of 4.02;
    the bound of 5 leaves room for a retrained model and none for an untrained one."""
    llm = LLM("tiny", device="cpu", dtype="float32")
    ids = llm.tokenizer.encode(SPEECH)
    logits = llm.logits(ids)
    loss = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:])).item()
    assert loss < 5.0


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
