"""Where does our engine part from transformers? Run both on one checkpoint and one prompt, record
every step of every layer on both sides, and name the first step whose output differs.

    python -m dsv2_lib diff --model DIR "The capital of France is"

Both engines read the same safetensors files, and our module names are the checkpoint's, so the
steps line up by name: the embedding, each layer's ``input_layernorm``, query and latent projections,
RoPE, attention, ``post_attention_layernorm`` and MLP/MoE, the final norm and the logits. RoPE is
no module on either side; the tool wraps the function each side calls (ours: ``MLA.cache_rows``, which
rotates in place; transformers: ``apply_rotary_emb``) for the duration of the run. Outputs are compared with a
tolerance scaled to the dtype (two correct engines differ only in the order of their sums), and the
first step outside it is the answer: every step before it agrees, so the bug is in that step.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from dsv2_lib.engine.llm import LLM
from dsv2_lib.model import mla as our_mla

# |ours - theirs| <= TOLERANCE * max|theirs|: float32 engines differ by ~1e-6 relative (summation
# order); 16-bit ones round every stored activation, ~2^-8 relative for bf16, and errors compound.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
LAYER_STEPS = ("input_layernorm", "q projection", "kv_a_proj_with_mqa", "rope q_pe", "rope k_pe", "self_attn",
               "post_attention_layernorm", "mlp")


@dataclass
class Step:
    """One compared step: where, how far apart, and whether that is within the dtype's tolerance."""

    name: str
    max_abs: float
    relative: float
    ok: bool

    def __str__(self) -> str:
        mark = "ok  " if self.ok else "DIFF"
        return f"{mark} {self.name:<44} max |ours - transformers| = {self.max_abs:.3e}  ({self.relative:.1e} of max |x|)"


class Recorder:
    """Named tensors of one forward pass, in the order they were produced."""

    def __init__(self):
        self.values: dict[str, torch.Tensor] = {}

    def put(self, name: str, x) -> None:
        x = x[0] if isinstance(x, tuple) else x  # our norms return (normed, residual)
        self.values.setdefault(name, x.detach().float().cpu().clone())


def _module_steps(layers: int, q_lora: bool) -> dict[str, str]:
    """Module path (in both models) -> step name."""
    steps = {"model.embed_tokens": "embedding", "model.norm": "final norm"}
    for i in range(layers):
        p = f"model.layers.{i}"
        steps |= {f"{p}.input_layernorm": f"layer {i} input_layernorm",
                  f"{p}.self_attn.{'q_b_proj' if q_lora else 'q_proj'}": f"layer {i} q projection",
                  f"{p}.self_attn.kv_a_proj_with_mqa": f"layer {i} kv_a_proj_with_mqa",
                  f"{p}.self_attn": f"layer {i} self_attn",
                  f"{p}.post_attention_layernorm": f"layer {i} post_attention_layernorm",
                  f"{p}.mlp": f"layer {i} mlp"}
    return steps


