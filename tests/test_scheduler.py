"""The batching scheduler (CPU, pure Python) driven by a fake model: FIFO admission by block budget,
static vs continuous timelines step by step, rejection of a request larger than the pool, early
stops, prefix sharing, optimistic admission with preemption by recompute, statistics, and the
property that scheduling never changes what a request generates. These tests run without a token
budget (``max_num_batched_tokens=None``: whole prompts, a step all prefill or all decode); chunked
prefill under a budget is tested in test_scheduler_chunked.py, and the property test covers both."""
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv2_lib.engine.block_manager import PENDING, BlockManager
from dsv2_lib.engine.scheduler import Scheduler, Work

VOCAB, EOS = 20, 0


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of the whole context."""
    h = 0
    for t in context:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


def reference(prompt: list[int], max_tokens: int, eos: int | None) -> list[int]:
    """What a request generates when run alone, without any cache."""
    out = []
    while len(out) < max_tokens and (not out or out[-1] != eos):
        out.append(next_token(prompt + out))
    return out


class FakeModel:
    """A step function over a fake paged cache: writes every work item's rows (slot -> (position, token))
    first, then reads each context back through its block table, as the engine writes, then attends.
    A wrong slot, a block shared by mistake or a cached block overwritten while in use would change
    the context, so the test asserts it equals the request's tokens before predicting. Returns a token
    for each item that samples."""

    def __init__(self, block_size: int, eos: int | None = EOS):
        self.bs, self.eos, self.rows, self.log = block_size, eos, {}, []

    def __call__(self, work: list[Work], earlier: dict[int, int] | None = None) -> tuple[list[int], list[bool]]:
        """``earlier``: request id -> the token it sampled in the step before, for tokens the scheduler
        still holds as PENDING (an engine one step ahead gathers them on the GPU)."""
        known = lambda r, t: earlier[r.id] if t == PENDING else t  # noqa: E731
        self.log.append(work)
        for w in work:
            for pos, tok, slot in zip(w.positions, w.token_ids, w.slots):
                self.rows[slot] = (pos, known(w.request, tok))
        tokens = []
        for w in work:
            n = w.positions[-1] + 1
            context = [self.rows[w.block_table[p // self.bs] * self.bs + p % self.bs] for p in range(n)]
            assert context == [(p, known(w.request, t)) for p, t in enumerate(w.request.tokens[:n])]
            if w.samples:
                tokens.append(next_token([t for _, t in context]))
        return tokens, [t == self.eos for t in tokens]

    def timeline(self) -> list[str]:
        """One line per step: ``P`` prefill or ``D`` decode, then the request ids."""
        return [("P " if w[0].prefill else "D ") + "".join("ABCDEFGH"[x.request.id] for x in w) for w in self.log]


def make(num_blocks, block_size=4, mode="continuous", admission="reserve", prefix_caching=True, budget=None):
    bm = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
    return Scheduler(bm, mode, admission, budget), FakeModel(block_size, eos=None)


# A handcrafted workload, block size 4: (prompt, max_tokens) -> worst case prompt + max_tokens - 1 tokens.
WORKLOAD = [
    ([1, 2, 3, 4], 5),  # A: 8 tokens, 2 blocks
    ([5, 6, 7], 2),  # B: 4 tokens, 1 block
    ([8, 9, 10, 11, 12, 13], 7),  # C: 12 tokens, 3 blocks
    ([14, 15], 3),  # D: 4 tokens, 1 block
    ([16, 17, 18, 19, 1], 4),  # E: 8 tokens, 2 blocks
]


def test_static_batching_runs_a_group_to_the_end_before_the_next():
    sched, model = make(6, mode="static")
    reqs = [sched.add_request(p, m) for p, m in WORKLOAD]
    done = sched.run(model)
    # A + B + C reserve 6 blocks: D waits for the whole group, although B leaves after step 1.
    assert model.timeline() == [
        "P ABC", "D ABC", "D AC", "D AC", "D AC", "D C", "D C",
        "P DE", "D DE", "D DE", "D E",
    ]
    assert [(r.admitted_step, r.finished_step, r.waited_steps) for r in reqs] == [
        (0, 4, 0), (0, 1, 0), (0, 6, 0), (7, 9, 7), (7, 10, 7),
    ]
    assert done == reqs and all(r.finish_reason == "length" and r.status == "finished" for r in reqs)
    assert [r.output for r in reqs] == [reference(p, m, None) for p, m in WORKLOAD]
    s = sched.stats()
    assert (s.pool_blocks, s.block_size, s.steps, s.peak_running, s.max_decode_batch) == (6, 4, 11, 3, 3)
    assert (s.peak_used_blocks, s.admission_waits, s.free_blocks, s.preemptions) == (5, 14, 6, 0)
    assert (s.prefill_tokens, s.prefix_hit_tokens) == (20, 0)


def test_continuous_batching_admits_as_soon_as_the_budget_allows():
    sched, model = make(6, mode="continuous")
    reqs = [sched.add_request(p, m) for p, m in WORKLOAD]
    sched.run(model)
    # Step 2: B has finished; A (2 blocks, all allocated) and C (2 of 3) leave 1 block: D fits, E (2) waits
    # and, FIFO, holds up nothing behind it. Step 6: A has finished: E fits beside C.
    assert model.timeline() == [
        "P ABC", "D ABC", "P D", "D ACD", "D ACD", "D AC", "P E", "D CE", "D CE", "D E",
    ]
    assert [(r.admitted_step, r.finished_step, r.waited_steps) for r in reqs] == [
        (0, 5, 0), (0, 1, 0), (0, 8, 0), (2, 4, 2), (6, 9, 6),
    ]
    assert [r.output for r in reqs] == [reference(p, m, None) for p, m in WORKLOAD]
    s = sched.stats()
    assert (s.steps, s.peak_running, s.max_decode_batch, s.peak_used_blocks) == (10, 3, 3, 6)
    assert (s.admission_waits, s.free_blocks, s.preemptions, s.prefill_tokens) == (8, 6, 0, 20)


def test_fifo_a_request_that_does_not_fit_holds_up_the_ones_behind_it():
    sched, model = make(4)
    a = sched.add_request([1, 2, 3, 4, 5], 8)  # 12 tokens: 3 blocks
    b = sched.add_request([6, 7, 8, 9], 4)  # 2 blocks: does not fit beside a
    c = sched.add_request([10], 2)  # 1 block: would fit, but must not overtake b
    work = sched.schedule()
    assert [w.request for w in work] == [a] and list(sched.waiting) == [b, c]
    with pytest.raises(RuntimeError, match="the previous step's sampled tokens were not reported"):
        sched.schedule()
    sched.update(work, *model(work))
    sched.run(model)
    assert (a.finished_step, b.admitted_step, c.admitted_step) == (7, 8, 8)
    assert model.timeline()[8] == "P BC"


def test_a_request_larger_than_the_pool_is_rejected_at_once():
    sched, _ = make(2)
    with pytest.raises(ValueError, match=re.escape(
            "request 0 can never run: it needs up to 9 cached tokens (prompt 5 + max_tokens 5 - 1) = 3 blocks "
            "of 4, but the whole pool has 2 blocks (8 tokens); enlarge the cache or lower max_tokens")):
        sched.add_request([1, 2, 3, 4, 5], 5)
    assert not sched.has_unfinished()
    r = sched.add_request([1, 2, 3, 4, 5], 4)  # exactly the pool: accepted; ids follow the calls, refused ones too
    assert r.id == 1 and r.max_len == 8


@pytest.mark.parametrize("prompt, max_tokens, message", [
    ([], 4, "empty prompt"),
    ([1], 0, "max_tokens must be an int >= 1, got 0"),
    ([1], 2.0, "max_tokens must be an int >= 1, got 2.0"),
    ([1], True, "max_tokens must be an int >= 1, got True"),
])
def test_bad_requests(prompt, max_tokens, message):
    sched, _ = make(2)
    with pytest.raises(ValueError, match=re.escape(message)):
        sched.add_request(prompt, max_tokens)


def test_bad_arguments():
    bm = BlockManager(2)
    with pytest.raises(ValueError, match="mode must be one of"):
        Scheduler(bm, mode="dynamic")
    with pytest.raises(ValueError, match="admission must be one of"):
        Scheduler(bm, admission="greedy")
    for bad in (0, -3, 2.5, True, "16"):
        with pytest.raises(ValueError, match=re.escape(
                f"max_num_batched_tokens must be an int >= 1 (tokens per step) or None (no limit), got {bad!r}")):
            Scheduler(bm, max_num_batched_tokens=bad)
    sched = Scheduler(bm)
    sched.add_request([1], 3)
    work = sched.schedule()
    with pytest.raises(ValueError, match="1 work items sample a token but got 2 tokens and 2 stop flags"):
        sched.update(work, [1, 2], [False, False])


def test_an_early_stop_returns_blocks_and_reservation_at_once():
    sched, _ = make(2, budget=8192)  # the default budget: no prompt here is chunked
    a = sched.add_request([1, 2, 3, 4], 5)  # reserves both blocks
    b = sched.add_request([5], 2)
    work = sched.schedule()
    assert [w.request for w in work] == [a]
    sched.update(work, [3], [False])
    work = sched.schedule()
    assert [(w.request, w.token_ids, w.positions, w.slots, w.prefill, w.samples) for w in work] == [
        (a, (3,), range(4, 5), (4,), False, True)  # a's 5th token starts block 1
    ]
    assert sched.update(work, [EOS], [True]) == [a]  # the caller's stop, long before max_tokens
    assert (a.output, a.finish_reason, a.finished_step) == ([3, EOS], "stop", 1)
    assert sched.blocks.num_free_blocks == 2
    work = sched.schedule()
    assert [w.request for w in work] == [b] and b.waited_steps == 2


def test_prompts_sharing_a_prefix_are_prefilled_once():
    """A 9-token system prompt shared by three requests admitted in the same step: the second and third
    point at the first's two full blocks, which are filled in that very step."""
    system = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    prompts = [system + [10 + i, 11 + i] for i in range(3)]
    sched, model = make(12)
    reqs = [sched.add_request(p, 4) for p in prompts]
    work = sched.schedule()
    assert [(w.positions, w.block_table) for w in work] == [
        (range(0, 11), (0, 1, 2)), (range(8, 11), (0, 1, 3)), (range(8, 11), (0, 1, 4)),
    ]
    sched.update(work, *model(work))
    sched.run(model)
    assert [r.output for r in reqs] == [reference(p, 4, None) for p in prompts]
    assert [r.cached_tokens for r in reqs] == [0, 8, 8]
    s = sched.stats()
    assert (s.prefill_tokens, s.prefix_hit_tokens, s.peak_used_blocks) == (17, 16, 8)


