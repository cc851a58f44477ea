"""``LLM(trace=path)``: one JSON line per event of each run, and the invariants a reader of the trace
relies on (CPU, the tiny model): every request is added once and finished once, its tokens are
computed once each and in order (again from its cached prefix after a preemption), and the blocks
given to requests all come back."""
import json
from collections import defaultdict

import pytest
import torch

from dsv2_lib import LLM, SamplingParams
from dsv2_lib.core.config import TINY
from dsv2_lib.model.cache import block_bytes

PROMPTS = [[5] * 40 + [7, 8], [5] * 40 + [9], [3, 4, 5, 6] * 6, [11, 12, 13]]
MAX_TOKENS = [12, 30, 8, 20]


def tiny_block_mib(block_size: int) -> float:
    return block_bytes(TINY, torch.float32, block_size) / 2**20


def runs(path) -> list[list[dict]]:
    """The trace's records, split at each ``run`` event."""
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["event"] == "run":
            out.append([])
        else:
            out[-1].append(record)
    return out


def check_run(records: list[dict]) -> dict[int, dict]:
    """Assert a run's invariants; each request's finish record."""
    added = {r["request"]: r for r in records if r["event"] == "add"}
    finished = {r["request"]: r for r in records if r["event"] == "finish"}
    assert len(added) == sum(r["event"] == "add" for r in records)
    assert sorted(finished) == sorted(added) == sorted({r["request"] for r in records if r["event"] == "finish"})
    steps = [r for r in records if r["event"] == "step"]
    assert [s["step"] for s in steps] == list(range(len(steps)))
    next_pos = defaultdict(int)  # the position each request computes next
    for s in steps:
        for rid in s["preempted"]:
            next_pos[rid] = 0
        for item in s["items"]:
            rid = item["request"]
            assert rid in added and (rid not in finished or finished[rid]["step"] >= s["step"])
            assert item["start"] == next_pos[rid] + item["cached"], (s, item)  # nothing skipped, nothing twice
            next_pos[rid] = item["start"] + item["tokens"]
            if item["kind"] == "decode":  # (a prefill may recompute generated tokens, after a preemption)
                assert item["tokens"] == 1 and item["start"] >= added[rid]["prompt_tokens"]
    for rid, f in finished.items():  # the last generated token is returned, never computed
        assert next_pos[rid] == added[rid]["prompt_tokens"] + f["output_tokens"] - 1
        assert f["output_tokens"] <= added[rid]["max_tokens"]
    given = sum(s["blocks"]["allocated"] for s in steps)
    returned = sum(s["blocks"]["freed_by_preemption"] for s in steps) + sum(f["freed"] for f in finished.values())
    assert given == returned > 0
    assert all(s["graph"] is None for s in steps)  # no CUDA graphs on a CPU
    return finished


@pytest.mark.parametrize("kw", [
    dict(),
    dict(async_scheduling=False),
    dict(scheduling="static"),
    dict(admission="optimistic", kv_cache_mib=5 * tiny_block_mib(16), max_num_batched_tokens=16),
    dict(kv_cache_mib=6 * tiny_block_mib(16), max_num_batched_tokens=20),
])
def test_the_trace_of_a_run_keeps_its_invariants(tmp_path, kw):
    path = tmp_path / "trace.jsonl"
    llm = LLM("tiny", device="cpu", dtype="float32", trace=path, **kw)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params)
    llm.generate(PROMPTS[:1], params[:1])  # a second run: a second "run" record, ids from 0 again
    first, second = runs(path)
    finished = check_run(first)
    check_run(second)
    assert [finished[i]["output_tokens"] for i in range(len(PROMPTS))] == [len(o.token_ids) for o in outs]
    assert [finished[i]["reason"] for i in range(len(PROMPTS))] == [o.finish_reason for o in outs]
    steps = [r for r in first if r["event"] == "step"]
    assert sum(r["event"] == "step" for r in second) == llm.last_stats.scheduler.steps  # (the last run's)
    if kw.get("admission") == "optimistic":
        assert sum(len(s["preempted"]) for s in steps) > 0  # the case the invariants must survive
    if "max_num_batched_tokens" in kw:
        assert max(sum(i["tokens"] for i in s["items"]) for s in steps) <= kw["max_num_batched_tokens"]
        assert any(i["cached"] > 0 for s in steps for i in s["items"])  # the shared 40-token prefix


def test_a_trace_into_a_missing_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"trace must be a file path in an existing directory"):
        LLM("tiny", device="cpu", trace=tmp_path / "nope" / "t.jsonl")
    with pytest.raises(ValueError, match=r"trace must be a file path"):
        LLM("tiny", device="cpu", trace=tmp_path)
