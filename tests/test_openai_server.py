"""The OpenAI-compatible server driven by the official ``openai`` client (CPU, the tiny model, on
127.0.0.1): completions, chat, streaming, stop strings and logprobs give what the offline engine
gives; bad requests get 4xx and OpenAI's error body; a client that disconnects frees its blocks;
64 concurrent streams share the batch and each gets its offline greedy output."""
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import pytest

from dsv2_lib import LLM, SamplingParams
from dsv2_lib.engine.live_engine import LiveEngine

httpx = pytest.importorskip("httpx")  # the server's stack and its client (requirements.txt)
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
from dsv2_lib.serve.openai_server import create_app  # noqa: E402

MODEL = "tiny"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(llm, engine, base_url)``: the server runs on a thread for the module and stops at its end."""
    trace = tmp_path_factory.mktemp("server") / "trace.jsonl"
    llm = LLM("tiny", device="cpu", dtype="float32", kv_cache_mib=8, trace=trace)
    engine = LiveEngine(llm)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, MODEL), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield llm, engine, f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    server.should_exit = True
    thread.join()
    engine.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[2], api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference():
    return LLM("tiny", device="cpu", dtype="float32")


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_equals_offline_generate(client, reference):
    want = reference.generate("To be, or not", SamplingParams(max_tokens=20, temperature=0))[0]
    got = client.completions.create(model=MODEL, prompt="To be, or not", max_tokens=20, temperature=0)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))


def test_streamed_completion_adds_up_to_the_text(client, reference):
    want = reference.generate("The king", SamplingParams(max_tokens=24, temperature=0))[0]
    chunks = list(client.completions.create(model=MODEL, prompt="The king", max_tokens=24, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == want.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_and_streamed_chat_equal_offline_chat(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who are you?"}]
    want = reference.chat(messages, SamplingParams(max_tokens=16, temperature=0))[0]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text


def test_stop_strings_end_the_text_before_them(client, reference):
    full = reference.generate("Hello there", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].text
    stop = full[8:11]
    got = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=24, temperature=0, stop=[stop])
    assert got.choices[0].text == full[:full.find(stop)] and got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=24, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[:full.find(stop)]


def test_logprobs_equal_the_engines(client, reference):
    want = reference.generate("O Romeo", SamplingParams(max_tokens=6, temperature=0, logprobs=2))[0].logprobs
    got = client.completions.create(model=MODEL, prompt="O Romeo", max_tokens=6, temperature=0, logprobs=2)
    assert got.choices[0].logprobs.token_logprobs == pytest.approx([lp.logprob for lp in want], abs=1e-5)
    assert [len(top) for top in got.choices[0].logprobs.top_logprobs] == [2] * 6
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)


@pytest.mark.parametrize("call, status, param, message", [
    (dict(model="gpt-4", prompt="x"), 404, "model", "the model 'gpt-4' does not exist; this server serves 'tiny'"),
    (dict(model=MODEL, prompt="x", temperature=-1), 400, "temperature", "temperature: Input should be greater than"),
    (dict(model=MODEL, prompt="x", n=2), 400, "n", "n: Input should be less than or equal to 1"),
    (dict(model=MODEL, prompt="x", max_tokens=0), 400, "max_tokens", "max_tokens: Input should be greater"),
    (dict(model=MODEL, prompt="x", temperature=1e-9), 400, "temperature", "SamplingParams.temperature must be 0"),
    (dict(model=MODEL, prompt=[1, 2, 10**9]), 400, "prompt", "prompt 0: token 2 is 1000000000, outside the vocabulary"),
    (dict(model=MODEL, prompt="x" * 3000, max_tokens=10), 400, "prompt", "the context holds 2048"),
    (dict(model=MODEL, prompt=["a", "b"]), 400, "prompt", "one prompt per request"),
])
def test_bad_completion_requests_get_openai_errors(client, call, status, param, message):
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**call)
    assert e.value.status_code == status
    error = e.value.body
    assert error["param"] == param and message in error["message"] and error["type"] == "invalid_request_error"


def test_a_bad_chat_message_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError, match=r"message 0: role 'robot'"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])


def test_a_client_that_disconnects_frees_its_blocks(served):
    _, engine, url = served
    pool = engine.loop.sched.blocks
    body = {"model": MODEL, "prompt": "To be", "max_tokens": 1500, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert pool.num_free_blocks < pool.num_blocks  # it is running
    deadline = time.monotonic() + 120  # a hang guard, not a timing claim
    while pool.num_free_blocks < pool.num_blocks:
        assert time.monotonic() < deadline, "the disconnected request still holds blocks"
        time.sleep(0.05)
    finish = [json.loads(line) for line in served[0].engine_config.trace.read_text().splitlines()][-1]
    assert finish["event"] == "finish" and finish["reason"] == "abort" and finish["output_tokens"] < 1500


def test_a_client_that_leaves_before_a_whole_answer_frees_its_blocks(served):
    """Not streamed: the client hangs up while tokens keep coming (no pause in which to notice), and the
    request is aborted all the same. A raw socket, closed once the request holds blocks: no timing."""
    _, engine, url = served
    pool = engine.loop.sched.blocks
    host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
    body = json.dumps({"model": MODEL, "prompt": "To be", "max_tokens": 1500, "temperature": 0,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    deadline = time.monotonic() + 120  # hang guards, not timing claims
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(head + body)
        while pool.num_free_blocks == pool.num_blocks:  # until the request runs
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    while pool.num_free_blocks < pool.num_blocks:
        assert time.monotonic() < deadline, "the abandoned request still holds blocks"
        time.sleep(0.05)
    finish = [json.loads(line) for line in served[0].engine_config.trace.read_text().splitlines()][-1]
    assert finish["event"] == "finish" and finish["reason"] == "abort" and finish["output_tokens"] < 1500


def test_64_concurrent_streams_share_the_batch_and_each_gets_its_offline_output(served, reference):
    prompts = [f"Request {i}: " + "the king " * (i % 7) for i in range(64)]
    want = reference.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    client = openai.AsyncOpenAI(base_url=served[2], api_key="unused", max_retries=0)
    steps_before = served[1].loop.sched.steps

    async def one(prompt):
        start, first, text = time.perf_counter(), None, ""
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
        async for chunk in stream:
            if first is None and chunk.choices[0].text:
                first = time.perf_counter() - start
            text += chunk.choices[0].text
        return text, first

    async def all_of_them():
        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return results, time.perf_counter() - start

    results, seconds = asyncio.run(all_of_them())
    assert [text for text, _ in results] == [w.text for w in want]
    tokens = sum(len(w.token_ids) for w in want)
    steps = served[1].loop.sched.steps - steps_before
    assert steps < tokens // 2  # requests shared steps (one request alone would need one step per token)
    ttft = sorted(t for _, t in results if t is not None)
    print(f"\n64 concurrent streams: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.0f} tok/s, {steps} steps; "
          f"time to first token p50 {statistics.median(ttft) * 1e3:.0f} ms, "
          f"p99 {ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] * 1e3:.0f} ms")


def test_the_serve_command_answers_traces_and_stops(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    trace = tmp_path / "steps.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "dsv2_lib", "serve", "--device", "cpu", "--port", str(port),
                             "--kv-cache-mib", "2", "--max-num-batched-tokens", "4", "--trace", str(trace)],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120  # a hang guard
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models")
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert r.json()["data"][0]["id"] == "tiny"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": "tiny", "prompt": "To be, or not to be, that is the question", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        events = [json.loads(line) for line in trace.read_text().splitlines()]
        assert events[-1]["event"] == "finish"
        steps = [sum(item["tokens"] for item in e["items"]) for e in events if e["event"] == "step"]
        assert max(steps) == 4 < r.json()["usage"]["prompt_tokens"]  # the prompt was prefilled in chunks of 4
    finally:
        proc.terminate()
        proc.wait(60)
    assert f"serving 'tiny' at http://127.0.0.1:{port}/v1" in proc.stderr.read()