def test_shared_prefix_blocks_lower_the_admission_cost():
    # Each request alone reserves 3 blocks (8 + 1 prompt + 4 - 1 = 12 tokens); 3 + 3 > 5, but the second
    # shares the first's 2 full blocks, so it costs 1 and both run at once.
    prompts = [[1] * 8 + [2], [1] * 8 + [3]]
    for caching, timeline in [(True, ["P AB", "D AB", "D AB", "D AB"]),
                              (False, ["P A", "D A", "D A", "D A", "P B", "D B", "D B", "D B"])]:
        sched, model = make(5, prefix_caching=caching)
        reqs = [sched.add_request(p, 4) for p in prompts]
        sched.run(model)
        assert model.timeline() == timeline
        assert [r.output for r in reqs] == [reference(p, 4, None) for p in prompts]


def test_optimistic_admission_preempts_the_newest_and_recomputes_it():
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]  # each grows to 8 tokens = 2 blocks; the pool has 3
    timelines = {}
    for admission in ["reserve", "optimistic"]:
        sched, model = make(3, admission=admission)
        rx, ry = sched.add_request(x, 5), sched.add_request(y, 5)
        sched.run(model)
        timelines[admission] = model.timeline()
        assert [rx.output, ry.output] == [reference(x, 5, None), reference(y, 5, None)]
        assert sched.stats().free_blocks == 3
    # reserve: y waits for all of x.
    assert timelines["reserve"] == ["P A", "D A", "D A", "D A", "D A", "P B", "D B", "D B", "D B", "D B"]
    # optimistic: both start; at step 1 both cross into a second block, one is free: x (older) takes it,
    # y is preempted. y is readmitted when x leaves, its first block still cached, and recomputes only
    # the token it had generated: a 1-token prefill at position 4.
    assert timelines["optimistic"] == ["P AB", "D A", "D A", "D A", "D A", "P B", "D B", "D B", "D B"]
    assert [(w.positions, w.token_ids) for w in model.log[5]] == [(range(4, 5), (ry.output[0],))]
    assert (ry.preemptions, ry.admitted_step, ry.cached_tokens, ry.waited_steps) == (1, 5, 4, 4)
    s = sched.stats()
    assert (s.preemptions, s.prefill_tokens, s.prefix_hit_tokens, s.peak_running, s.peak_used_blocks) == (1, 9, 4, 2, 3)


