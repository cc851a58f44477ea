"""The public API: ``LLM(...).generate`` and ``LLM.logits`` on the embedded tiny model and small
random checkpoints (CPU, float32): text and ids in, tokens and text out, stopping rules, seeds,
the context limit, and errors that say which prompt and which token is wrong."""
import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from dsv2_lib import LLM, SamplingParams
from dsv2_lib.core.checkpoint import CheckpointError
from dsv2_lib.core.config import TINY, ConfigError
from dsv2_lib.engine.llm import EMBEDDED_MODELS
from dsv2_lib.model.cache import block_bytes
from dsv2_lib.model.layers import Linear
from dsv2_lib.model.mla import MLA
from dsv2_lib.model.moe import MoE
from dsv2_lib.model.tuning import Tuning
from dsv2_lib.ops.attention import AttentionTuning
from dsv2_lib.ops.mla_decode import DecodeTuning
from dsv2_lib.ops.moe_experts import MoETuning
from dsv2_lib.tools.random_checkpoint import write_random_checkpoint

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SMALL = dataclasses.replace(
    TINY, vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
    n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=64,
    rope=dataclasses.replace(TINY.rope, original_max_position_embeddings=16),
)


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("tiny", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> Path:
    """A random checkpoint without tokenizer.json."""
    return write_random_checkpoint(SMALL, tmp_path_factory.mktemp("small"), seed=5)


@pytest.fixture(scope="module")
def small(small_dir) -> LLM:
    return LLM(small_dir, device="cpu", dtype="float32")


def copy_tiny(dest: Path, **config_changes) -> Path:
    """The embedded tiny model's files in ``dest``, with ``config.json`` fields replaced."""
    shutil.copytree(EMBEDDED_MODELS["tiny"], dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(config_changes)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def find_prompt_with_new_token_at_step(llm: LLM, step: int, max_tokens: int = 8):
    """A prompt whose greedy continuation's token ``step`` (0-based) did not occur before it, and the run."""
    for start in range(1, 60):
        prompt = [start, (start * 7) % 500 + 2, (start * 13) % 500 + 2]
        out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0]
        if out.token_ids[step] not in out.token_ids[:step] and out.token_ids[step] not in llm.config.eos_token_id:
            return prompt, out
    pytest.fail("no prompt found whose greedy token at step %d is new" % step)


# ---- text in, text out --------------------------------------------------------------------------


def test_text_in_text_out(tiny):
    outs = tiny.generate("To be, or not", GREEDY)  # a single string: one request
    assert len(outs) == 1
    out = outs[0]
    assert out.prompt_token_ids == tiny.tokenizer.encode("To be, or not")
    assert out.prompt_token_ids[0] == TINY.bos_token_id  # the tokenizer adds BOS
    assert len(out.token_ids) == 8 and all(0 <= t < TINY.vocab_size for t in out.token_ids)
    assert isinstance(out.text, str)
    assert out.text == tiny.tokenizer.decode(out.token_ids)
    assert out.finish_reason == "length"


def test_mixed_text_and_id_prompts_equal_separate_runs(tiny):
    prompts = ["Hello", [5, 17, 42], "def f(x):\n    return", [300, 2, 9, 100, 7]]
    together = tiny.generate(prompts, GREEDY)
    assert len(together) == len(prompts)
    for prompt, out in zip(prompts, together):
        alone = tiny.generate(prompt, GREEDY)[0]
        assert out.prompt_token_ids == alone.prompt_token_ids
        assert out.token_ids == alone.token_ids, prompt
        assert out.text == tiny.tokenizer.decode(out.token_ids)
    assert together[1].prompt_token_ids == [5, 17, 42]


def test_single_id_list_is_one_prompt(tiny):
    out = tiny.generate([5, 17, 42], GREEDY)
    assert len(out) == 1 and out[0].prompt_token_ids == [5, 17, 42]
    assert tiny.generate([], GREEDY) == []  # no prompts, no outputs


def test_default_params(tiny):
    """Defaults: 16 tokens, temperature 1 (unseeded), so the sample may hit EOS before the 16th."""
    out = tiny.generate("x")[0]
    if out.finish_reason == "length":
        assert len(out.token_ids) == SamplingParams().max_tokens
    else:
        assert out.finish_reason == "stop" and out.token_ids[-1] in tiny.config.eos_token_id
        assert 1 <= len(out.token_ids) <= SamplingParams().max_tokens


def test_greedy_is_deterministic_and_the_first_token_is_the_logits_argmax(tiny):
    ids = tiny.tokenizer.encode("import os")
    a = tiny.generate(ids, GREEDY)[0].token_ids
    assert tiny.generate(ids, GREEDY)[0].token_ids == a
    logits = tiny.logits(ids)
    assert logits.dtype == torch.float32 and logits.device.type == "cpu"
    assert logits.shape == (len(ids), TINY.vocab_size)
    assert int(logits[-1].argmax()) == a[0]
    # the decode path (latent cache, absorbed weights) agrees with a fresh prefill of the longer prompt
    assert int(tiny.logits(ids + a[:3])[-1].argmax()) == a[3]


def test_logits_of_text_and_ids_agree(tiny):
    ids = tiny.tokenizer.encode("Hello")
    assert torch.equal(tiny.logits("Hello"), tiny.logits(ids))
    # causal: a prefix's logits are the first rows of the longer prompt's
    long = tiny.logits(ids + [5, 6, 7])
    assert torch.allclose(long[: len(ids)], tiny.logits(ids), atol=1e-5)


def test_no_tokenizer_means_no_text(small):
    assert small.tokenizer is None
    out = small.generate([[3, 4, 5], [9]], GREEDY)
    assert [o.text for o in out] == [None, None]
    assert all(len(o.token_ids) == 8 and all(0 <= t < SMALL.vocab_size for t in o.token_ids) for o in out)
    logits = small.logits([3, 4, 5])
    assert logits.shape == (3, SMALL.vocab_size) and int(logits[-1].argmax()) == out[0].token_ids[0]


def test_bfloat16_model_runs():
    llm = LLM("tiny", device="cpu", dtype=torch.bfloat16)
    assert llm.engine_config.dtype == torch.bfloat16
    logits = llm.logits([5, 17, 42])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert len(llm.generate([5, 17, 42], GREEDY)[0].token_ids) == 8


# ---- stopping -----------------------------------------------------------------------------------


def test_finish_length_at_max_tokens(tiny):
    for n in (1, 3, 11):
        out = tiny.generate([5, 17, 42], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
        assert len(out.token_ids) == n and out.finish_reason == "length"


def test_stop_token_ids_stop_generation(tiny):
    prompt, full = find_prompt_with_new_token_at_step(tiny, 3)
    stop = full.token_ids[3]
    out = tiny.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:4] and out.token_ids[-1] == stop
    # in a batch, only the request with the stop id stops early
    both = tiny.generate([prompt, prompt], [SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop]),
                                            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)])
    assert both[0].token_ids == out.token_ids and both[0].finish_reason == "stop"
    assert both[1].token_ids == full.token_ids and both[1].finish_reason == "length"


