"""Requests that arrive at any time, from any thread, served in one continuous batch.

``LLM.generate`` knows all its requests when it starts. A server does not: requests arrive while
others are half done, and each must join the running batch at the next step, not wait for a new
run. A :class:`LiveEngine` owns one :class:`~dsv2_lib.engine.step_loop.StepLoop` on the LLM's pool
and runs it on a thread of its own: :meth:`LiveEngine.submit` (any thread) hands a request to that
thread, which queues it between two steps; each produced token goes to the request's callback as an
:class:`Event`. :meth:`LiveRequest.abort` (a client went away) frees the request's blocks at the
next step boundary.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from dsv2_lib.engine.llm import LLM, Prompt
from dsv2_lib.engine.request_state import RequestState, TokenLogprob
from dsv2_lib.engine.sampling import SamplingParams


@dataclass(frozen=True)
class Event:
    """What one step produced for a request: a token, the text it completes (``None`` without a
    tokenizer) and its logprob when asked for; the last event has ``finish_reason`` (and ``error``
    when the request could not be served; then ``token`` is ``None``)."""

    token: int | None
    piece: str | None
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None
    error: str | None = None


class LiveRequest:
    """A submitted request: ``prompt_ids``, and :meth:`abort` to cancel it."""

    def __init__(self, engine: LiveEngine, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                 on_event: Callable[[Event], None]):
        self.engine, self.prompt_ids, self.params, self.max_tokens = engine, prompt_ids, params, max_tokens
        self.on_event = on_event
        self.state: RequestState | None = None  # set on the engine's thread when queued

    def abort(self) -> None:
        """Cancel: no more events; its blocks go back to the pool between two steps. Safe from any thread."""
        self.engine._post(("abort", self))


class LiveEngine:
    """Serve ``llm`` to concurrent callers until :meth:`close`. The LLM needs a cache sized once
    (``kv_cache_mib`` or ``gpu_memory_utilization``: one pool for all requests, whenever they come)
    and is held by the engine until then (its ``generate`` is refused meanwhile)."""

    def __init__(self, llm: LLM):
        if llm.runner.cache is None:
            raise ValueError("a LiveEngine serves from one pool for all requests: build the LLM with kv_cache_mib "
                             "or gpu_memory_utilization")
        llm.acquire("a LiveEngine")
        self.llm = llm
        self.loop = llm.new_loop([])
        self._inbox: list[tuple[str, LiveRequest]] = []
        self._wake = threading.Condition()
        self._closing = False
        self._live: dict[int, LiveRequest] = {}  # request id -> request, while it is served
        self.failure: BaseException | None = None  # what stopped the engine's thread, if anything did
        self._thread = threading.Thread(target=self._run, name="dsv2-live-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: Prompt, params: SamplingParams, on_event: Callable[[Event], None]) -> LiveRequest:
        """Queue a request (validated here, in the caller's thread: a bad prompt, or a request larger than
        the whole pool, raises ``ValueError``).
        ``on_event`` is called on the engine's thread for each token; it must be quick (hand the event to
        the caller's own loop, e.g. ``loop.call_soon_threadsafe``)."""
        (ids,), (params,) = self.llm._requests([prompt], params)
        max_tokens = min(len(ids) + params.max_tokens, self.llm.engine_config.max_model_len) - len(ids)
        if problem := self.loop.sched.never_fits(len(ids), max_tokens):
            raise ValueError(f"this request {problem}")
        request = LiveRequest(self, ids, params, max_tokens, on_event)
        self._post(("add", request))
        return request

    def close(self) -> None:
        """Stop: requests still running end with ``"abort"``; the LLM is free again."""
        self._post(("close", None))
        self._thread.join()
        self.llm._release()

    def __enter__(self) -> LiveEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the engine's thread -----------------------------------------------------------------------
    def _post(self, item: tuple[str, LiveRequest | None]) -> None:
        with self._wake:
            if self._closing and item[0] == "add":
                raise RuntimeError("this LiveEngine is closed" + (f" (it failed: {self.failure!r})" if self.failure else ""))
            self._closing |= item[0] == "close"
            self._inbox.append(item)
            self._wake.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._inbox and not self.loop.has_work():
                        self._wake.wait()
                    items, self._inbox = self._inbox, []
                for kind, request in items:
                    if kind == "add":
                        self._add(request)
                    elif kind == "abort" and request.state is not None:
                        self._live.pop(request.state.request_id, None)
                        self.loop.abort(request.state)
                    elif kind == "close":
                        for r in list(self._live.values()):
                            self.loop.abort(r.state)
                            self._emit(r, Event(None, None, finish_reason="abort"))
                        self._live.clear()
                        while self.loop.has_work():  # the step in flight (one ahead) resolves; its tokens are dropped
                            self.loop.step()
                        return
                if self.loop.has_work():
                    for state, token in self.loop.step():
                        request = self._live.get(state.request_id)
                        if request is not None:
                            self._send(request, state, token)
        except Exception as e:  # a failed step: every caller hears of it (and `failure` keeps it), none waits forever
            self.failure = e
            with self._wake:
                self._closing = True
            for r in self._live.values():
                self._emit(r, Event(None, None, finish_reason="error", error=f"the engine failed: {e!r}"))

    def _add(self, request: LiveRequest) -> None:
        request.state = self.loop.add(request.prompt_ids, request.params, request.max_tokens, incremental=True)
        self._live[request.state.request_id] = request

    def _send(self, request: LiveRequest, state: RequestState, token: int) -> None:
        logprobs = state.out.logprobs
        event = Event(token, state.piece(), logprobs[-1] if logprobs else None, state.out.finish_reason)
        if state.finished:
            del self._live[state.request_id]
        self._emit(request, event)

    def _emit(self, request: LiveRequest, event: Event) -> None:
        """Give ``event`` to its caller; a caller that cannot take it any more (its own loop closed) is
        cancelled rather than allowed to stop the engine."""
        try:
            request.on_event(event)
        except Exception:
            if request.state is not None and not request.state.finished:
                self._live.pop(request.state.request_id, None)
                self.loop.abort(request.state)