def test_preemption_without_prefix_cache_recomputes_everything():
    sched, model = make(3, admission="optimistic", prefix_caching=False)
    reqs = [sched.add_request([1, 2, 3, 4], 5), sched.add_request([5, 6, 7, 8], 5)]
    sched.run(model)
    assert model.timeline()[5] == "P B" and model.log[5][0].positions == range(0, 5)
    assert [r.output for r in reqs] == [reference([1, 2, 3, 4], 5, None), reference([5, 6, 7, 8], 5, None)]
    assert (sched.stats().prefill_tokens, sched.stats().preemptions) == (13, 1)


# ---- scheduling never changes results ----------------------------------------------------------

PREFIXES = [[], [7, 7, 7, 7, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]


# Workloads of up to 8 requests (prompts sharing prefixes, 1-10 tokens each), pools from the smallest that
# can serve them up, every mode and per-step budget.
WORKLOAD_STRATEGIES = dict(
    requests=st.lists(
        st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6),
                  st.integers(1, 10)),
        min_size=1, max_size=8),
    block_size=st.integers(1, 4),
    extra_blocks=st.integers(0, 8),
    mode=st.sampled_from(["static", "continuous"]),
    prefix_caching=st.booleans(),
    budget=st.sampled_from([None, 1, 2, 3, 5, 8, 8192]),
)