def test_stop_token_on_the_last_allowed_step_is_stop(tiny):
    prompt, full = find_prompt_with_new_token_at_step(tiny, 3)
    out = tiny.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=[full.token_ids[3]]))[0]
    assert out.token_ids == full.token_ids[:4] and out.finish_reason == "stop"


def test_eos_stops_unless_ignore_eos(tiny, tmp_path):
    """A copy of the tiny model whose config declares as EOS the token greedy produces at step 3."""
    prompt, full = find_prompt_with_new_token_at_step(tiny, 3)
    eos = full.token_ids[3]
    llm = LLM(copy_tiny(tmp_path / "m", eos_token_id=eos), device="cpu", dtype="float32")
    assert llm.config.eos_token_id == (eos,)
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert out.token_ids == full.token_ids[:4] and out.finish_reason == "stop"
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == full.token_ids and out.finish_reason == "length"
    # ignore_eos does not disable explicit stop ids
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[eos]))[0]
    assert out.token_ids == full.token_ids[:4] and out.finish_reason == "stop"


def test_eos_list_in_config(tiny, tmp_path):
    prompt, full = find_prompt_with_new_token_at_step(tiny, 2)
    llm = LLM(copy_tiny(tmp_path / "m", eos_token_id=[TINY.eos_token_id[0], full.token_ids[2]]), device="cpu")
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert out.token_ids == full.token_ids[:3] and out.finish_reason == "stop"


