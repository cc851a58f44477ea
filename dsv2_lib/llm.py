"""The public entry point: ``LLM(model).generate(prompts, SamplingParams(...))`` and ``LLM.logits``."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import load_checkpoint
from .config import load_config
from .kv_cache import LatentCache, SequenceBatch
from .model import DeepseekV2
from .sampling import SamplingParams, sample
from .tokenizer import Tokenizer
from .weights import default_dtype

EMBEDDED_MODELS = {"tiny": Path(__file__).parent / "assets" / "tiny"}

Prompt = str | list[int]


@dataclass
class RequestOutput:
    """One finished request: its prompt ids, the generated ids (a final stop token included), the
    generated text (``None`` without a tokenizer) and why it stopped: ``"stop"`` or ``"length"``."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str


def resolve_model(model: str | Path) -> Path:
    """An embedded model's name (``"tiny"``) or a checkpoint directory -> the directory."""
    if str(model) in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[str(model)]
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model {str(model)!r}: not an embedded model ({', '.join(EMBEDDED_MODELS)}) nor a directory")
    return path


class LLM:
    """A DeepSeek-V2 model ready to generate.

    ``device=None`` picks CUDA when available; ``dtype=None`` picks bfloat16 on CUDA, float32 on
    the CPU. ``max_model_len`` caps prompt + generated tokens (default: the config's
    ``max_position_embeddings``).
    """

    def __init__(self, model: str | Path = "tiny", device: str | None = None, dtype: str | torch.dtype | None = None,
                 max_model_len: int | None = None):
        path = resolve_model(model)
        self.config = load_config(path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
            raise ValueError(f"max_model_len must be an int >= 2 (a prompt token and a generated one), got {max_model_len!r}")
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        with torch.device(self.device), default_dtype(self.dtype):
            self.model = DeepseekV2(self.config)
        load_checkpoint(self.model, path)
        self.tokenizer = Tokenizer.from_dir(path)

    # ---- inputs -----------------------------------------------------------------------------
    def _token_ids(self, prompt: Prompt, index: int) -> list[int]:
        """A prompt's token ids, validated (range, length); ``index`` names it in errors."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {index} is text but this checkpoint has no tokenizer.json; pass token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise ValueError(f"prompt {index} is {type(prompt).__name__} {prompt!r}; a prompt is text or a list of token ids")
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        vocab = self.config.vocab_size
        for pos, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool):
                raise ValueError(f"prompt {index}: token {pos} is {t!r}, not an int (a prompt is text or a list of ints)")
            if not 0 <= t < vocab:
                raise ValueError(f"prompt {index}: token {pos} is {t!r}, outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; the context holds {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        return ids

    # ---- public API -------------------------------------------------------------------------
    def logits(self, prompt: Prompt) -> torch.Tensor:
        """float32 logits for every position of one prompt, ``[len, vocab]`` on the CPU."""
        ids = self._token_ids(prompt, 0)
        cache = LatentCache(self.config, 1, len(ids), self.dtype, self.device)
        batch = SequenceBatch(slots=(0,), starts=(0,), lens=(len(ids),))
        hidden = self.model(torch.tensor(ids, device=self.device), batch, cache)
        return self.model.compute_logits(hidden).cpu()

    def generate(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids), all decoded together one token per step."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        params = SamplingParams() if params is None else params  # not `or`: an empty list is a mismatch
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(plist)} SamplingParams")
        if not prompts:
            return []
        ids = [self._token_ids(p, i) for i, p in enumerate(prompts)]
        limits = [min(len(i) + p.max_tokens, self.max_model_len) for i, p in zip(ids, plist)]
        cache = LatentCache(self.config, len(ids), max(limits), self.dtype, self.device)
        generators = [p.generator(self.device) for p in plist]
        out: list[list[int]] = [[] for _ in ids]
        finish: list[str | None] = [None] * len(ids)

        batch = SequenceBatch(tuple(range(len(ids))), (0,) * len(ids), tuple(map(len, ids)))
        tokens = torch.tensor([t for seq in ids for t in seq], device=self.device)
        last = torch.tensor(batch.lens, device=self.device).cumsum(0) - 1
        while True:
            logits = self.model.compute_logits(self.model(tokens, batch, cache)[last])
            for row, slot in enumerate(batch.slots):
                token = sample(logits[row], plist[slot], generators[slot])
                out[slot].append(token)
                finish[slot] = self._finish_reason(token, len(ids[slot]) + len(out[slot]), plist[slot], limits[slot])
            live = [s for s in batch.slots if finish[s] is None]
            if not live:
                break
            batch = SequenceBatch(tuple(live), tuple(len(ids[s]) + len(out[s]) - 1 for s in live), (1,) * len(live), decode=True)
            tokens = torch.tensor([out[s][-1] for s in live], device=self.device)
            last = torch.arange(len(live), device=self.device)
        return [
            RequestOutput(i, o, self.tokenizer.decode(o) if self.tokenizer else None, f)
            for i, o, f in zip(ids, out, finish)
        ]

    def _finish_reason(self, token: int, total_len: int, params: SamplingParams, limit: int) -> str | None:
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.config.eos_token_id):
            return "stop"
        return "length" if total_len >= limit else None
