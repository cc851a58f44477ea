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

Chunked prefill: ``max_num_batched_tokens`` caps the tokens one step computes (its activations, and so
its time). A step first gives one token to every decoding request (oldest first, within the budget),
then spends what is left on prompts: first the rest of the prompt of a request admitted earlier and
not yet fully prefilled, then new admissions (FIFO, by block budget as above), each getting a chunk of
at most the remaining budget. A long prompt is thus computed over several steps while the running
requests keep decoding beside it; only the step that computes a prompt's last token samples its first
generated token (``Work.samples``). A later chunk attends over the chunks before it, already in the
cache, exactly as a prefill after a prefix-cache hit does. A chunk's blocks are appended only when
the chunk is scheduled, so the prefix cache names (and offers) a block no earlier than the step whose
forward pass writes it; a request that shares it in that very step is itself a prefill of that step,
run in the same forward pass, which writes every row of a layer before attending (the engine runs a
step's decode items first, then its prefill items, so a block a decode item fills is written before
any prefill of that step reads it). ``None`` (no budget) keeps whole-prompt steps: a step is then the
prefills of the newly admitted requests, the running ones pausing, or else a decode of all of them.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dsv2_lib.engine.block_manager import PENDING, BlockManager

MODES = ("static", "continuous")
ADMISSIONS = ("reserve", "optimistic")