# ---- seeds --------------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible(tiny):
    prompts = ["Hello", [5, 17, 42]]
    a = tiny.generate(prompts, SamplingParams(max_tokens=24, temperature=1.0, seed=123, ignore_eos=True))
    b = tiny.generate(prompts, SamplingParams(max_tokens=24, temperature=1.0, seed=123, ignore_eos=True))
    c = tiny.generate(prompts, SamplingParams(max_tokens=24, temperature=1.0, seed=124, ignore_eos=True))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    greedy = tiny.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in a] != [o.token_ids for o in greedy]  # really sampled
    # each request has its own generator: its tokens do not depend on the other requests in the batch
    alone = tiny.generate([prompts[1]], SamplingParams(max_tokens=24, temperature=1.0, seed=123, ignore_eos=True))
    assert alone[0].token_ids == a[1].token_ids


# ---- the context limit --------------------------------------------------------------------------


def test_max_model_len_caps_generation():
    llm = LLM("tiny", device="cpu", max_model_len=10)
    out = llm.generate([[5, 6, 7, 8, 9, 10, 11], [5, 6]], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 3 and out[0].finish_reason == "length"  # 7 + 3 = 10
    assert len(out[1].token_ids) == 8 and out[1].finish_reason == "length"
    assert len(llm.generate([1] * 9, SamplingParams(max_tokens=5, temperature=0.0))[0].token_ids) == 1
    with pytest.raises(ValueError, match=r"prompt 0 has 10 tokens; the context holds 10"):
        llm.generate([1] * 10, GREEDY)


def test_default_context_is_max_position_embeddings(small):
    assert small.engine_config.max_model_len == SMALL.max_position_embeddings
    out = small.generate([1] * 60, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


# ---- errors -------------------------------------------------------------------------------------


def test_prompt_longer_than_the_context(tiny):
    context = tiny.engine_config.max_model_len
    too_long = [7] * (context + 5)
    with pytest.raises(ValueError, match=rf"prompt 1 has {len(too_long)} tokens; the context holds {context}"):
        tiny.generate([[1, 2], too_long], GREEDY)
    with pytest.raises(ValueError, match=rf"prompt 0 has {len(too_long)} tokens; the context holds {context}"):
        tiny.logits(too_long)


def test_empty_prompt(tiny):
    with pytest.raises(ValueError, match=r"prompt 0 is empty"):
        tiny.generate([[]], GREEDY)
    with pytest.raises(ValueError, match=r"prompt 2 is empty"):
        tiny.generate(["a", [4], []], GREEDY)
    with pytest.raises(ValueError, match=r"prompt 0 is empty"):
        tiny.logits([])


@pytest.mark.parametrize("bad, pos", [(-1, 0), (TINY.vocab_size, 2), (10**9, 1)])
def test_token_out_of_vocab(tiny, bad, pos):
    prompt = [3, 4, 5]
    prompt[pos] = bad
    with pytest.raises(ValueError, match=re.escape(f"prompt 1: token {pos} is {bad}, outside the vocabulary [0, {TINY.vocab_size})")):
        tiny.generate([[1, 2], prompt], GREEDY)
    with pytest.raises(ValueError, match=re.escape(f"prompt 0: token {pos} is {bad}, outside the vocabulary")):
        tiny.logits(prompt)


@pytest.mark.parametrize("bad", [2.0, True, "5", None])
def test_token_not_an_int(tiny, bad):
    with pytest.raises(ValueError, match=re.escape(f"prompt 1: token 1 is {bad!r}, not an int")):
        tiny.generate([[1], [3, bad]], GREEDY)


@pytest.mark.parametrize("prompts", [[[1, 2], 7], [5, 3.0], [None]])
def test_prompt_neither_text_nor_ids(tiny, prompts):
    with pytest.raises(ValueError, match=r"prompt \d is .*a prompt is text or a list of token ids"):
        tiny.generate(prompts, GREEDY)


def test_text_prompt_without_tokenizer(small):
    with pytest.raises(ValueError, match=r"prompt 1 is text but this checkpoint has no tokenizer\.json"):
        small.generate([[1, 2], "hello"], GREEDY)
    with pytest.raises(ValueError, match=r"prompt 0 is text but this checkpoint has no tokenizer\.json"):
        small.logits("hello")


@pytest.mark.parametrize("n_params", [0, 1, 3])
def test_params_list_length_mismatch(tiny, n_params):
    with pytest.raises(ValueError, match=rf"got 2 prompts but {n_params} SamplingParams"):
        tiny.generate(["a", "b"], [GREEDY] * n_params)


def test_unknown_model_name_or_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model 'huge': not an embedded model \(tiny\) nor a directory"):
        LLM("huge", device="cpu")
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=re.escape(repr(str(missing))) + ": not an embedded model"):
        LLM(missing, device="cpu")


def test_directory_without_config(tmp_path):
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "config.json")) + ": no config.json"):
        LLM(tmp_path, device="cpu")


