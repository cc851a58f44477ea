"""What a request produces beyond token ids (CPU, the tiny model, float32): stop strings matched on the
text across token boundaries and cut from it, streamed text that never shows a stop string, logprobs
equal to the model's own distribution, chat through the checkpoint's template, and bad prompts,
parameters and concurrent use refused with a message that says what is wrong."""
import json
import shutil
import threading

import pytest
import torch

from dsv2_lib import LLM, SamplingParams
from dsv2_lib.engine.llm import EMBEDDED_MODELS

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = ["To be, or not", "The king", "Hello there"]


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("tiny", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def plain(tiny):
    """Each prompt's greedy run without stop strings."""
    return tiny.generate(PROMPTS, GREEDY)


def spanning_stop(tiny, out) -> tuple[str, int]:
    """A stop string made of the end of one token's text and the start of the next (so it is found
    only across a token boundary), and the index of the token that completes it."""
    pieces = [tiny.tokenizer.decode(out.token_ids[:i + 1]) for i in range(len(out.token_ids))]
    for i in range(3, len(pieces)):
        before, after = pieces[i - 1], pieces[i]
        if len(after) - len(before) >= 2 and len(before) >= 2 and out.text.find(before[-2:] + after[len(before)]) == len(before) - 2:
            return before[-2:] + after[len(before)], i
    raise AssertionError("no stop string spanning two tokens found")


def test_a_stop_string_across_tokens_ends_the_text_before_it(tiny, plain):
    for out in plain:
        stop, i = spanning_stop(tiny, out)
        got = tiny.generate(out.prompt_token_ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                                 stop=["never in this text", stop]))[0]
        assert got.finish_reason == "stop"
        assert got.token_ids == out.token_ids[:i + 1]  # the token that completed it is kept
        assert got.text == out.text[:out.text.find(stop)]  # the text ends just before it


def test_streamed_pieces_never_show_a_stop_string_and_add_up_to_the_text(tiny, plain):
    stops = [spanning_stop(tiny, out)[0] for out in plain]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[s]) for s in stops]
    want = tiny.generate(PROMPTS, params)
    text = ["", "", ""]
    for i, _, piece in tiny.stream(PROMPTS, params):
        text[i] += piece
        assert stops[i] not in text[i]
    assert text == [o.text for o in want]


def test_logprobs_are_the_models_log_softmax_with_the_top_k(tiny, plain):
    k = 5
    out = tiny.generate(PROMPTS[0], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=k))[0]
    assert out.token_ids == plain[0].token_ids and len(out.logprobs) == len(out.token_ids)
    ids = out.prompt_token_ids + out.token_ids[:-1]
    want = torch.log_softmax(tiny.logits(ids)[len(out.prompt_token_ids) - 1:], -1)
    for row, lp in zip(want, out.logprobs):
        top = row.topk(k)
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert lp.top[0][0] == lp.token_id  # greedy: the chosen token is the most likely
    sampled = tiny.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=0))[0]
    assert all(lp.top == () and lp.logprob <= 0 for lp in sampled.logprobs)
    assert tiny.generate(PROMPTS[0], GREEDY)[0].logprobs is None


def test_chat_prompts_through_the_built_in_template(tiny):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    (out,) = tiny.chat(conversation, GREEDY)
    want = tiny.tokenizer.encode("<｜begin▁of▁sentence｜>Be brief.\n\nUser: Hi\n\nAssistant:", add_special_tokens=False)
    assert out.prompt_token_ids == want
    assert out.token_ids == tiny.generate([want], GREEDY)[0].token_ids
    assert [o.prompt_token_ids for o in tiny.chat([conversation, conversation[1:]], GREEDY)][0] == want
    with pytest.raises(ValueError, match=r"message 1: role 'robot'"):
        tiny.chat([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])


