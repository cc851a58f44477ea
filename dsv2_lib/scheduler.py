"""Static and continuous batching over a paged KV cache: which requests run in each step, and where
their tokens' cache rows go.

The scheduler knows nothing of the model. Each ``schedule()`` returns one step of ``Work``; the
caller runs the model on it (``Scheduler.run`` takes that as a function) and reports the sampled
tokens and its own stop decisions (EOS, stop ids) to ``update``. Requests wait in FIFO order.

Modes: ``static`` admits a group of requests that fits and admits nothing more until the whole group
has finished; ``continuous`` admits whenever the pool allows, so a finished request's blocks go to the
next one at once. Admission: ``reserve`` (default) admits a request only if its worst case,
``prompt + max_tokens - 1`` tokens rounded up to blocks (less the blocks it shares from the prefix
cache), fits beside the worst cases of everything running, so an admitted request always finishes;
blocks are still allocated lazily, and a request that stops early never uses the rest of its
reservation. ``optimistic`` admits by current need and, when a running request cannot get a block,
preempts the most recently admitted one by recompute: its blocks are freed and it goes back to the
head of the queue with its generated tokens appended to its prompt, to be prefilled again later
(its full blocks usually still sit in the prefix cache). Scheduling never changes the tokens a
request produces; only when and beside whom it runs.

A step is all prefill or all decode (as ``SequenceBatch.decode`` expects): newly admitted requests
are prefilled, whole prompts at once, while the running ones pause; otherwise every running request
decodes one token.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .block_manager import BlockManager

MODES = ("static", "continuous")
ADMISSIONS = ("reserve", "optimistic")


@dataclass(eq=False)
class Request:
    """One generation request and its progress; steps count ``Scheduler.schedule`` calls from 0.

    ``output`` holds the generated tokens; at most ``max_tokens`` of them. ``admitted_step`` is the
    latest admission (a preempted request is admitted again); ``waited_steps`` counts the steps in
    which it sat in the queue; ``cached_tokens`` the prompt tokens found in the prefix cache, summed
    over admissions.
    """

    id: int
    prompt: list[int]
    max_tokens: int
    output: list[int] = field(default_factory=list)
    status: str = "waiting"  # waiting -> running -> finished; running -> waiting when preempted
    finish_reason: str | None = None  # "stop" (the caller's decision) or "length" (max_tokens reached)
    arrival_step: int = 0
    admitted_step: int | None = None
    finished_step: int | None = None
    waited_steps: int = 0
    cached_tokens: int = 0
    preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        """Prompt and generated tokens: what a (re)admission prefills."""
        return self.prompt + self.output

    @property
    def max_len(self) -> int:
        """The most tokens that ever get a cache row: ``prompt + max_tokens - 1`` (the last generated
        token is returned, never processed)."""
        return len(self.prompt) + self.max_tokens - 1


@dataclass(frozen=True)
class Work:
    """One request's part of a step: ``token_ids`` at absolute ``positions``, their cache rows written
    to ``slots``; attention reads positions ``0 .. positions[-1]`` through ``block_table``. One token is
    sampled from the last position. ``prefill``: the prompt (less its cached prefix); else one decode token.
    """

    request: Request
    token_ids: tuple[int, ...]
    positions: range
    slots: tuple[int, ...]
    block_table: tuple[int, ...]
    prefill: bool


@dataclass(frozen=True)
class SchedulerStats:
    """What a run did; blocks of ``block_size`` tokens. ``free_blocks`` is the count now (at the end
    of a run: the whole pool, unless something leaked)."""

    pool_blocks: int
    block_size: int
    steps: int
    peak_running: int  # most requests admitted at once
    max_decode_batch: int  # most requests in one decode step
    peak_used_blocks: int
    admission_waits: int  # steps spent in the queue, summed over requests
    free_blocks: int
    preemptions: int
    prefill_tokens: int  # tokens computed by prefills (recomputed ones after a preemption included)
    prefix_hit_tokens: int  # prompt tokens served from the prefix cache instead


class Scheduler:
    """FIFO admission by block budget, static or continuous, over a ``BlockManager``."""

    def __init__(self, blocks: BlockManager, mode: str = "continuous", admission: str = "reserve"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
        self.blocks, self.mode, self.admission = blocks, mode, admission
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.steps = 0
        self._next_id = 0
        self._unreported = False  # a step was scheduled and its tokens not yet given to update
        self._peak_running = self._max_decode = self._waits = self._preemptions = self._prefill_tokens = 0

    def add_request(self, prompt: Sequence[int], max_tokens: int) -> Request:
        """Queue a request; reject at once one whose worst case exceeds the whole pool (it could never run)."""
        if not prompt:
            raise ValueError("empty prompt: a request needs at least one token")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        r = Request(self._next_id, list(prompt), max_tokens, arrival_step=self.steps)
        need, pool = self.blocks.blocks_for_tokens(r.max_len), self.blocks.num_blocks
        if need > pool:
            raise ValueError(
                f"request {r.id} can never run: it needs up to {r.max_len} cached tokens (prompt {len(prompt)} "
                f"+ max_tokens {max_tokens} - 1) = {need} blocks of {self.blocks.block_size}, but the whole pool "
                f"has {pool} blocks ({pool * self.blocks.block_size} tokens); enlarge the cache or lower max_tokens"
            )
        self._next_id += 1
        self.waiting.append(r)
        return r

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Work]:
        """Plan the next step: the prefills of newly admitted requests if any, else a decode of all running ones."""
        if self._unreported:
            raise RuntimeError("the previous step's sampled tokens were not reported: call update(work, tokens, stops) first")
        self._unreported = True
        work = self._admit() or self._decode()
        for r in self.waiting:
            r.waited_steps += 1
        self._waits += len(self.waiting)
        self._peak_running = max(self._peak_running, len(self.running))
        if work and not work[0].prefill:
            self._max_decode = max(self._max_decode, len(work))
        self.steps += 1
        return work

    def update(self, work: Sequence[Work], tokens: Sequence[int], stops: Sequence[bool] | None = None) -> list[Request]:
        """Record one sampled token per work item; finish a request when the caller says ``stops[i]``
        or it reached ``max_tokens``. Returns the requests that finished."""
        stops = [False] * len(work) if stops is None else stops
        if not len(tokens) == len(stops) == len(work):
            raise ValueError(f"{len(work)} work items but {len(tokens)} tokens and {len(stops)} stop flags")
        self._unreported = False
        finished = []
        for w, token, stop in zip(work, tokens, stops):
            r = w.request
            r.output.append(token)
            if stop or len(r.output) >= r.max_tokens:
                r.status, r.finish_reason, r.finished_step = "finished", "stop" if stop else "length", self.steps - 1
                self.blocks.free(r.id)
                self.running.remove(r)
                finished.append(r)
        return finished

    def run(self, step: Callable[[list[Work]], tuple[Sequence[int], Sequence[bool]]]) -> list[Request]:
        """Schedule until every request has finished. ``step(work)`` runs the model and returns one
        sampled token per item and whether to stop that request. Returns the finished requests by id."""
        done = []
        while self.has_unfinished():
            work = self.schedule()
            done += self.update(work, *step(work))
        return sorted(done, key=lambda r: r.id)

    def stats(self) -> SchedulerStats:
        b = self.blocks.stats()
        return SchedulerStats(
            pool_blocks=b.num_blocks, block_size=b.block_size, steps=self.steps, peak_running=self._peak_running,
            max_decode_batch=self._max_decode, peak_used_blocks=b.peak_used_blocks, admission_waits=self._waits,
            free_blocks=b.free_blocks, preemptions=self._preemptions, prefill_tokens=self._prefill_tokens,
            prefix_hit_tokens=b.prefix_hit_tokens,
        )

    # ---- internals -----------------------------------------------------------------------------
    def _fits(self, r: Request) -> bool:
        """Whether the head of the queue may be admitted now."""
        bm = self.blocks
        if self.admission == "optimistic":
            return bm.blocks_to_admit(r.tokens, len(r.tokens)) <= bm.num_free_blocks
        # Blocks in use plus what every running request may still allocate, plus r's worst case.
        committed = bm.num_blocks - bm.num_free_blocks + sum(
            bm.blocks_needed(q.max_len - bm.num_tokens(q.id), q.id) for q in self.running
        )
        return committed + bm.blocks_to_admit(r.tokens, r.max_len) <= bm.num_blocks

    def _admit(self) -> list[Work]:
        """Admit from the head of the queue while requests fit (none behind a request that does not)."""
        if self.mode == "static" and self.running:
            return []
        work = []
        while self.waiting and self._fits(self.waiting[0]):
            r = self.waiting.popleft()
            cached = self.blocks.add_sequence(r.id, r.tokens)
            r.status, r.admitted_step, r.cached_tokens = "running", self.steps, r.cached_tokens + cached
            self.running.append(r)
            work.append(self._work(r, r.tokens[cached:], prefill=True))
            self._prefill_tokens += len(work[-1].token_ids)
        return work

    def _decode(self) -> list[Work]:
        """One token for every running request, oldest first; under optimistic admission, a request
        that needs a block when none is free preempts the newest (possibly itself). Under reserve
        admission a block is always there."""
        work = []
        for r in list(self.running):
            if r.status != "running":  # preempted just now to make room for an older request
                continue
            while not self.blocks.can_allocate(1, r.id):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is r:
                    break
            else:
                work.append(self._work(r, r.output[-1:], prefill=False))
        return work

    def _preempt(self, r: Request) -> None:
        """Recompute preemption: free r's blocks and queue it first, its output now part of what to prefill."""
        self.blocks.free(r.id)
        self.running.remove(r)
        r.status, r.preemptions = "waiting", r.preemptions + 1
        self._preemptions += 1
        self.waiting.appendleft(r)

    def _work(self, r: Request, token_ids: list[int], prefill: bool) -> Work:
        start = self.blocks.num_tokens(r.id)
        slots = self.blocks.append_slots(r.id, token_ids)
        return Work(r, tuple(token_ids), range(start, start + len(token_ids)), tuple(slots),
                    tuple(self.blocks.block_table(r.id)), prefill)