def test_directory_with_a_bad_checkpoint(small_dir, tmp_path):
    d = tmp_path / "bad"
    shutil.copytree(small_dir, d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=re.escape(str(f))):
        LLM(d, device="cpu")


@pytest.mark.parametrize("dtype", ["int8", "float64", "bf16", "fp32", "nn", "", torch.int32, torch.float64])
def test_unsupported_dtype(small_dir, dtype):
    with pytest.raises(ValueError, match=r"dtype must be float32, float16 or bfloat16, got " + re.escape(repr(dtype))):
        LLM(small_dir, device="cpu", dtype=dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", torch.float16])
def test_supported_dtypes(small_dir, dtype):
    llm = LLM(small_dir, device="cpu", dtype=dtype)
    want = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    assert llm.engine_config.dtype == want and llm.model.model.embed_tokens.weight.dtype == want
    assert llm.model.model.layers[1].mlp.gate.weight.dtype == torch.float32


@pytest.mark.parametrize("bad", [0, 1, -5, 2.5])
def test_invalid_max_model_len(bad):
    with pytest.raises(ValueError, match=rf"max_model_len must be an int >= 2 .*got {bad}"):
        LLM("tiny", device="cpu", max_model_len=bad)


# ---- serving: the scheduler, the paged cache, streaming -----------------------------------------

SERVE_PROMPTS = [[7, 3, 9], list(range(20, 50)), [5] * 9, list(range(200, 217)), [42]]


def tiny_block_mib(block_size: int) -> float:
    return block_bytes(TINY, torch.float32, block_size) / 2**20


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("scheduling,admission", [("static", "reserve"), ("continuous", "reserve"),
                                                  ("continuous", "optimistic"), ("static", "optimistic")])
def test_served_outputs_equal_each_prompt_alone(tiny, scheduling, admission, temperature):
    """A pool of 12 blocks of 4 tokens holds the largest request (30 + 12 - 1 = 41 tokens) but not all
    of them: requests wait, and under optimistic admission some are preempted and recomputed."""
    params = [SamplingParams(max_tokens=12, temperature=temperature, top_k=50, seed=i, ignore_eos=True)
              for i in range(len(SERVE_PROMPTS))]
    alone = [tiny.generate(p, q)[0].token_ids for p, q in zip(SERVE_PROMPTS, params)]
    llm = LLM("tiny", device="cpu", dtype="float32", kv_cache_mib=12.5 * tiny_block_mib(4), block_size=4,
              scheduling=scheduling, admission=admission)
    assert [o.token_ids for o in llm.generate(SERVE_PROMPTS, params)] == alone
    s = llm.last_stats.scheduler
    assert s.pool_blocks == 12 and s.free_blocks == 12 and s.admission_waits > 0
    assert (s.preemptions > 0) == (admission == "optimistic")
    assert llm.last_stats.generated_tokens == 12 * len(SERVE_PROMPTS)


def test_stream_yields_tokens_as_produced(tiny):
    prompts = ["To be, or not", "Hello", [5, 17, 42]]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    want = tiny.generate(prompts, params)
    events = list(tiny.stream(prompts, params))
    for i, out in enumerate(want):
        mine = [(t, piece) for j, t, piece in events if j == i]
        assert [t for t, _ in mine] == out.token_ids
        assert "".join(piece for _, piece in mine) == out.text
    assert {j for j, _, _ in events[:3]} == {0, 1, 2}  # interleaved: all three start in the first step
    assert [t for _, t, _ in tiny.stream("Hello", params)] == want[1].token_ids  # one prompt


def test_stream_without_tokenizer_gives_no_text(small):
    assert all(piece is None for _, _, piece in small.stream([[1, 2, 3]], SamplingParams(max_tokens=3)))


def test_a_request_larger_than_the_cache_fails_alone_and_the_others_are_served():
    llm = LLM("tiny", device="cpu", dtype="float32", kv_cache_mib=2 * tiny_block_mib(16))  # 2 blocks, 32 tokens
    params = SamplingParams(max_tokens=4, temperature=0)
    alone = llm.generate([[1, 2], [4, 5]], params)
    small, big, other = llm.generate([[1, 2], [3] * 30, [4, 5]], params)
    assert (big.finish_reason, big.token_ids, big.text) == ("error", [], "")
    assert big.error.startswith("request 1 can never run: it needs up to 33 cached tokens")
    assert [(o.finish_reason, o.token_ids) for o in (small, other)] == [(o.finish_reason, o.token_ids) for o in alone]
    with pytest.raises(ValueError, match=r"request 0 can never run"):
        llm.stream([[3] * 20], SamplingParams(max_tokens=16))  # before the first token is asked for
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=4))[0].finish_reason == "length"


