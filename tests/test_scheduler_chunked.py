"""Chunked prefill: a per-step token budget (``max_num_batched_tokens``). The scheduler gives one token
to each decoding request first, then spends the rest on prompt chunks; only a prompt's last chunk
samples. Exact step-by-step plans (pure Python, the fake model of test_scheduler), then the tiny model
on the CPU in float32: chunking changes no generated token, decodes keep flowing beside a long
prefill, the prefix cache and preemption still work, statistics, the CLI flag and bad values."""
import random
import re
import subprocess
import sys

import pytest
import torch
from test_scheduler import FakeModel, reference

from dsv2_lib import LLM, SamplingParams
from dsv2_lib.core.config import TINY
from dsv2_lib.engine.block_manager import BlockManager
from dsv2_lib.engine.scheduler import Scheduler
from dsv2_lib.model.cache import block_bytes


def plan(model: FakeModel) -> list[list[tuple]]:
    """Each step's work as (request letter, positions, prefill, samples)."""
    return [[("ABC"[w.request.id], w.positions, w.prefill, w.samples) for w in step] for step in model.log]


def test_a_long_prompt_is_prefilled_in_chunks_of_the_budget():
    sched = Scheduler(BlockManager(8, 16), max_num_batched_tokens=16)
    model = FakeModel(16, eos=None)
    a, b = sched.add_request(list(range(1, 41)), 3), sched.add_request([50, 51, 52, 53, 54], 3)
    sched.run(model)
    assert plan(model) == [
        [("A", range(0, 16), True, False)],  # no token sampled from a chunk that ends mid-prompt
        [("A", range(16, 32), True, False)],
        [("A", range(32, 40), True, True), ("B", range(0, 5), True, True)],  # 8 left of 16: B fits whole
        [("A", range(40, 41), False, True), ("B", range(5, 6), False, True)],
        [("A", range(41, 42), False, True), ("B", range(6, 7), False, True)],
    ]
    assert [a.output, b.output] == [reference(a.prompt, 3, None), reference(b.prompt, 3, None)]
    assert (a.admitted_step, b.admitted_step, b.waited_steps) == (0, 2, 2)
    s = sched.stats()
    assert (s.steps, s.prefill_tokens, s.prefill_chunks, s.max_step_tokens, s.max_decode_batch) == (5, 45, 4, 16, 2)


def test_a_decoding_request_gets_a_token_every_step_while_a_long_prompt_prefills():
    sched = Scheduler(BlockManager(16, 4), max_num_batched_tokens=8)
    model = FakeModel(4, eos=None)
    a, b = sched.add_request([1, 2, 3], 6), sched.add_request(list(range(10, 40)), 2)
    sched.run(model)
    steps = [[("AB"[w.request.id], len(w.token_ids), w.prefill, w.samples) for w in step] for step in model.log]
    assert steps == [
        [("A", 3, True, True), ("B", 5, True, False)],
        *[[("A", 1, False, True), ("B", 7, True, False)]] * 3,  # decode first, then 7 of B's 30 tokens
        [("A", 1, False, True), ("B", 4, True, True)],
        [("A", 1, False, True), ("B", 1, False, True)],
    ]
    assert [a.output, b.output] == [reference(a.prompt, 6, None), reference(b.prompt, 2, None)]


def test_without_a_budget_a_step_is_all_prefill_or_all_decode():
    sched = Scheduler(BlockManager(16, 4), max_num_batched_tokens=None)
    model = FakeModel(4, eos=None)
    sched.add_request([1, 2, 3], 3)
    sched.run(model)
    sched.add_request(list(range(10, 40)), 2)
    sched.add_request([5, 6], 2)
    sched.run(model)
    assert model.timeline()[3:] == ["P BC", "D BC"] and model.log[3][0].positions == range(0, 30)