def test_chat_uses_the_checkpoints_own_template(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(EMBEDDED_MODELS["tiny"], ckpt)
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    llm = LLM(ckpt, device="cpu")
    ids = llm.chat_prompt([{"role": "user", "content": "Hi"}])
    assert llm.tokenizer.decode(ids, skip_special_tokens=False) == "<｜begin▁of▁sentence｜>[user] Hi\n[assistant]"
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['nope'] }}"}))
    with pytest.raises(ValueError, match="the checkpoint's chat_template failed on these messages"):
        LLM(ckpt, device="cpu").chat_prompt([{"role": "user", "content": "Hi"}])


@pytest.mark.parametrize("prompt, message", [
    (None, r"prompts must be a prompt \(text or token ids\) or a list of prompts, got NoneType None"),
    (7, r"prompts must be a prompt .* got int 7"),
    (b"hello", r"prompts must be a prompt .* got bytes b'hello'"),
    ([b"hello"], r"prompt 0 is bytes b'hello'; a prompt is text or a list of token ids"),
    ([None], r"prompt 0 is NoneType None"),
    (["ok", "bad \ud800 text"], r"prompt 1 is not valid Unicode text: surrogates not allowed at character 4 \('\\ud800'\)"),
    ([[1, 2], [3, "4"]], r"prompt 1: token 1 is '4', not an int"),
])
def test_prompts_of_the_wrong_kind_are_refused_by_index(tiny, prompt, message):
    with pytest.raises(ValueError, match=message):
        tiny.generate(prompt, GREEDY)


@pytest.mark.parametrize("params, message", [
    ({"max_tokens": 4}, r"params 0 is a dict, not a SamplingParams"),
    ([GREEDY, {"max_tokens": 4}], r"params 1 is a dict, not a SamplingParams"),
    (SamplingParams, r"params 0 is a type, not a SamplingParams"),
])
def test_params_that_are_not_sampling_params_are_refused(tiny, params, message):
    with pytest.raises(ValueError, match=message):
        tiny.generate(["a", "b"], params)


@pytest.mark.parametrize("field, value, message", [
    ("stop", [""], r"SamplingParams.stop must be a string or a sequence of non-empty strings, got \(''?,?\)|\[''\]"),
    ("stop", [3], r"SamplingParams.stop must be a string or a sequence of non-empty strings"),
    ("logprobs", 21, r"SamplingParams.logprobs must be None or an int in 0..20, got 21"),
    ("logprobs", True, r"SamplingParams.logprobs must be None or an int in 0..20, got True"),
])
def test_bad_stop_strings_and_logprobs_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_a_single_stop_string_is_a_tuple_of_one():
    assert SamplingParams(stop="\n").stop == ("\n",)


def test_a_second_run_from_another_thread_is_refused_with_what_holds_the_llm(tiny):
    stream = tiny.stream(PROMPTS, GREEDY)
    next(stream)  # the stream holds the LLM until it ends or is closed
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, tiny.generate, "x", GREEDY)))
    t.start()
    t.join()
    assert "this LLM is busy with an unfinished stream(); it serves one run at a time" in str(errors[0].value)
    with pytest.raises(RuntimeError, match="busy with an unfinished stream"):
        tiny.generate("x", GREEDY)
    stream.close()
    assert tiny.generate(PROMPTS[0], GREEDY)[0].token_ids  # free again



def test_generate_running_in_another_thread_is_named_in_the_refusal(tiny, monkeypatch):
    started, release, step = threading.Event(), threading.Event(), tiny.runner.step

    def held_step(*args, **kwargs):
        started.set()
        release.wait()
        return step(*args, **kwargs)

    monkeypatch.setattr(tiny.runner, "step", held_step)
    worker = threading.Thread(target=tiny.generate, args=("y", GREEDY), name="worker")
    worker.start()
    started.wait()
    with pytest.raises(RuntimeError, match=r"this LLM is busy with generate\(\) in thread 'worker'"):
        tiny.generate("x", GREEDY)
    release.set()
    worker.join()