def test_bad_serving_arguments():
    with pytest.raises(ValueError, match=r"scheduling must be one of .*got 'eager'"):
        LLM("tiny", device="cpu", scheduling="eager")
    with pytest.raises(ValueError, match=r"admission one of .*'lazy'"):
        LLM("tiny", device="cpu", admission="lazy")
    with pytest.raises(ValueError, match=r"block_size must be an int >= 1, got 0"):
        LLM("tiny", device="cpu", block_size=0)
    with pytest.raises(ValueError, match=r"holds no block"):
        LLM("tiny", device="cpu", kv_cache_mib=0.001)


def test_stats_summary(tiny):
    tiny.generate(["a", "b"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    text = tiny.last_stats.summary()
    for key in ("KV cache pool", "peak active requests:   2", "largest decode batch:   2", "peak blocks allocated",
                "admission waits:        0", "free blocks at the end", "preemptions", "prefill tokens"):
        assert key in text


@pytest.mark.parametrize("scheduling,budget", [("continuous", 8192), ("continuous", 8), ("static", None)])
def test_async_scheduling_gives_the_same_outputs(tiny, scheduling, budget):
    """One step ahead (the default) and one step at a time: the same tokens, finish reasons and
    statistics, with stop ids that end some requests early (their token of the step in flight is
    dropped), seeded sampling, chunked prefill (budget 8), a request whose prompt shares request 1's
    first blocks, one whose last fed-back token completes a block (10 + 6 tokens: one step ahead it is
    still a placeholder when the request finishes), and a second run whose prompts continue the first
    run's outputs, finding the same cached blocks."""
    prompt, full = find_prompt_with_new_token_at_step(tiny, 3)
    stop = full.token_ids[3]
    prompts = [prompt, list(range(20, 50)), [5] * 9, list(range(20, 33)) + [7], [42], list(range(60, 70))]
    params = [SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop]),
              SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.0, stop_token_ids=[stop]),
              SamplingParams(max_tokens=1, temperature=0.0),
              SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)]
    runs = {}
    for ahead in (False, True):
        llm = LLM("tiny", device="cpu", dtype="float32", kv_cache_mib=40 * tiny_block_mib(4), block_size=4,
                  scheduling=scheduling, max_num_batched_tokens=budget, async_scheduling=ahead)
        first = llm.generate(prompts, params)
        s1 = llm.last_stats
        again = [p + o.token_ids for p, o in zip(prompts, first)]
        second = llm.generate(again, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        runs[ahead] = ([(o.token_ids, o.finish_reason) for o in first + second], s1, llm.last_stats)
    assert runs[True][0] == runs[False][0]
    assert runs[False][0][0][1] == "stop" and len(runs[False][0][0][0]) == 4  # the stop id ended request 0
    for (_, *stats_sync), (_, *stats_async) in [(runs[False], runs[True])]:
        for a, b in zip(stats_sync, stats_async):
            assert a.generated_tokens == b.generated_tokens
            assert a.scheduler.prefix_hit_tokens == b.scheduler.prefix_hit_tokens
            assert b.scheduler.free_blocks == b.scheduler.pool_blocks == 40
    assert runs[True][1].scheduler.prefix_hit_tokens > 0  # request 3 shares request 1's first blocks


def test_async_scheduling_stream_order_and_text():
    """``stream`` yields the same (request, token, text piece) events in the same order either way."""
    prompts = ["To be, or not", "Hello", [5, 17, 42]]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    events = {ahead: list(LLM("tiny", device="cpu", dtype="float32", async_scheduling=ahead).stream(prompts, params))
              for ahead in (False, True)}
    assert events[True] == events[False] and len(events[True]) == 18


def test_a_sized_pool_keeps_its_prefix_cache_across_runs():
    """With ``kv_cache_mib`` the pool outlives a run: the same prompt again finds its full blocks (all
    but the last token's block), computes only the rest and gives the same tokens; the statistics are
    the run's own; ``reset_prefix_cache`` forgets the blocks."""
    llm = LLM("tiny", device="cpu", dtype="float32", kv_cache_mib=24 * tiny_block_mib(4), block_size=4)
    prompt, params = list(range(30, 53)), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompt, params)[0].token_ids
    assert llm.last_stats.scheduler.prefix_hit_tokens == 0 and llm.last_stats.scheduler.prefill_tokens == 23
    again = llm.generate(prompt, params)[0].token_ids
    s = llm.last_stats.scheduler
    assert again == first
    assert (s.prefix_hit_tokens, s.prefill_tokens) == (20, 3)  # 5 full blocks in prompt[:-1], 3 tokens computed
    assert llm.last_stats.blocks.prefix_hit_blocks == 5 and s.peak_used_blocks == 7  # 27 tokens with slots
    llm.reset_prefix_cache()
    assert llm.generate(prompt, params)[0].token_ids == first
    assert llm.last_stats.scheduler.prefix_hit_tokens == 0