@dataclass(eq=False)
class Request:
    """One generation request and its progress; steps count ``Scheduler.schedule`` calls from 0.

    ``output`` holds the generated tokens; at most ``max_tokens`` of them. ``admitted_step`` is the
    latest admission (a preempted request is admitted again); ``waited_steps`` counts the steps in
    which it sat in the queue; ``cached_tokens`` the prompt tokens found in the prefix cache, summed
    over admissions. ``decoding``: the prefill of its current admission has been scheduled whole, so
    it brings one token per step.
    """

    id: int
    prompt: list[int]
    max_tokens: int
    output: list[int] = field(default_factory=list)
    status: str = "waiting"  # waiting -> running -> finished; running -> waiting when preempted
    finish_reason: str | None = None  # "stop" (the caller's decision), "length" (max_tokens reached) or "abort" (abort())
    arrival_step: int = 0
    admitted_step: int | None = None
    finished_step: int | None = None
    waited_steps: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    decoding: bool = False

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
    to ``slots``; attention reads positions ``0 .. positions[-1]`` through ``block_table``. ``prefill``:
    a chunk of the prompt (less its cached prefix), else one decode token. ``samples``: one token is
    sampled from the last position (a decode token, or a prompt's last chunk).
    """

    request: Request
    token_ids: tuple[int, ...]
    positions: range
    slots: tuple[int, ...]
    block_table: tuple[int, ...]
    prefill: bool
    samples: bool


@dataclass(frozen=True)
class SchedulerStats:
    """What a run did; blocks of ``block_size`` tokens. ``free_blocks`` is the count now (at the end
    of a run: the whole pool, unless something leaked)."""

    pool_blocks: int
    block_size: int
    steps: int
    peak_running: int  # most requests admitted at once
    max_decode_batch: int  # most requests decoding in one step
    peak_used_blocks: int
    admission_waits: int  # steps spent in the queue, summed over requests
    free_blocks: int
    preemptions: int
    prefill_tokens: int  # tokens computed by prefills (recomputed ones after a preemption included)
    prefix_hit_tokens: int  # prompt tokens served from the prefix cache instead
    prefill_chunks: int  # prefill work items (one per admission when no prompt is chunked)
    max_step_tokens: int  # most tokens computed in one step (at most max_num_batched_tokens)


class Scheduler:
    """FIFO admission by block budget, static or continuous, over a ``BlockManager``; at most
    ``max_num_batched_tokens`` tokens per step (None: no limit, prompts prefilled whole)."""

    def __init__(self, blocks: BlockManager, mode: str = "continuous", admission: str = "reserve",
                 max_num_batched_tokens: int | None = 8192):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
        self.check_budget(max_num_batched_tokens)
        self.blocks, self.mode, self.admission = blocks, mode, admission
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.steps = 0
        self._next_id = 0
        self._unreported = False  # a step was scheduled and its tokens not yet given to update
        self._releasing: dict[int, Request] = {}  # finished, blocks kept until resolve fills their PENDING tokens
        self._budget = 0  # tokens the step being scheduled may still take
        self._peak_running = self._max_decode = self._waits = self._preemptions = self._prefill_tokens = 0
        self._chunks = self._max_step = 0

    @staticmethod
    def check_budget(max_num_batched_tokens: int | None) -> None:
        """Refuse a per-step token budget that is not an int >= 1 or None (no budget)."""
        n = max_num_batched_tokens
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"max_num_batched_tokens must be an int >= 1 (tokens per step) or None (no limit), got {n!r}")

    def add_request(self, prompt: Sequence[int], max_tokens: int) -> Request:
        """Queue a request; reject at once one whose worst case exceeds the whole pool (it could never run)."""
        if not prompt:
            raise ValueError("empty prompt: a request needs at least one token")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        r = Request(self._next_id, list(prompt), max_tokens, arrival_step=self.steps)
        self._next_id += 1  # a refused request keeps its id: ids stay the order of add_request calls
        if problem := self.never_fits(len(prompt), max_tokens):
            raise ValueError(f"request {r.id} {problem}")
        self.waiting.append(r)
        return r

    def never_fits(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why a request of this size can never run (its worst case exceeds the whole pool), or None."""
        need_tokens = prompt_len + max_tokens - 1
        need, pool = self.blocks.blocks_for_tokens(need_tokens), self.blocks.num_blocks
        if need <= pool:
            return None
        return (f"can never run: it needs up to {need_tokens} cached tokens (prompt {prompt_len} + max_tokens "
                f"{max_tokens} - 1) = {need} blocks of {self.blocks.block_size}, but the whole pool has {pool} blocks "
                f"({pool * self.blocks.block_size} tokens); enlarge the cache or lower max_tokens")

    def abort(self, r: Request) -> None:
        """Cancel a request (its client went away): it leaves the queue, or finishes now with reason
        ``"abort"`` and its blocks go back to the pool. One step ahead, the token a launched step still
        owes it is dropped when that step resolves (its placeholder is cut here). Between steps only."""
        if r.status == "waiting":
            self.waiting.remove(r)
        elif r.status == "running":
            while r.output and r.output[-1] == PENDING:
                r.output.pop()
            self._finish(r)
        else:
            return  # finished already
        r.status, r.finish_reason, r.finished_step = "finished", "abort", self.steps - 1

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Work]:
        """Plan the next step: with a budget, one token for each decoding request, then prompt chunks in
        what is left; without one, the prefills of newly admitted requests if any, else a decode of all."""
        if self._unreported:
            raise RuntimeError("the previous step's sampled tokens were not reported: call update(work, tokens, stops) first")
        self._unreported = True
        if self.max_num_batched_tokens is None:
            self._budget = math.inf
            work = self._prefill([]) or self._decode([])
        else:
            self._budget = self.max_num_batched_tokens
            work = self._prefill(self._decode([]))
        for r in self.waiting:
            r.waited_steps += 1
        self._waits += len(self.waiting)
        self._peak_running = max(self._peak_running, len(self.running))
        self._max_decode = max(self._max_decode, sum(not w.prefill for w in work))
        self._max_step = max(self._max_step, sum(len(w.token_ids) for w in work))
        self._prefill_tokens += sum(len(w.token_ids) for w in work if w.prefill)
        self._chunks += sum(w.prefill for w in work)
        self.steps += 1
        return work

    def update(self, work: Sequence[Work], tokens: Sequence[int], stops: Sequence[bool] | None = None) -> list[Request]:
        """Record one sampled token per work item that samples (``w.samples``, in work order); finish a
        request when the caller says ``stops[i]`` or it reached ``max_tokens``. Returns the requests that finished."""
        sampled = [w for w in work if w.samples]
        stops = [False] * len(sampled) if stops is None else stops
        if not len(tokens) == len(stops) == len(sampled):
            raise ValueError(f"{len(sampled)} work items sample a token but got {len(tokens)} tokens "
                             f"and {len(stops)} stop flags")
        self._unreported = False
        finished = []
        for w, token, stop in zip(sampled, tokens, stops):
            r = w.request
            r.output.append(token)
            if stop or len(r.output) >= r.max_tokens:
                r.finish_reason, r.finished_step = "stop" if stop else "length", self.steps - 1
                self._finish(r)
                finished.append(r)
        return finished

    def resolve(self, work: Sequence[Work], tokens: Sequence[int], stops: Sequence[bool],
                step: int) -> tuple[list[tuple[Request, int, bool]], list[Request]]:
        """For an engine one step ahead of the GPU: ``update`` got ``PENDING`` for the tokens of ``work``
        (scheduled at ``step``), finishing only requests that reached ``max_tokens``; here are the tokens
        and the stop decisions. Each token replaces its placeholder (in the request's output and, where
        a later step already gave it a slot, in the block manager, which names blocks once they are
        known; a request ``update`` finished at ``max_tokens`` keeps its blocks until then). A request
        stopped here may already have work in the step after: its output is cut after the stop token,
        and that later token is dropped when its step resolves.

        Returns the tokens to report, ``(request, token, last)`` per item not dropped (``last``: the
        request's final token), and the requests finished here."""
        sampled = [w for w in work if w.samples]
        if not len(tokens) == len(stops) == len(sampled):
            raise ValueError(f"{len(sampled)} work items sample a token but got {len(tokens)} tokens "
                             f"and {len(stops)} stop flags")
        report, finished = [], []
        for w, token, stop in zip(sampled, tokens, stops):
            r, pos = w.request, w.positions[-1] + 1  # the token's absolute position
            i = pos - len(r.prompt)  # its index in r.output
            if i >= len(r.output) or r.output[i] != PENDING:
                continue  # r stopped at an earlier step: this token was never to be produced
            r.output[i] = token
            if (r.status == "running" or r.id in self._releasing) and self.blocks.num_tokens(r.id) > pos:
                self.blocks.set_token(r.id, pos, token)
            if stop:
                del r.output[i + 1:]
                r.finish_reason, r.finished_step = "stop", step
                if r.status == "running":  # else finished already: it reached max_tokens in the step after
                    self._finish(r)
                    finished.append(r)
            report.append((r, token, r.status == "finished" and i == len(r.output) - 1))
        for r in [r for r in self._releasing.values() if not self.blocks.has_pending(r.id)]:
            del self._releasing[r.id]
            self.blocks.free(r.id)
        return report, finished

    def run(self, step: Callable[[list[Work]], tuple[Sequence[int], Sequence[bool]]]) -> list[Request]:
        """Schedule until every request has finished. ``step(work)`` runs the model and returns one
        sampled token per item that samples and whether to stop that request. Returns the finished requests by id."""
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
            prefix_hit_tokens=b.prefix_hit_tokens, prefill_chunks=self._chunks, max_step_tokens=self._max_step,
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

    def _decode(self, work: list[Work]) -> list[Work]:
        """Add one token for every decoding request, oldest first, while the budget lasts; returns ``work``."""
        for r in list(self.running):
            if self._budget < 1:
                break
            if r.status == "running" and r.decoding and self._make_room(r, 1):
                work.append(self._work(r, 1))
        return work

    def _prefill(self, work: list[Work]) -> list[Work]:
        """Spend the rest of the budget on prompts: first continue a partial prefill, then admit from the
        head of the queue while requests fit (none behind a request that does not), each getting a chunk
        of at most the budget left; returns ``work``. Static mode admits only into an empty batch."""
        for r in [q for q in self.running if not q.decoding]:  # at most one, the newest (see _make_room)
            n = min(len(r.tokens) - self.blocks.num_tokens(r.id), self._budget)
            if n >= 1 and self._make_room(r, n):
                work.append(self._work(r, n))
        if self.mode == "static" and self.running:
            return work
        while self.waiting and self._budget >= 1 and self._fits(self.waiting[0]):
            r = self.waiting.popleft()
            cached = self.blocks.add_sequence(r.id, r.tokens)
            r.status, r.admitted_step, r.cached_tokens, r.decoding = "running", self.steps, r.cached_tokens + cached, False
            self.running.append(r)
            work.append(self._work(r, min(len(r.tokens) - cached, self._budget)))
        return work

    def _make_room(self, r: Request, n: int) -> bool:
        """Whether ``n`` more tokens of r get their blocks now. When the pool is short (only under
        optimistic admission; reserve keeps a block for every admitted token), preempt the most recently
        admitted requests until they do; False when r itself had to go.

        No victim already has work in this step: decodes are planned oldest first, and a prompt is cut
        only where the budget runs out, after which nothing is admitted, so the one request partly
        prefilled is the newest and its chunk comes after every decode."""
        while not self.blocks.can_allocate(n, r.id):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is r:
                return False
        return True

    def _finish(self, r: Request) -> None:
        """A running request is done: its blocks go back to the pool (named ones stay cached). One step
        ahead, ``update`` finishes a request at ``max_tokens`` while the token its last step fed is still
        ``PENDING``; its blocks then go back once :meth:`resolve` has filled that token in, so that a block
        the token completes is named and cached, as it is when the engine runs in step."""
        r.status = "finished"
        self.running.remove(r)
        if self.blocks.has_pending(r.id):
            self._releasing[r.id] = r
        else:
            self.blocks.free(r.id)

    def _preempt(self, r: Request) -> None:
        """Recompute preemption: free r's blocks and queue it first, its output now part of what to prefill."""
        self.blocks.free(r.id)
        self.running.remove(r)
        r.status, r.preemptions = "waiting", r.preemptions + 1
        self._preemptions += 1
        self.waiting.appendleft(r)

    def _work(self, r: Request, n: int) -> Work:
        """The next ``n`` tokens of r (its last output token when decoding), their slots appended now."""
        start, prefill = self.blocks.num_tokens(r.id), not r.decoding
        token_ids = r.tokens[start:start + n] if prefill else r.output[-1:]
        slots = self.blocks.append_slots(r.id, token_ids)
        samples = start + n == len(r.prompt) + len(r.output)
        r.decoding = samples
        self._budget -= n
        return Work(r, tuple(token_ids), range(start, start + n), tuple(slots),
                    tuple(self.blocks.block_table(r.id)), prefill, samples)