def test_a_shared_prefix_is_hit_only_once_computed():
    """B shares A's first three blocks. With a budget of 8, B is admitted in the step that computes A's
    last chunk: its hits are blocks that chunk (or an earlier step) fills, written in that very pass."""
    system = list(range(1, 13))  # 3 blocks of 4
    sched = Scheduler(BlockManager(16, 4), max_num_batched_tokens=8)
    model = FakeModel(4, eos=None)
    a, b = sched.add_request(system + [90], 3), sched.add_request(system + [91, 92], 3)
    sched.run(model)
    assert plan(model)[:2] == [
        [("A", range(0, 8), True, False)],
        [("A", range(8, 13), True, True), ("B", range(12, 14), True, True)],  # 12 tokens from the cache
    ]
    assert b.cached_tokens == 12 and model.log[1][1].block_table[:3] == model.log[1][0].block_table[:3]
    assert [a.output, b.output] == [reference(a.prompt, 3, None), reference(b.prompt, 3, None)]


def test_preemption_by_recompute_with_chunks():
    sched = Scheduler(BlockManager(4, 4), admission="optimistic", max_num_batched_tokens=3)
    model = FakeModel(4, eos=None)
    a, b = sched.add_request([1, 2, 3, 4, 5], 6), sched.add_request([6, 7, 8, 9, 10, 11], 4)
    sched.run(model)
    # Step 5: A crosses into a third block, none is free: B (newest) is preempted; readmitted at step 7
    # with its first block still cached, it recomputes 3 tokens (2 of its prompt and its first output).
    assert plan(model)[4:8] == [
        [("A", range(7, 8), False, True), ("B", range(5, 6), True, True)],
        [("A", range(8, 9), False, True)],
        [("A", range(9, 10), False, True)],
        [("B", range(4, 7), True, True)],
    ]
    assert (b.preemptions, b.cached_tokens) == (1, 4)
    assert [a.output, b.output] == [reference(a.prompt, 6, None), reference(b.prompt, 4, None)]
    s = sched.stats()
    assert (s.preemptions, s.prefill_tokens, s.prefill_chunks, s.max_step_tokens, s.free_blocks) == (1, 14, 7, 3, 4)


# ---- the engine -----------------------------------------------------------------------------------

PROMPTS = [[7, 3, 9], list(range(20, 90)), [5] * 9, list(range(200, 237)), [42]]


@pytest.fixture(scope="module")
def alone():
    """Each prompt served alone, without a budget: greedy and seeded sampling."""
    llm = LLM("tiny", device="cpu", dtype="float32", max_num_batched_tokens=None)
    return {t: [llm.generate(p, q)[0].token_ids for p, q in zip(PROMPTS, params(t))] for t in (0.0, 0.8)}


def params(temperature):
    return [SamplingParams(max_tokens=6, temperature=temperature, top_k=50, seed=i, ignore_eos=True)
            for i in range(len(PROMPTS))]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("budget", [8, 16, 33, 10**6, None])
def test_chunking_changes_no_generated_token(alone, budget, temperature):
    llm = LLM("tiny", device="cpu", dtype="float32", max_num_batched_tokens=budget)
    assert [o.token_ids for o in llm.generate(PROMPTS, params(temperature))] == alone[temperature]
    s = llm.last_stats.scheduler
    total = sum(map(len, PROMPTS))
    assert s.prefill_tokens == total and s.free_blocks == s.pool_blocks
    if budget is None or budget >= total:
        assert s.prefill_chunks == len(PROMPTS) and s.max_step_tokens == total  # every prompt in step 0
    else:
        assert s.prefill_chunks > len(PROMPTS) and s.max_step_tokens == budget
    assert llm.last_stats.generated_tokens == 6 * len(PROMPTS)


def test_prefix_caching_with_chunks():
    system = list(range(3, 43))  # 40 tokens: two full blocks of 16 shared
    prompts = [system + [100 + i] * (i + 1) for i in range(3)]
    p = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    plain = LLM("tiny", device="cpu", dtype="float32", prefix_caching=False, max_num_batched_tokens=None)
    chunked = LLM("tiny", device="cpu", dtype="float32", max_num_batched_tokens=16)
    assert [o.token_ids for o in chunked.generate(prompts, p)] == [o.token_ids for o in plain.generate(prompts, p)]
    s = chunked.last_stats.scheduler
    assert (s.prefix_hit_tokens, s.prefill_tokens) == (64, sum(map(len, prompts)) - 64)
    assert s.max_step_tokens == 16