def serve(requests, block_size, extra_blocks, mode, admission, prefix_caching, budget):
    """A scheduler over the smallest pool that can serve ``requests`` plus ``extra_blocks``, the requests
    added: (scheduler, requests, prompts, pool size)."""
    prompts = [prefix + suffix for prefix, suffix, _ in requests]
    max_len = max(len(p) + m - 1 for p, (_, _, m) in zip(prompts, requests))
    num_blocks = -(-max_len // block_size) + extra_blocks
    sched = Scheduler(BlockManager(num_blocks, block_size, prefix_caching), mode, admission, budget)
    return sched, [sched.add_request(p, m) for p, (_, _, m) in zip(prompts, requests)], prompts, num_blocks


@settings(max_examples=120, deadline=None)
@given(**WORKLOAD_STRATEGIES, admission=st.sampled_from(["reserve", "optimistic"]))
def test_any_mode_pool_and_budget_that_can_serve_gives_the_same_tokens(
        requests, block_size, extra_blocks, mode, admission, prefix_caching, budget):
    sched, reqs, prompts, num_blocks = serve(requests, block_size, extra_blocks, mode, admission, prefix_caching, budget)
    model = FakeModel(block_size)
    assert sched.run(model) == reqs
    assert [r.output for r in reqs] == [reference(p, m, EOS) for p, (_, _, m) in zip(prompts, requests)]
    assert all(r.finish_reason == ("stop" if r.output[-1] == EOS else "length") for r in reqs)
    s = sched.stats()
    assert s.free_blocks == num_blocks and s.peak_used_blocks <= num_blocks
    assert admission == "optimistic" or s.preemptions == 0
    assert s.max_step_tokens == max(sum(len(w.token_ids) for w in work) for work in model.log)
    for work in model.log:  # a request appears at most once per step
        assert len({w.request.id for w in work}) == len(work)
        if budget is None:  # a step is all prefill or all decode
            assert len({w.prefill for w in work}) == 1
            if mode == "static" and work[0].prefill and admission == "reserve":
                assert all(w.request.admitted_step == work[0].request.admitted_step for w in work)
        else:  # decodes first, then prompt chunks, within the budget
            assert [w.prefill for w in work] == sorted(w.prefill for w in work)
            assert sum(len(w.token_ids) for w in work) <= budget


def run_ahead(sched: Scheduler, model: FakeModel) -> None:
    """Drive the scheduler one step ahead, as LLM._run_ahead does: step t+1 is planned and run (its
    PENDING tokens taken from step t's samples) before step t's tokens are resolved."""
    pending = None  # (step, sampled work, tokens)
    while sched.has_unfinished() or pending is not None:
        launched = None
        if sched.has_unfinished():
            work = sched.schedule()
            step, sampled = sched.steps - 1, [w for w in work if w.samples]
            earlier = None if pending is None else {w.request.id: t for w, t in zip(pending[1], pending[2])}
            tokens, _ = model(work, earlier)
            sched.update(work, [PENDING] * len(sampled), [False] * len(sampled))
            launched = (step, sampled, tokens)
        if pending is not None:
            step, sampled, tokens = pending
            sched.resolve(sampled, tokens, [t == EOS for t in tokens], step)
        pending = launched


@settings(max_examples=120, deadline=None)
@given(**WORKLOAD_STRATEGIES)
def test_one_step_ahead_gives_the_same_tokens(requests, block_size, extra_blocks, mode, prefix_caching, budget):
    """The scheduler driven one step ahead of the model (update with PENDING, resolve one step later):
    the same tokens and finish reasons as run alone, every block back in the pool, and the fake model's
    context check passes, so no slot, shared block or prefix-cache name was wrong (a block is named
    only once its tokens are known)."""
    sched, reqs, prompts, num_blocks = serve(requests, block_size, extra_blocks, mode, "reserve", prefix_caching, budget)
    run_ahead(sched, FakeModel(block_size))
    assert [r.output for r in reqs] == [reference(p, m, EOS) for p, (_, _, m) in zip(prompts, requests)]
    assert all(r.status == "finished" and r.finish_reason == ("stop" if r.output[-1] == EOS else "length") for r in reqs)
    assert sched.stats().free_blocks == num_blocks


@settings(max_examples=120, deadline=None)
@given(requests=WORKLOAD_STRATEGIES["requests"], block_size=WORKLOAD_STRATEGIES["block_size"],
       mode=WORKLOAD_STRATEGIES["mode"], budget=WORKLOAD_STRATEGIES["budget"], ahead=st.booleans())
def test_every_full_block_of_fed_tokens_stays_cached(requests, block_size, mode, budget, ahead):
    """Over a pool no run can fill (nothing is evicted), every full block of the tokens that went through
    the model (the prompt and every generated token but the last) stays in the prefix cache after the
    run, in step and one step ahead alike: a next turn finds them all. One step ahead, the last token a
    request feeds is still PENDING when ``update`` finishes the request at ``max_tokens``; its block is
    named once ``resolve`` fills the token in (the scheduler keeps the blocks until then)."""
    prompts = [prefix + suffix for prefix, suffix, _ in requests]
    num_blocks = sum(-(-(len(p) + m) // block_size) for p, (_, _, m) in zip(prompts, requests))
    sched = Scheduler(BlockManager(num_blocks, block_size), mode, "reserve", budget)
    reqs = [sched.add_request(p, m) for p, (_, _, m) in zip(prompts, requests)]
    if ahead:
        run_ahead(sched, FakeModel(block_size))
    else:
        sched.run(FakeModel(block_size))
    assert sched.stats().free_blocks == num_blocks and sched.blocks.stats().evictions == 0
    for r in reqs:
        fed = r.prompt + r.output[:-1]
        assert sched.blocks.add_sequence(("next turn", r.id), fed + [1]) == len(fed) // block_size * block_size


def test_resolve_cuts_a_stopped_request_and_drops_its_token_in_flight():
    sched, model = make(8, block_size=4)
    r = sched.add_request([1, 2, 3], 6)
    work0 = sched.schedule()  # the prefill samples the first token
    sched.update(work0, [PENDING], [False])
    work1 = sched.schedule()  # decodes it, still PENDING
    assert work1[0].token_ids == (PENDING,) and r.output == [PENDING]
    sched.update(work1, [PENDING], [False])
    report, finished = sched.resolve(work0, [EOS], [True], step=0)
    assert report == [(r, EOS, True)] and finished == [r] and r.output == [EOS] and r.finish_reason == "stop"
    assert sched.resolve(work1, [9], [False], step=1) == ([], [])  # the token of the step in flight is dropped
    assert not sched.has_unfinished() and sched.stats().free_blocks == 8


def test_resolve_of_the_last_allowed_token_reports_it_last():
    sched, _ = make(8, block_size=4)
    r = sched.add_request([1, 2], 2)
    work0 = sched.schedule()
    sched.update(work0, [PENDING], [False])
    work1 = sched.schedule()
    assert sched.update(work1, [PENDING], [False]) == [r] and r.finish_reason == "length"  # max_tokens: known now
    assert sched.resolve(work0, [5], [False], step=0) == ([(r, 5, False)], [])
    assert sched.resolve(work1, [EOS], [True], step=1) == ([(r, EOS, True)], [])  # already finished: not again
    assert r.output == [5, EOS] and r.finish_reason == "stop"
