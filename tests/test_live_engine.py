""":class:`LiveEngine`: requests from several threads, arriving at different times, join one continuous
batch and get exactly what ``generate`` gives them alone; an abort frees the request's blocks; bad
requests are refused in the caller's thread; a failing step reaches every waiting caller (CPU, tiny)."""
import json
import threading
import time

import pytest

from dsv2_lib import LLM, SamplingParams
from dsv2_lib.engine.live_engine import LiveEngine

PROMPTS = ["To be, or not", "The king", "Hello there", "O Romeo", "Friends, Romans"]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


class Collector:
    """Events per request; ``done`` is set when all ``n`` requests have finished."""

    def __init__(self, n: int):
        self.events, self.n, self.done, self._lock = {}, n, threading.Event(), threading.Lock()

    def __call__(self, i):
        def on_event(e):
            with self._lock:
                self.events.setdefault(i, []).append(e)
                if e.finish_reason is not None and sum(ev[-1].finish_reason is not None for ev in self.events.values()) == self.n:
                    self.done.set()
        return on_event

    def text(self, i) -> str:
        return "".join(e.piece or "" for e in self.events[i])


@pytest.fixture
def llm(tmp_path):
    return LLM("tiny", device="cpu", dtype="float32", kv_cache_mib=1, trace=tmp_path / "trace.jsonl")


def test_requests_arriving_at_different_times_share_the_batch_and_keep_their_tokens(llm):
    want = llm.generate(PROMPTS, GREEDY)
    got = Collector(len(PROMPTS))
    with LiveEngine(llm) as engine:
        def client(i):
            time.sleep(0.02 * i)
            engine.submit(PROMPTS[i], GREEDY, got(i))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got.done.wait(60)
    for i, w in enumerate(want):
        assert [e.token for e in got.events[i]] == w.token_ids
        assert got.text(i) == w.text and got.events[i][-1].finish_reason == "length"
    records = [json.loads(line) for line in llm.engine_config.trace.read_text().splitlines()]
    live = records[max(i for i, r in enumerate(records) if r["event"] == "run"):]
    mixed = [s for s in live if s["event"] == "step" and {i["kind"] for i in s["items"]} == {"prefill", "decode"}]
    assert mixed, "no step held a newcomer's prefill beside running decodes"


def test_an_aborted_request_frees_its_blocks_and_sends_nothing_more(llm):
    got = Collector(2)
    with LiveEngine(llm) as engine:
        pool = engine.loop.sched.blocks
        first_token = threading.Event()
        long = engine.submit("To be", SamplingParams(max_tokens=400, temperature=0, ignore_eos=True),
                             lambda e: (got(0)(e), first_token.set()))
        assert first_token.wait(30)
        long.abort()
        engine.submit("The king", GREEDY, got(1))
        deadline = time.monotonic() + 60
        while got.events.get(1, [None])[-1] is None or got.events[1][-1].finish_reason is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert got.events[0][-1].finish_reason is None and len(got.events[0]) < 400  # cut short, silently
    assert pool.num_free_blocks == pool.num_blocks  # all back, the aborted request's too


def test_bad_requests_are_refused_in_the_callers_thread(llm):
    with LiveEngine(llm) as engine:
        with pytest.raises(ValueError, match=r"prompt 0 is NoneType None"):
            engine.submit(None, GREEDY, print)
        with pytest.raises(ValueError, match=r"params 0 is a dict"):
            engine.submit("hi", {"max_tokens": 3}, print)
        with pytest.raises(ValueError, match=r"this request can never run: it needs up to"):
            engine.submit([1] * 300, SamplingParams(max_tokens=2000), print)
        with pytest.raises(RuntimeError, match="this LLM is busy with a LiveEngine"):
            llm.generate("hi", GREEDY)
    with pytest.raises(RuntimeError, match="this LiveEngine is closed"):
        engine.submit("hi", GREEDY, print)
    assert llm.generate("hi", GREEDY)[0].token_ids  # the LLM is free again


def test_a_live_engine_needs_a_cache_sized_once():
    with pytest.raises(ValueError, match="build the LLM with kv_cache_mib or gpu_memory_utilization"):
        LiveEngine(LLM("tiny", device="cpu"))


def test_a_failing_step_reaches_every_waiting_caller(llm, monkeypatch):
    both_in = threading.Event()

    def broken(*args, **kwargs):
        both_in.wait()
        raise RuntimeError("planted failure")

    monkeypatch.setattr(llm.runner, "step", broken)
    got = Collector(2)
    engine = LiveEngine(llm)
    engine.submit("a", GREEDY, got(0))
    engine.submit("b", GREEDY, got(1))
    both_in.set()
    assert got.done.wait(30)
    assert {got.events[i][-1].finish_reason for i in (0, 1)} == {"error"}
    assert "planted failure" in got.events[0][-1].error
    with pytest.raises(RuntimeError, match=r"this LiveEngine is closed \(it failed: RuntimeError\('planted failure'\)\)"):
        engine.submit("c", GREEDY, print)
    engine.close()