@pytest.mark.parametrize("budget", [5, 16])
def test_preemption_with_chunks_in_the_engine(alone, budget):
    """21 blocks of 4 hold the largest request (70 + 6 - 1 = 75 tokens, 19 blocks) but not everything:
    optimistic admission preempts, and a recomputed request is prefilled in chunks too."""
    mib = 21.5 * block_bytes(TINY, torch.float32, 4) / 2**20
    llm = LLM("tiny", device="cpu", dtype="float32", kv_cache_mib=mib, block_size=4, admission="optimistic",
              max_num_batched_tokens=budget)
    assert [o.token_ids for o in llm.generate(PROMPTS, params(0.0))] == alone[0.0]
    s = llm.last_stats.scheduler
    assert s.preemptions > 0 and s.free_blocks == 21 and s.max_step_tokens <= budget


def test_stats_summary_reports_the_largest_step():
    llm = LLM("tiny", device="cpu", dtype="float32", max_num_batched_tokens=16)
    llm.generate([list(range(1, 41)), [5] * 5], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert "largest step:           16 tokens (4 prefill chunks in all)" in llm.last_stats.summary()


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_bad_budgets_are_refused(bad):
    with pytest.raises(ValueError, match=re.escape(f"max_num_batched_tokens must be an int >= 1 (tokens per step) "
                                                   f"or None (no limit), got {bad!r}")):
        LLM("tiny", device="cpu", max_num_batched_tokens=bad)


def test_cli_flag():
    def run(*args):
        return subprocess.run([sys.executable, "-m", "dsv2_lib", "generate", "--device", "cpu", "--max-tokens", "4",
                               *args], capture_output=True, text=True, timeout=120)

    prompt = "To be, or not to be, that is the question"
    want = LLM("tiny", device="cpu").generate(prompt, SamplingParams(max_tokens=4, temperature=0.0))[0].text
    r = run("--max-num-batched-tokens", "4", "--stats", prompt)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{prompt}{want}\n" and "largest step:           4 tokens" in r.stderr
    r = run("--max-num-batched-tokens", "0", "hi")
    assert r.returncode == 2 and "--max-num-batched-tokens: must be an int >= 1, got 0" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("budget", [1, 3, 8, 16])
def test_every_step_spends_its_budget_in_the_order_chapter_14_teaches(budget):
    """The scheduler and ``exercises.step_tokens_reference`` (the Build it's answer) agree on every step
    of random runs with memory to spare: requests arrive between steps, prompts of 1 to 40 tokens."""
    from dsv2_lib.lessons.exercises import step_tokens_reference

    rng = random.Random(budget)
    bm = BlockManager(4096, 4, prefix_caching=False)
    sched = Scheduler(bm, max_num_batched_tokens=budget)
    steps = 0
    while steps < 60 or sched.has_unfinished():
        if steps < 60 and rng.random() < 0.3:
            sched.add_request([rng.randrange(2, 100) for _ in range(rng.randint(1, 40))], rng.randint(1, 6))
        if not sched.has_unfinished():
            steps += 1
            continue
        decoding = sum(r.decoding for r in sched.running)
        partial = next((len(r.tokens) - bm.num_tokens(r.id) for r in sched.running if not r.decoding), 0)
        before = {r.id for r in sched.running}
        want = step_tokens_reference(budget, decoding, partial, [len(r.tokens) for r in sched.waiting])
        work = sched.schedule()
        got = (sum(not w.prefill for w in work),
               sum(len(w.token_ids) for w in work if w.prefill and w.request.id in before),
               [len(w.token_ids) for w in work if w.prefill and w.request.id not in before])
        assert got == want, f"step {steps}: the scheduler spent {got}, the reference says {want}"
        sched.update(work, [7] * sum(w.samples for w in work))
        steps += 1
