"""What a request has produced, on the host: its tokens, its text as it grows, stop strings and logprobs.

The scheduler knows tokens; the user asked for text. A :class:`RequestState` turns each sampled token
into a piece of text (incrementally, :meth:`Tokenizer.decode_stream <dsv2_lib.core.tokenizer.Tokenizer.decode_stream>`), decides whether the request stops (a stop token, EOS, or a
stop string anywhere in the text, across token boundaries) and keeps the log-probabilities asked for.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dsv2_lib.core.tokenizer import Tokenizer
from dsv2_lib.engine.sampling import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability, and the ``k`` most likely tokens' (``(token id, logprob)``,
    most likely first) when ``SamplingParams.logprobs = k``."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """One finished request: its prompt ids, the generated ids (a final stop token included), the
    generated text (``None`` without a tokenizer; it ends before a matched stop string) and why it
    stopped: ``"stop"`` (EOS, a stop token or string), ``"length"`` (``max_tokens`` or the context),
    ``"abort"`` (cancelled) or ``"error"`` (it could not be served: ``error`` says why).
    ``logprobs``: one :class:`TokenLogprob` per generated token when asked for."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None


class RequestState:
    """The host side of one request while it is served.

    ``incremental``: keep the text up to date token by token (a stream, or stop strings to match);
    otherwise the text is decoded once, at the end. ``eos``: the ids that end a request unless
    ``params.ignore_eos``.
    """

    def __init__(self, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer | None,
                 eos: tuple[int, ...], incremental: bool = False):
        if params.stop and tokenizer is None:
            raise ValueError("SamplingParams.stop matches text, but this checkpoint has no tokenizer.json")
        self.params, self.tokenizer = params, tokenizer
        self.request_id: int | None = None  # the scheduler's, once queued
        self.stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
        self.out = RequestOutput(prompt_ids, logprobs=[] if params.logprobs is not None else None)
        self._decode = tokenizer.decode_stream() if tokenizer and (incremental or params.stop) else None
        self._text = ""  # decoded so far (incremental only)
        self._sent = 0  # characters of _text already given out as pieces
        self._hold = max((len(s) for s in params.stop), default=1) - 1  # a stop string may still be forming

    @property
    def finished(self) -> bool:
        return self.out.finish_reason is not None

    def add(self, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Record a sampled token; whether the request stops here (a stop token or a stop string)."""
        self.out.token_ids.append(token)
        if self.out.logprobs is not None and logprob is not None:
            self.out.logprobs.append(logprob)
        if token in self.stops:
            return True
        if self._decode is None:
            return False
        start = max(0, len(self._text) - self._hold)  # where a stop string completed by this piece may begin
        self._text += self._decode(token)
        hits = [i for i in (self._text.find(s, start) for s in self.params.stop) if i >= 0]
        if hits:
            self._text = self._text[:min(hits)]
            self.out.text = self._text
            return True
        return False

    def finish(self, reason: str) -> None:
        """The request ended (``reason`` as in :class:`RequestOutput`): its text is final."""
        self.out.finish_reason = reason
        if self.out.text is None and self.tokenizer is not None:  # (a stop string already set it)
            self.out.text = self.tokenizer.decode(self.out.token_ids)

    def piece(self) -> str | None:
        """The text not given out yet that is final: all of it once finished; before that, less what may
        be the start of a stop string. ``None`` without a tokenizer."""
        if self.tokenizer is None:
            return None
        text = self.out.text if self.finished else self._text[:max(self._sent, len(self._text) - self._hold)]
        piece, self._sent = text[self._sent:], len(text)
        return piece
