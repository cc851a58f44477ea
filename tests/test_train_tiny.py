"""Training the tiny model (CPU, a few steps of a very small shape): the loss falls, and the saved
checkpoint is one that both our engine and transformers load, with the same greedy tokens."""
import dataclasses
import json

import torch
from transformers import DeepseekV2ForCausalLM

from dsv2_lib import LLM, SamplingParams
from dsv2_lib.core.config import TINY
from dsv2_lib.tools.roofline import parameter_counts
from dsv2_lib.tools.train_tiny import (
    TrainSettings,
    evaluate,
    learning_rate,
    main,
    save_checkpoint,
    train,
    train_tokenizer,
)

VERSE = """MIRANDA. If by your art, my dearest father, you have
Put the wild waters in this roar, allay them.
The sky, it seems, would pour down stinking pitch,
But that the sea, mounting to th' welkin's cheek,
Dashes the fire out. O, I have suffered
With those that I saw suffer: a brave vessel,
Who had, no doubt, some noble creature in her,
Dash'd all to pieces.
"""
OTHER_VERSE = """PROSPERO. Be collected;
No more amazement. Tell your piteous heart
There's no harm done.
"""
SMALL = dataclasses.replace(TINY, vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                            v_head_dim=8, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=16)


def test_tiny_fits_the_budget():
    """The issue's bounds: at most 15 M parameters, at most 30 MB in bf16; MoE after a dense layer."""
    n = parameter_counts(TINY)["total"]
    assert n <= 15_000_000 and 2 * n <= 30_000_000
    cfg = TINY
    assert not cfg.is_moe_layer(0) and sum(map(cfg.is_moe_layer, range(cfg.num_hidden_layers))) >= 2
    assert cfg.rope.kind == "yarn" and cfg.n_shared_experts > 0


def test_training_lowers_the_loss_and_saves_a_checkpoint_both_engines_load(tmp_path):
    tok = train_tokenizer([VERSE * 50], SMALL.vocab_size)
    ids = torch.tensor(tok.encode(VERSE * 200, add_special_tokens=False).ids)
    settings = TrainSettings(steps=60, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=5, eval_every=20, eval_batches=2)
    model, history = train(SMALL, ids, ids, settings, device="cpu")
    assert history["val_loss"][-1] < history["val_loss"][0] - 1.0  # memorises a short verse
    out = save_checkpoint(model, tok, {"steps": 60}, tmp_path / "ckpt")

    ours = LLM(out, device="cpu", dtype="float32")
    out_ours = ours.generate("MIRANDA.", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    hf = DeepseekV2ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = torch.tensor([out_ours.prompt_token_ids])
    with torch.no_grad():
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=16,
                          min_new_tokens=16, eos_token_id=None, pad_token_id=SMALL.vocab_size - 1)
    assert out_ours.token_ids == ref[0, prompt.shape[1]:].tolist()


def test_command_line_runs_end_to_end(tmp_path):
    """``python -m dsv2_lib.tools.train_tiny``'s path (tokenizer, split, training, saving) for two steps."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(VERSE * 100)
    main([str(corpus), str(tmp_path / "out"), "--device", "cpu", "--steps", "2", "--batch-size", "2",
          "--seq-len", "16", "--eval-every", "1", "--eval-batches", "1"])
    summary = json.loads((tmp_path / "out" / "training.json").read_text())
    assert len(summary["train_loss"]) == 2 and summary["parameters"] == parameter_counts(TINY)["total"]
    assert LLM(tmp_path / "out", device="cpu").config.vocab_size == TINY.vocab_size


def test_the_model_returned_is_the_one_of_the_lowest_validation_loss():
    """Trained on one verse and validated on another, the validation loss falls, then rises as the
    model memorises: the model returned is the best one seen, not the last."""
    tok = train_tokenizer([VERSE * 50], SMALL.vocab_size)
    train_ids = torch.tensor(tok.encode(VERSE * 200, add_special_tokens=False).ids)
    val_ids = torch.tensor(tok.encode(OTHER_VERSE * 20, add_special_tokens=False).ids)
    s = TrainSettings(steps=60, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=5, eval_every=5, eval_batches=2)
    model, history = train(SMALL, train_ids, val_ids, s, device="cpu")
    best = min(history["val_loss"])
    assert history["val_loss"][-1] > best + 0.5  # the setting really overfits
    assert history["best_step"] == history["val_step"][history["val_loss"].index(best)] < history["step"][-1]
    assert evaluate(model, val_ids, s, "cpu") == best


def test_learning_rate_decays_with_the_clock_when_time_is_the_budget():
    s = TrainSettings(steps=1000, lr=1.0, warmup_steps=10, minutes=10)
    assert learning_rate(0, s) == 0.1 and learning_rate(9, s) == 1.0  # linear warm-up
    assert learning_rate(10, s, elapsed_s=0) == 1.0
    assert abs(learning_rate(10, s, elapsed_s=300) - 0.55) < 1e-12  # half the time: half-way down the cosine
    assert abs(learning_rate(10, s, elapsed_s=600) - 0.1) < 1e-12  # out of time: the floor, a tenth of the peak
    assert abs(learning_rate(505, TrainSettings(steps=1000, lr=1.0, warmup_steps=10)) - 0.55) < 1e-12  # steps alone