def test_a_pool_sized_per_run_starts_empty(tiny):
    prompt, params = list(range(30, 53)), SamplingParams(max_tokens=2, temperature=0.0)
    tiny.generate(prompt, params)
    tiny.generate(prompt, params)
    assert tiny.last_stats.scheduler.prefix_hit_tokens == 0


def test_an_unfinished_stream_holds_the_pool_and_closing_it_forgets_the_cache():
    """A second run while a stream over the pool is unfinished is refused (both would allocate the same
    blocks); a stream closed early may leave blocks named whose rows no step wrote, so its pool's
    prefix cache is dropped, and the next run computes everything (and gives the same tokens)."""
    llm = LLM("tiny", device="cpu", dtype="float32", kv_cache_mib=24 * tiny_block_mib(4), block_size=4)
    prompt, params = list(range(30, 53)), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    want = llm.generate(prompt, params)[0].token_ids
    stream = llm.stream(prompt, params)
    assert next(stream)[1] == want[0]
    with pytest.raises(RuntimeError, match="unfinished stream"):
        llm.generate(prompt, params)
    with pytest.raises(RuntimeError, match="unfinished stream"):
        llm.reset_prefix_cache()
    stream.close()
    assert llm.generate(prompt, params)[0].token_ids == want
    assert llm.last_stats.scheduler.prefix_hit_tokens == 0


