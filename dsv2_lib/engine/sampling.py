"""Sampling parameters and the choice of the next token from a row of logits."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MIN_TEMPERATURE = 1e-4  # below this (but above 0) logits / temperature can overflow float32: use 0 for greedy
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes a 64-bit seed
MAX_LOGPROBS = 20  # most alternatives reported per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature == 0`` is greedy (argmax). Otherwise logits are divided by the temperature, cut to
    the ``top_k`` most likely tokens (0: no cut) and to the smallest set whose probability reaches
    ``top_p`` (1: no cut), renormalised and sampled with a generator seeded by ``seed``
    (``None``: drawn from torch's global RNG, so not reproducible).
    Generation stops after ``max_tokens`` tokens, at EOS (unless ``ignore_eos``), at any of
    ``stop_token_ids`` (the token is kept) or when the text contains any of the strings ``stop`` (the
    text ends just before it; the token ids keep the token that completed it).
    ``logprobs=k``: report each generated token's log-probability and the ``k`` most likely tokens'
    (0: the chosen token's only), from the model's distribution before temperature and cuts.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    logprobs: int | None = None

    def __post_init__(self):
        def bad(field, want):
            raise ValueError(f"SamplingParams.{field} must be {want}, got {getattr(self, field)!r}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "an int >= 1")
        if (not _is_number(self.temperature) or not math.isfinite(self.temperature)
                or not (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE)):
            bad("temperature", f"0 (greedy) or a finite number >= {MIN_TEMPERATURE:g} (smaller ones overflow "
                               "the scaled logits)")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "an int >= 0 (0 disables it)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1]")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED):
            bad("seed", "None or an int in 0..2**64 - 1")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "True or False")
        try:
            stop = tuple(self.stop_token_ids)  # once: a generator can be iterated only once
        except TypeError:
            stop = None
        if stop is None or not all(_is_int(t) and t >= 0 for t in stop):
            bad("stop_token_ids", "a sequence of non-negative ints")
        object.__setattr__(self, "stop_token_ids", stop)
        strings = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(strings, (list, tuple)) or not all(isinstance(x, str) and x for x in strings):
            bad("stop", "a string or a sequence of non-empty strings")
        object.__setattr__(self, "stop", tuple(strings))
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"None or an int in 0..{MAX_LOGPROBS}")

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A fresh RNG for one request (``None`` for greedy, which needs none)."""
        if self.temperature == 0:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return g


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to fp32 ``logits [V]``; removed tokens get ``-inf``."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) >= params.top_p  # mass before this token already reaches top_p
        logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token id from ``logits [V]``."""
    if params.temperature == 0:
        return int(logits.argmax())
    probs = filter_logits(logits, params).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits [B, V]``, as :func:`sample` picks it for row ``i`` with ``params[i]``
    and ``generators[i]``, copied to the host once for all rows (:func:`sample_rows_on_device`)."""
    return sample_rows_on_device(logits, params, generators).tolist()


def sample_rows_on_device(logits: torch.Tensor, params: list[SamplingParams],
                          generators: list[torch.Generator | None]) -> torch.Tensor:
    """The picks of :func:`sample_rows` as an int64 tensor ``[B]`` on ``logits``' device, nothing read
    back: the greedy rows by one batched argmax, the others one by one with their own generator (a
    request's draws never depend on its neighbours)."""
    picks = logits.argmax(-1)
    for i, (p, g) in enumerate(zip(params, generators)):
        if p.temperature != 0:
            picks[i] = torch.multinomial(filter_logits(logits[i], p).softmax(-1), 1, generator=g)[0]
    return picks

