"""The serving loop: schedule a step, run the model on it, sample, decide stops, report the tokens.

A :class:`StepLoop` serves requests on one scheduler and one cache. :meth:`StepLoop.add` queues a
request at any time (between steps), :meth:`StepLoop.abort` cancels one, and each call of
:meth:`StepLoop.step` advances the whole batch by one scheduler step and returns the tokens it
produced. ``LLM.generate`` adds its prompts and steps until nothing is left; the live engine
(:mod:`~dsv2_lib.engine.live_engine`) keeps adding requests while it steps, so requests that arrive
at different times share the same continuous batch.

Two ways to step. In step: run step t, read its tokens back (the host waits), plan t+1. One step
ahead (``async_scheduling``): step t+1 is planned and launched, its decode tokens gathered on the
GPU from step t's picks, before the host reads step t's tokens back; so the GPU runs step t+1 while
the host resolves step t (stop checks, text, the reports) and plans step t+2. A request that stops
at step t has already been given a token in step t+1: that token is dropped
(:meth:`Scheduler.resolve <dsv2_lib.engine.scheduler.Scheduler.resolve>`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv2_lib.core.tokenizer import Tokenizer
from dsv2_lib.engine.block_manager import PENDING
from dsv2_lib.engine.model_runner import ModelRunner
from dsv2_lib.engine.request_state import RequestState, TokenLogprob
from dsv2_lib.engine.sampling import SamplingParams, sample_rows_on_device
from dsv2_lib.engine.scheduler import Request, Scheduler, Work
from dsv2_lib.engine.step_trace import StepTrace
from dsv2_lib.model.cache import PagedLatentCache


@dataclass
class _Launched:
    """A step whose picks are still on their way to the host (one step ahead)."""

    step: int
    sampled: list[Work]
    picks: torch.Tensor  # [len(sampled)] on the device: the next step gathers its decode tokens from it
    host: list[torch.Tensor]  # picks (and logprob tensors), copied without waiting into host memory
    done: torch.cuda.Event | None


class StepLoop:
    """Requests served on ``scheduler`` and ``cache`` by ``runner``; ``ahead``: one step ahead of the GPU
    (needs ``admission="reserve"``, whose requests are never preempted). ``eos``: the ids that end a
    request unless it ignores EOS. ``trace``: a :class:`StepTrace` that records each step."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, cache: PagedLatentCache,
                 tokenizer: Tokenizer | None, eos: tuple[int, ...], ahead: bool, trace: StepTrace | None = None):
        if ahead and scheduler.admission != "reserve":
            raise ValueError("one step ahead needs admission='reserve' (a preempted request's pending token "
                             "could not be recomputed)")
        self.runner, self.sched, self.cache, self.tokenizer, self.eos = runner, scheduler, cache, tokenizer, eos
        self.ahead, self.trace = ahead, trace
        self.states: dict[int, RequestState] = {}
        self.requests: dict[int, Request] = {}
        self.generated = 0
        self._generators: dict[int, torch.Generator | None] = {}
        self._pending: _Launched | None = None
        self._retiring: list[int] = []  # finished during this step() call: forgotten at the end of the next
        self._finished_now: list[int] = []

    def add(self, prompt: list[int], params: SamplingParams, max_tokens: int, incremental: bool = False) -> RequestState:
        """Queue a request of ``max_tokens`` at most; its state follows its progress. A request larger than
        the whole cache is finished at once with reason ``"error"``, its state saying why."""
        state = RequestState(prompt, params, self.tokenizer, self.eos, incremental)
        try:
            r = self.sched.add_request(prompt, max_tokens)
        except ValueError as e:
            state.out.error = str(e)
            state.finish("error")
            return state
        state.request_id = r.id
        self.states[r.id], self.requests[r.id] = state, r
        self._generators[r.id] = params.generator(self.runner.engine_config.device)
        if self.trace is not None:
            self.trace.added(r)
        return state

    def abort(self, state: RequestState) -> None:
        """Cancel a request (between steps): its blocks go back to the pool, its state ends ``"abort"``."""
        if state.finished:
            return
        r = self.requests[state.request_id]
        self.sched.abort(r)
        self._finish(r)

    def has_work(self) -> bool:
        return self.sched.has_unfinished() or self._pending is not None

    def step(self) -> list[tuple[RequestState, int]]:
        """Advance by one step: the tokens reported, ``(state, token)`` in the order produced; a state whose
        token was its last is ``finished``. A finished request is forgotten one call later (one step
        ahead, the step in flight may still carry a token for it, to be dropped)."""
        reports = self._step_ahead() if self.ahead else self._step_in_step()
        for rid in self._retiring:
            del self.states[rid], self.requests[rid]
        self._retiring, self._finished_now = self._finished_now, []
        return reports

    # ---- the two ways to step ---------------------------------------------------------------------
    def _step_in_step(self) -> list[tuple[RequestState, int]]:
        if not self.sched.has_unfinished():
            return []
        work = self.sched.schedule()
        sampled = [w for w in work if w.samples]
        logits = self.runner.step(work, self.cache) if work else None
        host = [t.cpu() for t in self._sample(logits, sampled)] if sampled else []
        tokens = host[0].tolist() if host else []
        stops = self._accept(sampled, tokens, host[1:])
        self._record(work)
        for r in self.sched.update(work, tokens, stops):
            self._finish(r)
        return [(self.states[w.request.id], t) for w, t in zip(sampled, tokens)]

    def _step_ahead(self) -> list[tuple[RequestState, int]]:
        launched = None
        if self.sched.has_unfinished():
            work = self.sched.schedule()
            step, sampled = self.sched.steps - 1, [w for w in work if w.samples]
            p = self._pending
            earlier = None if p is None else (p.picks, {w.request.id: i for i, w in enumerate(p.sampled)})
            logits = self.runner.step(work, self.cache, earlier) if work else None
            if sampled:
                on_device = self._sample(logits, sampled)
                host = [torch.empty_like(t, device="cpu", pin_memory=t.is_cuda) for t in on_device]
                for h, t in zip(host, on_device):
                    h.copy_(t, non_blocking=True)
                done = torch.cuda.Event() if on_device[0].is_cuda else None
                if done is not None:
                    done.record()
                launched = _Launched(step, sampled, on_device[0], host, done)
            self._record(work)
            self.sched.update(work, [PENDING] * len(sampled), [False] * len(sampled))
        reports = []
        if self._pending is not None:
            p = self._pending
            if p.done is not None:
                p.done.synchronize()  # this step only: the one launched above keeps running
            tokens = p.host[0].tolist()
            stops = self._accept(p.sampled, tokens, p.host[1:])
            report, _ = self.sched.resolve(p.sampled, tokens, stops, p.step)
            for r, t, last in report:
                if last:
                    self._finish(r)
                reports.append((self.states[r.id], t))
        self._pending = launched
        return reports

    # ---- parts of a step ---------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, sampled: list[Work]) -> list[torch.Tensor]:
        """The picks ``[B]`` of the sampled rows, and when any asks for logprobs the chosen token's ``[B]`` and
        the top k's, values and ids ``[B, k]`` (k: the most any row asks for), all on the device."""
        params = [self.states[w.request.id].params for w in sampled]
        picks = sample_rows_on_device(logits, params, [self._generators[w.request.id] for w in sampled])
        k = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if k is None:
            return [picks]
        lp = logits.float().log_softmax(-1)  # the raw distribution: no temperature, no cuts
        top = lp.topk(k, dim=-1)
        return [picks, lp.gather(1, picks[:, None])[:, 0], top.values, top.indices]

    def _accept(self, sampled: list[Work], tokens: list[int], logprobs: list[torch.Tensor]) -> list[bool]:
        """Give each sampled token to its request's state (unless it ended at an earlier step, one step
        ahead); whether each stops its request."""
        chosen, values, ids = (t.tolist() for t in logprobs) if logprobs else (None, None, None)
        stops = []
        for i, (w, t) in enumerate(zip(sampled, tokens)):
            state = self.states[w.request.id]
            if state.finished:
                stops.append(False)
                continue
            lp = None
            if chosen is not None and state.params.logprobs is not None:
                k = state.params.logprobs
                lp = TokenLogprob(t, chosen[i], tuple(zip(ids[i][:k], values[i][:k])))
            self.generated += 1
            stops.append(state.add(t, lp))
        return stops

    def _finish(self, r: Request) -> None:
        state = self.states[r.id]
        if not state.finished:
            state.finish(r.finish_reason)
            if self.trace is not None:
                self.trace.finished(r)
        del self._generators[r.id]
        self._finished_now.append(r.id)

    def _record(self, work: list[Work]) -> None:
        if self.trace is not None:
            self.trace.step(self.sched, work, self.runner.last_graph)