def test_engine_batches_are_host_checked(tiny, monkeypatch):
    """The engine validates prompts on the host and samples the other ids itself, so every batch it runs
    says so (the embedding kernel then skips its sync), and its index tensors match the batch's tuples."""
    seen = []
    forward = type(tiny.model).forward

    def spy(model, input_ids, batch, cache):
        seen.append((batch.host_checked, input_ids.tolist(), batch.positions().tolist()))
        return forward(model, input_ids, batch, cache)

    monkeypatch.setattr(type(tiny.model), "forward", spy)
    prompt = [5, 6, 7]
    out = tiny.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert [s[0] for s in seen] == [True] * 3
    assert seen[0][1:] == (prompt, [0, 1, 2]) and seen[1][1:] == ([out.token_ids[0]], [3])


@pytest.mark.parametrize("kw, want", [
    (dict(block_size=True), "block_size must be an int >= 1, got True"),
    (dict(max_model_len=True), "max_model_len must be an int >= 2"),
    (dict(prefix_caching="no"), "prefix_caching must be True or False, got 'no'"),
    (dict(cuda_graphs=1), "cuda_graphs must be True or False, got 1"),
    (dict(async_scheduling=None), "async_scheduling must be True or False, got None"),
    (dict(kv_cache_mib=float("nan")), "kv_cache_mib must be a finite number of MiB > 0"),
    (dict(kv_cache_mib=float("inf")), "kv_cache_mib must be a finite number of MiB > 0"),
    (dict(kv_cache_mib="8"), "kv_cache_mib must be a finite number of MiB > 0"),
    (dict(kv_cache_mib=0), "kv_cache_mib must be a finite number of MiB > 0"),
    (dict(device="tpu"), "device must be"),
    (dict(device=3), "device must be 'cpu', 'cuda', 'cuda:N' or None, got 3"),
    (dict(tuning={"gemv_max_tokens": 4}), "tuning must be a Tuning (dsv2_lib.model.tuning), got dict"),
])
def test_serving_arguments_of_the_wrong_kind_are_refused_by_name(kw, want):
    """A bool is not a size and a string is not a bool: each refused before any weight loads."""
    with pytest.raises(ValueError, match=re.escape(want)):
        LLM("tiny", **kw)


def test_a_gpu_device_without_a_gpu_is_refused_up_front():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="PyTorch sees no CUDA GPU"):
        LLM("tiny", device="cuda")


def test_a_context_longer_than_the_trained_one_warns():
    with pytest.warns(UserWarning, match="longer than the model's trained context"):
        LLM("tiny", device="cpu", max_model_len=TINY.max_position_embeddings * 2)


def test_tuning_reaches_every_layer_that_switches_kernels():
    tuning = Tuning(moe=MoETuning(gemv_max_tokens=1), attention=AttentionTuning(sdpa_min_tokens=7),
                    decode=DecodeTuning(min_tiles=3), gemv_max_tokens=1, skinny_max_tokens=24)
    llm = LLM("tiny", device="cpu", tuning=tuning)
    assert llm.engine_config.tuning is tuning
    moe = [m for m in llm.model.modules() if isinstance(m, MoE)]
    mla = [m for m in llm.model.modules() if isinstance(m, MLA)]
    linear = [m for m in llm.model.modules() if isinstance(m, Linear)]
    assert moe and all(m.tuning is tuning.moe for m in moe)
    assert len(mla) == TINY.num_hidden_layers and all(m.tuning is tuning for m in mla)
    assert linear and all((m.gemv_max_tokens, m.skinny_max_tokens) == (1, 24) for m in linear)  # the LM head's too


@pytest.mark.parametrize("kw, want", [
    (dict(moe={"gemv_max_tokens": 1}), "Tuning.moe must be a MoETuning, got dict"),
    (dict(decode=AttentionTuning()), "Tuning.decode must be a DecodeTuning, got AttentionTuning"),
    (dict(gemv_max_tokens=-1), "Tuning.gemv_max_tokens must be an int >= 0 (0: never), got -1"),
    (dict(gemv_max_tokens=True), "Tuning.gemv_max_tokens must be an int >= 0"),
    (dict(skinny_max_tokens=2.5), "Tuning.skinny_max_tokens must be an int >= 0 (0: never), got 2.5"),
])
def test_a_bad_tuning_is_refused_by_field(kw, want):
    with pytest.raises(ValueError, match=re.escape(want)):
        Tuning(**kw)