@contextlib.contextmanager
def _hooks(model: torch.nn.Module, steps: dict[str, str], rec: Recorder):
    modules = dict(model.named_modules())
    handles = [modules[path].register_forward_hook(lambda m, args, out, name=name: rec.put(name, out))
               for path, name in steps.items() if path in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _wrapped(owner, attr: str, record):
    """Replace ``owner.attr`` by a wrapper that calls it, then ``record(args, result)``."""
    original = getattr(owner, attr, None)
    if original is None:
        yield
        return

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        record(args, result)
        return result

    setattr(owner, attr, wrapper)
    try:
        yield
    finally:
        setattr(owner, attr, original)


def _rope_recorder(rec: Recorder, ours: bool):
    """Record RoPE's rotated q_pe and k_pe, one call per layer, as ``[T, heads, d]`` and ``[T, d]``."""
    calls = [0]

    def record(args, result):
        i = calls[0]
        calls[0] += 1
        if ours:  # MLA.cache_rows(self, kv [T, R + d], q_pe [T, h, d], ...) rotates q_pe and kv[:, R:] in place
            q = args[2]
            k = args[1][:, -q.shape[-1]:]
        else:  # apply_rotary_emb(q_pe [B, h, T, d], k_pe [B, 1, T, d], ...) -> (q, k)
            q, k = (r[0].transpose(0, 1) for r in result)
        rec.put(f"layer {i} rope q_pe", q)
        rec.put(f"layer {i} rope k_pe", k.reshape(k.shape[0], -1))
    return record


def run_ours(llm: LLM, ids: list[int]) -> Recorder:
    """Our engine's steps on ``ids``: :meth:`LLM.logits`, with every step recorded on the way."""
    cfg = llm.config
    rec = Recorder()
    with _hooks(llm.model, _module_steps(cfg.num_hidden_layers, cfg.q_lora_rank is not None), rec), \
            _wrapped(our_mla.MLA, "cache_rows", _rope_recorder(rec, ours=True)):
        rec.put("logits", llm.logits(ids))
    return rec


def run_transformers(directory: Path, ids: list[int], dtype: torch.dtype, device: str) -> Recorder:
    from transformers import AutoModelForCausalLM
    from transformers.models.deepseek_v2 import modeling_deepseek_v2

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    cfg = model.config
    rec = Recorder()
    with torch.no_grad(), _hooks(model, _module_steps(cfg.num_hidden_layers, cfg.q_lora_rank is not None), rec), \
            _wrapped(modeling_deepseek_v2, "apply_rotary_emb", _rope_recorder(rec, ours=False)):
        logits = model(torch.tensor([ids], device=device)).logits[0]
        rec.put("logits", logits)
    return rec


def _aligned(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor | None:
    """``theirs`` in ``ours``'s shape: transformers keeps a batch dim of 1 that our packed tokens lack."""
    while theirs.dim() > ours.dim() and theirs.shape[0] == 1:
        theirs = theirs[0]
    if theirs.shape != ours.shape and theirs.numel() == ours.numel():
        theirs = theirs.reshape(ours.shape)
    return theirs if theirs.shape == ours.shape else None


def compare(ours: Recorder, theirs: Recorder, dtype: torch.dtype, layers: int) -> list[Step]:
    """Every step both engines recorded, in execution order, with its error and verdict."""
    order = ["embedding", *(f"layer {i} {s}" for i in range(layers) for s in LAYER_STEPS), "final norm", "logits"]
    steps = []
    for name in order:
        if name not in ours.values or name not in theirs.values:
            continue
        a, b = ours.values[name], _aligned(ours.values[name], theirs.values[name])
        if b is None:
            steps.append(Step(f"{name} (shapes {list(a.shape)} vs {list(theirs.values[name].shape)})",
                              float("inf"), float("inf"), False))
            continue
        max_abs = (a - b).abs().max().item() if a.numel() else 0.0
        scale = max(b.abs().max().item() if b.numel() else 0.0, 1e-30)
        steps.append(Step(name, max_abs, max_abs / scale, max_abs <= TOLERANCE[dtype] * scale))
    return steps


def first_divergence(steps: list[Step]) -> Step | None:
    return next((s for s in steps if not s.ok), None)


def diff(directory: str | Path, prompt: str | list[int], dtype: torch.dtype = torch.float32,
         device: str = "cpu") -> list[Step]:
    """Run both engines on ``prompt`` (text, or token ids) and compare every step."""
    llm = LLM(directory, device=device, dtype=dtype)
    if isinstance(prompt, str) and llm.tokenizer is None:
        raise ValueError(f"diff: {directory} has no tokenizer.json; pass the prompt as token ids")
    ids = prompt if isinstance(prompt, list) else llm.tokenizer.encode(prompt)
    if not ids:
        raise ValueError("diff: the prompt has no tokens")
    return compare(run_ours(llm, ids), run_transformers(Path(directory), ids, dtype, device), dtype,
                   llm.config.num_hidden_layers)


def add_diff_parser(sub, formatter_class) -> None:
    """The ``diff`` subcommand of ``python -m dsv2_lib``."""
    d = sub.add_parser("diff", help="run our engine and transformers side by side; name the first step that differs",
                       formatter_class=formatter_class, description=__doc__.split("\n\n")[0])
    d.add_argument("prompt", help="the prompt text")
    d.add_argument("--model", default="tiny", help="'tiny' or a DeepSeek-V2 checkpoint directory")
    d.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="both engines' dtype; the tolerance follows it")
    d.add_argument("--device", default="cpu", help="cpu or cuda")
    d.add_argument("--all", action="store_true", help="print every step, not only up to the first divergence")


def diff_command(args) -> int:
    """Print the steps up to the first divergence; exit 0 (none), 1 (found, as diff(1) does) or 2 (error)."""
    from dsv2_lib.engine.llm import resolve_model

    dtype = getattr(torch, args.dtype)
    try:
        steps = diff(resolve_model(args.model), args.prompt, dtype, args.device)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bad = first_divergence(steps)
    print("\n".join(map(str, steps if args.all or bad is None else steps[: steps.index(bad) + 1])))
    if bad is None:
        print(f"\nno divergence: all {len(steps)} steps agree within {TOLERANCE[dtype]:g} of their scale ({args.dtype})")
        return 0
    print(f"\nfirst divergence: {bad.name}; every step before it agrees")
    return 1
