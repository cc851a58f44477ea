"""CUDA-graph steps on the GPU (``pytest -m gpu``): a replay equals the same padded step run eagerly, bit
for bit, the engine's greedy tokens do not change when steps become graphs, and a step with prompt
chunks runs as one graph that agrees with the eager passes."""
import pytest
import torch

from dsv2_lib import LLM, SamplingParams
from dsv2_lib.engine.graph_runner import DecodeGraphRunner
from dsv2_lib.model.cache import PagedLatentCache

pytestmark = [pytest.mark.gpu, pytest.mark.cuda_graph]
PROMPTS = [list(range(2, 2 + n)) for n in (5, 17, 33, 40, 3)]


def random_step(B, cache, g):
    """B decode entries at random positions with random (distinct) blocks from the pool."""
    perm = torch.randperm(cache.num_blocks, generator=g).tolist()
    starts = torch.randint(0, cache.max_len - 1, (B,), generator=g).tolist()
    tables = [[perm.pop() for _ in range(s // cache.block_size + 1)] for s in starts]
    slots = [t[s // cache.block_size] * cache.block_size + s % cache.block_size for t, s in zip(tables, starts)]
    ids = torch.randint(0, 4096, (B,), generator=g).tolist()
    return ids, starts, tables, slots


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_replay_equals_the_eager_padded_step(dtype):
    llm = LLM("tiny", device="cuda", dtype=dtype)
    cache = PagedLatentCache(llm.config, num_blocks=256, block_size=16, dtype=dtype, device="cuda", max_len=160)
    cache.rows.normal_()
    graphs, eager = DecodeGraphRunner(llm.model, cache), DecodeGraphRunner(llm.model, cache, capture=False)
    g = torch.Generator().manual_seed(0)
    for B in (1, 3, 10, 12, 9, 1):  # graphs of size 1, 3, 12 (padded), 12 again, 12 padded again, 1 again
        step = random_step(B, cache, g)
        before = cache.rows.clone()
        got = graphs(*step).clone()
        written = cache.rows.clone()
        cache.rows.copy_(before)
        want = eager(*step)
        assert got.shape == (B, llm.config.vocab_size) and torch.equal(got, want)
        assert torch.equal(cache.rows, written)  # the same rows written, and only the step's slots
        changed = (written != before).any(-1).nonzero()[:, 1].unique().tolist()
        assert set(changed) <= set(step[3])


def test_engine_tokens_are_the_same_with_graphs_and_with_the_eager_padded_step():
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = {}
    for capture in (True, False):
        llm = LLM("tiny", device="cuda", dtype="bfloat16", kv_cache_mib=8)
        llm.runner._graphs = DecodeGraphRunner(llm.model, llm.runner.cache, capture=capture)  # the one the runner keeps
        runs[capture] = [o.token_ids for o in llm.generate(PROMPTS, params)]
        assert llm.runner._graphs.capture is capture and len(llm.runner._graphs._steps) >= 1
    assert runs[True] == runs[False]


def test_async_scheduling_with_graphs_gives_the_same_tokens():
    """On the GPU, one step ahead: decode tokens gathered into the graph's input buffer from the previous
    step's picks, read back after the next step is launched. Same tokens, greedy and seeded, as one step
    at a time. (No stop ids here: a request that stops is still in the next step when running ahead,
    and on the GPU a different batch may round differently, as any change of batch does; the CPU tests
    in tests/test_llm.py and tests/test_scheduler.py cover stops token for token.)"""
    runs = {}
    for ahead in (False, True):
        llm = LLM("tiny", device="cuda", dtype="bfloat16", kv_cache_mib=8, async_scheduling=ahead)
        params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                  *[SamplingParams(max_tokens=10 + i, temperature=0.9, seed=i, ignore_eos=True) for i in range(len(PROMPTS) - 1)]]
        runs[ahead] = [(o.token_ids, o.finish_reason) for o in llm.generate(PROMPTS, params)]
    assert runs[True] == runs[False]


def test_a_padded_graph_step_agrees_with_the_unpadded_step():
    """The same decode step of 9 entries through the graph of size 12 and through the model on a plain
    PagedBatch of 9: the padding changes the shapes cuBLAS and the MoE kernels see, so bf16 rounding
    may differ, never more than two bf16 paths through 6 layers can (relative error of the logits
    <= 2 %; the full-size test measures ~4 % for 27 layers against fp32) — and padding rows must not
    leak into real ones (that would be an O(1) error)."""
    from dsv2_lib.model.cache import PagedBatch

    llm = LLM("tiny", device="cuda", dtype="bfloat16")
    cache = PagedLatentCache(llm.config, num_blocks=256, block_size=16, dtype=torch.bfloat16, device="cuda", max_len=160)
    cache.rows.normal_(0, 0.5)
    ids, starts, tables, slots = random_step(9, cache, torch.Generator().manual_seed(1))
    before = cache.rows.clone()
    got = DecodeGraphRunner(llm.model, cache)(ids, starts, tables, slots).clone()
    cache.rows.copy_(before)
    batch = PagedBatch(starts=tuple(starts), lens=(1,) * 9, block_tables=tuple(map(tuple, tables)), block_size=16,
                       slots=tuple(slots), decode=True, device="cuda")
    want = llm.model.compute_logits(llm.model(torch.tensor(ids, device="cuda"), batch, cache))
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= 0.02, rel


def test_side_streams_give_the_same_bits_and_are_waited_for(monkeypatch):
    """Up to 16 tokens MLA's q_proj and MoE's shared experts run on a side stream (dsv2_lib/core/streams.py):
    a replay gives the same logits and cache rows, bit for bit, as with every kernel on one stream. The
    side work is held up ~5 ms per layer, so a join that did not wait would read unwritten buffers."""
    import dataclasses

    from dsv2_lib.core import streams
    from dsv2_lib.model import mla, moe
    from dsv2_lib.ops.moe_experts import MoETuning

    llm = LLM("tiny", device="cuda", dtype="bfloat16")
    cache = PagedLatentCache(llm.config, num_blocks=256, block_size=16, dtype=torch.bfloat16, device="cuda", max_len=160)
    cache.rows.normal_(0, 0.5)
    step = random_step(5, cache, torch.Generator().manual_seed(2))
    before = cache.rows.clone()
    layers = [m for m in llm.model.modules() if isinstance(m, moe.MoE) and m.shared_experts is not None]
    attention = [m for m in llm.model.modules() if isinstance(m, mla.MLA)]
    for m in attention:
        m.tuning = dataclasses.replace(m.tuning, q_stream_max_tokens=0)
    for m in layers:
        m.tuning = MoETuning(shared_stream_max_tokens=0)
    want, want_rows = DecodeGraphRunner(llm.model, cache)(*step).clone(), cache.rows.clone()

    on_side = []

    def delayed(forward):
        def run(*args):
            on_side.append(torch.cuda.current_stream() == streams.side_stream(torch.device("cuda")))
            torch.cuda._sleep(10**7)
            return forward(*args)
        return run

    for m in attention:
        m.tuning = dataclasses.replace(m.tuning, q_stream_max_tokens=16)
    monkeypatch.setattr(mla.MLA, "project_q", delayed(mla.MLA.project_q))
    for m in layers:
        m.tuning = MoETuning(shared_stream_max_tokens=16)
        monkeypatch.setattr(m.shared_experts, "forward", delayed(m.shared_experts.forward))
    cache.rows.copy_(before)
    got = DecodeGraphRunner(llm.model, cache)(*step)
    assert layers and on_side and all(on_side)  # every delayed call ran on the side stream
    assert torch.equal(got, want) and torch.equal(cache.rows, want_rows)


@pytest.mark.parametrize("capture", [True, False])
def test_the_layers_of_a_step_share_one_decode_schedule(monkeypatch, capture):
    """Every layer of a decode step attends over the same lengths, so the schedule kernel runs once per
    step (PagedBatch.per_step), in a graph and eagerly, and the step gives the same bits as with one
    schedule per layer. The second step has other lengths in the same static batch: a schedule kept from
    the first would attend over the wrong rows."""
    from dsv2_lib.ops import mla_decode

    llm = LLM("tiny", device="cuda", dtype="bfloat16")
    assert llm.config.num_hidden_layers > 1
    cache = PagedLatentCache(llm.config, num_blocks=256, block_size=16, dtype=torch.bfloat16, device="cuda", max_len=160)
    cache.rows.normal_(0, 0.5)
    g = torch.Generator().manual_seed(3)
    steps = [random_step(B, cache, g) for B in (4, 4)]
    before = cache.rows.clone()
    schedule = mla_decode.mla_decode_schedule
    launched = []

    def counted(*args):
        launched.append(args[1:])
        return schedule(*args)

    monkeypatch.setattr(mla_decode, "mla_decode_schedule", counted)
    runner = DecodeGraphRunner(llm.model, cache, capture=capture)
    got = []
    for step in steps:
        got.append(runner(*step).clone())
    # Eagerly one schedule per step; with capture, the first step's warm-up and capture forwards, then replays.
    assert len(launched) == 2

    monkeypatch.setattr(mla_decode, "_shared_schedule", lambda per_step, *args: schedule(*args))  # one per layer
    cache.rows.copy_(before)
    runner = DecodeGraphRunner(llm.model, cache, capture=capture)
    for step, want in zip(steps, got):
        assert torch.equal(runner(*step), want)


def test_a_step_with_prompt_chunks_runs_as_one_graph_and_agrees_with_the_eager_passes():
    """Decode items and a newcomer's prompt chunk (13 tokens) in one step: one replay of the graph of 16
    entries, against the same step as the runner's eager passes (decode items, then the chunk through
    prefill attention). Two bf16 paths through 6 layers (the chunk's attention is the absorbed one in the
    graph, the decompressed one eagerly): relative error of the logits <= 2 %, as for padding above; the
    cache rows the two write agree as closely."""
    import dataclasses

    from test_graph_runner import mixed_step

    from dsv2_lib.engine.model_runner import ModelRunner

    llm = LLM("tiny", device="cuda", dtype="bfloat16", kv_cache_mib=4)
    cache = llm.runner.cache
    work = mixed_step(llm, cache)
    before = cache.rows.clone()
    got = llm.runner.step(work, cache).clone()
    assert llm.runner.last_graph == (13, 16)
    got_rows = cache.rows.clone()
    cache.rows.copy_(before)
    eager = ModelRunner(llm.model, dataclasses.replace(llm.engine_config, cuda_graphs=False), cache)
    want = eager.step(work, cache)
    assert eager.last_graph is None and got.shape == want.shape == (3, llm.config.vocab_size)
    for a, b in ((got, want), (got_rows.float(), cache.rows.float())):
        rel = ((a - b).norm() / b.norm()).item()
        assert rel <= 0.02, rel


def test_the_trace_names_each_steps_graph_size(tmp_path):
    """``LLM(trace=...)`` on a GPU: every step, prompts included, fits the largest graph here and ran as one
    replay; the trace records its entries (one per token) and the captured size it ran in, the smallest
    bucket that holds them."""
    import json

    from dsv2_lib.engine.graph_runner import bucket

    path = tmp_path / "trace.jsonl"
    llm = LLM("tiny", device="cuda", dtype=torch.bfloat16, trace=path)
    llm.generate(PROMPTS, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (4, 9, 14, 6, 11)])
    steps = [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == "step"]
    tokens = [sum(i["tokens"] for i in s["items"]) for s in steps]
    assert all(s["graph"] == {"entries": n, "bucket": bucket(n)} for s, n in zip(steps, tokens))
    assert all(i["kind"] == "prefill" for i in steps[0]["items"]) and {5, 3} <= set(tokens)  # prompts, then decodes
