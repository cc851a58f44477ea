"""An OpenAI-compatible HTTP server: ``python -m dsv2_lib serve --model tiny --port 8000``.

``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``, answered whole or streamed as
server-sent events, on FastAPI and uvicorn. Every HTTP request becomes a request of one
:class:`~dsv2_lib.engine.live_engine.LiveEngine`, so concurrent clients share one continuous batch.
A bad request gets a 4xx and OpenAI's error body (``{"error": {"message", "type", "param", "code"}}``);
a client that disconnects has its request aborted, which frees its blocks.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from dsv2_lib.engine.live_engine import Event, LiveEngine
from dsv2_lib.engine.request_state import TokenLogprob
from dsv2_lib.engine.sampling import MAX_LOGPROBS, SamplingParams

DISCONNECT_POLL_S = 0.5  # how often a whole (not streamed) answer's wait asks whether its client is still there


class _Common(BaseModel):
    """The sampling fields both endpoints take (OpenAI's names and defaults)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1)  # one choice per request
    top_k: int = Field(0, ge=0)  # (vLLM's extensions to OpenAI's fields)
    ignore_eos: bool = False


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)  # the legacy endpoint's limit
    echo: bool = Field(False)


class ChatRequest(_Common):
    messages: list[dict]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def create_app(engine: LiveEngine, model_name: str) -> FastAPI:
    """The FastAPI application serving ``engine`` under the model id ``model_name``."""
    app = FastAPI(title="dsv2_lib OpenAI-compatible server")
    tokenizer = engine.llm.tokenizer
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"][1:]) or None
        return _error(400, f"{param or 'body'}: {first['msg']}", param)

    @app.exception_handler(_BadRequest)
    async def bad(_, exc: _BadRequest):
        return _error(exc.status, str(exc), exc.param, exc.code)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "dsv2_lib", "max_model_len": engine.llm.engine_config.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, model_name)
        if body.echo:
            raise _BadRequest("echo is not supported", "echo")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise _BadRequest("one prompt per request (send several requests: they share a batch)", "prompt")
            prompt = prompt[0]
        params = _params(body, body.max_tokens, body.logprobs)
        rid, kind = f"cmpl-{uuid.uuid4().hex}", "text_completion"
        events, handle, n_prompt = await _submit(engine, prompt, params)

        def choice(text, lps, reason):
            return {"index": 0, "text": text, "logprobs": _completion_logprobs(lps, tokenizer, body.logprobs),
                    "finish_reason": reason}

        if body.stream:
            return _sse(events, handle, lambda e, first: {"id": rid, "object": kind, "created": int(time.time()),
                                                            "model": model_name,
                                                            "choices": [choice(e.piece or "", _one(e), e.finish_reason)]})
        text, lps, reason, n_out = await _collect(events, handle, request)
        return {"id": rid, "object": kind, "created": int(time.time()), "model": model_name,
                "choices": [choice(text, lps, reason)], "usage": _usage(n_prompt, n_out)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check_model(body.model, model_name)
        try:
            prompt = engine.llm.chat_prompt(body.messages)
        except ValueError as e:
            raise _BadRequest(str(e), "messages") from None
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = _params(body, body.max_completion_tokens or body.max_tokens, k)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        events, handle, n_prompt = await _submit(engine, prompt, params)

        def chunk(e: Event, first: bool):
            delta = {"role": "assistant", "content": e.piece or ""} if first else {"content": e.piece or ""}
            lps = {"content": _chat_logprobs(_one(e), tokenizer)} if k is not None else None
            return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": lps, "finish_reason": e.finish_reason}]}

        if body.stream:
            return _sse(events, handle, chunk)
        text, lps, reason, n_out = await _collect(events, handle, request)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": {"content": _chat_logprobs(lps, tokenizer)} if k is not None else None,
                             "finish_reason": reason}],
                "usage": _usage(n_prompt, n_out)}

    return app


# ---- requests in, events out ---------------------------------------------------------------------
def _check_model(name: str, served: str) -> None:
    if name != served:
        raise _BadRequest(f"the model {name!r} does not exist; this server serves {served!r}", "model", 404,
                          "model_not_found")


def _params(body: _Common, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens or 16, temperature=body.temperature, top_p=body.top_p,
                              top_k=body.top_k, seed=body.seed, stop=body.stop or (), logprobs=logprobs,
                              ignore_eos=body.ignore_eos)
    except ValueError as e:
        field = str(e).split(" ", 1)[0].removeprefix("SamplingParams.")
        raise _BadRequest(str(e), field) from None


async def _submit(engine: LiveEngine, prompt, params: SamplingParams):
    """Hand the request to the engine; its events arrive on an asyncio queue of this loop."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    try:
        handle = engine.submit(prompt, params, lambda e: loop.call_soon_threadsafe(events.put_nowait, e))
    except ValueError as e:
        raise _BadRequest(str(e), "prompt" if str(e).startswith("prompt") else None) from None
    except RuntimeError as e:
        raise _BadRequest(str(e), None, 503) from None
    return events, handle, len(handle.prompt_ids)


async def _collect(events: asyncio.Queue, handle, request: Request):
    """Wait for the whole answer, aborting it if the client goes away: text, logprobs, reason, tokens.
    The client is asked about every ``DISCONNECT_POLL_S`` whether or not tokens keep coming."""
    pieces, lps, n = [], [], 0
    loop = asyncio.get_running_loop()
    ask_at = loop.time() + DISCONNECT_POLL_S
    while True:
        try:
            e = await asyncio.wait_for(events.get(), timeout=max(0.0, ask_at - loop.time()))
        except asyncio.TimeoutError:
            e = None
        if e is not None:
            n += e.token is not None
            pieces.append(e.piece or "")
            if e.logprob is not None:
                lps.append(e.logprob)
            if e.finish_reason == "error":
                raise _BadRequest(e.error or "the request failed", None, 500)
            if e.finish_reason is not None:
                return "".join(pieces), lps, e.finish_reason, n
        if loop.time() >= ask_at:
            if await request.is_disconnected():
                handle.abort()
                raise asyncio.CancelledError from None
            ask_at = loop.time() + DISCONNECT_POLL_S


def _sse(events: asyncio.Queue, handle, render) -> StreamingResponse:
    """Server-sent events: one ``data:`` line per event, ``render(event, first)`` (``first``: the answer's
    first chunk), then ``data: [DONE]``; a client that goes away (the response is cancelled) aborts the request."""

    async def body() -> AsyncIterator[str]:
        first, finished = True, False
        try:
            while not finished:
                e = await events.get()
                finished = e.finish_reason is not None
                if e.finish_reason == "error":
                    yield f"data: {json.dumps({'error': {'message': e.error, 'type': 'server_error'}})}\n\n"
                    break
                yield f"data: {json.dumps(render(e, first))}\n\n"
                first = False
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                handle.abort()

    return StreamingResponse(body(), media_type="text/event-stream")


def _one(e: Event) -> list[TokenLogprob]:
    return [e.logprob] if e.logprob is not None else []


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False) if tokenizer is not None else str(token)


def _completion_logprobs(lps: list[TokenLogprob], tokenizer, k: int | None) -> dict | None:
    """The legacy endpoint's logprobs: parallel lists of tokens, their logprobs and top-k dicts."""
    if k is None:
        return None
    return {"tokens": [_token_text(tokenizer, lp.token_id) for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{_token_text(tokenizer, t): v for t, v in lp.top} for lp in lps]}


def _chat_logprobs(lps: list[TokenLogprob], tokenizer) -> list[dict]:
    def entry(token: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]
