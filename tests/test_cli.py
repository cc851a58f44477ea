"""``python -m dsv2_lib generate``: text out on stdout, clear errors with exit code 2."""
import subprocess
import sys

import pytest

from dsv2_lib import LLM, SamplingParams


def run(*args):
    return subprocess.run([sys.executable, "-m", "dsv2_lib", *args], capture_output=True, text=True, timeout=120)


def test_generate_prints_prompt_and_greedy_continuation():
    r = run("generate", "--model", "tiny", "--device", "cpu", "--max-tokens", "6", "To be, or not")
    assert r.returncode == 0, r.stderr
    want = LLM("tiny", device="cpu").generate("To be, or not", SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert r.stdout == f"To be, or not{want.text}\n"
    assert "finish_reason=" in r.stderr


def test_bad_arguments_give_a_clear_error():
    r = run("generate", "--model", "no/such/dir", "hi")
    assert r.returncode == 2 and "no/such/dir" in r.stderr and "Traceback" not in r.stderr
    r = run("generate", "--top-p", "0", "hi")
    assert r.returncode == 2 and "top_p" in r.stderr


def test_scheduling_flags_and_stats():
    prompts = ["To be, or not", "Hello"]
    want = [o.text for o in LLM("tiny", device="cpu").generate(prompts, SamplingParams(max_tokens=5, temperature=0.0))]
    for mode in ("--static", "--continuous"):
        r = run("generate", "--device", "cpu", "--max-tokens", "5", mode, "--kv-cache-mib", "0.1", "--stats", *prompts)
        assert r.returncode == 0, r.stderr
        assert r.stdout == "".join(f"{p}{t}\n" for p, t in zip(prompts, want))
        for key in ("KV cache pool:          3 blocks of 16 tokens", "peak active requests", "largest decode batch",
                    "peak blocks allocated", "admission waits", "free blocks at the end:", "preemptions"):
            assert key in r.stderr
    r = run("generate", "--device", "cpu", "--max-tokens", "5", "--in-step", *prompts)  # no host/GPU overlap
    assert r.returncode == 0 and r.stdout == "".join(f"{p}{t}\n" for p, t in zip(prompts, want)), r.stderr
    r = run("generate", "--static", "--continuous", "hi")
    assert r.returncode == 2 and "not allowed with" in r.stderr


def test_max_model_len_caps_a_request_and_refuses_a_prompt_that_cannot_fit():
    """Prompt plus output within --max-model-len: the output stops there (finish_reason=length); a prompt
    with no room for one generated token is a one-line error."""
    r = run("generate", "--device", "cpu", "--max-model-len", "8", "--max-tokens", "40", "hi")
    assert r.returncode == 0 and "[6 tokens, finish_reason=length]" in r.stderr, r.stderr
    r = run("generate", "--device", "cpu", "--max-model-len", "4", "To be or not to be that is the question")
    assert r.returncode == 2 and "the context holds 4" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_request_larger_than_the_cache_is_a_clear_error():
    r = run("generate", "--device", "cpu", "--kv-cache-mib", "0.03", "--max-tokens", "40", "hi")
    assert r.returncode == 2 and "can never run" in r.stderr and "Traceback" not in r.stderr


def test_help_of_every_subcommand_gives_each_option_its_default():
    """``--help`` explains itself: every option has a description and says its default."""
    import argparse

    from dsv2_lib.__main__ import HelpFormatter, build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(subparsers) == {"generate", "serve", "bench", "diff", "calibrate"}
    for name, sub in subparsers.items():
        formatter = HelpFormatter(prog=name)
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            text = formatter._get_help_string(action)
            assert action.help and "default" in text, f"{name} {action.option_strings[0]}: {text!r}"
        assert "(default: 8192)" in " ".join(subparsers["generate"].format_help().split())


def test_bench_refuses_what_it_cannot_run_before_writing_anything(tmp_path):
    """On a CPU the default 31 GB model is refused up front; a count of 0 is an argument error."""
    import torch

    if not torch.cuda.is_available():
        r = run("bench", "--checkpoint-dir", str(tmp_path / "ckpt"))
        assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and "--model tiny" in r.stderr
        assert not (tmp_path / "ckpt").exists()
        r = run("bench", "--device", "cuda", "--model", "tiny")
        assert r.returncode == 2 and "no CUDA GPU" in r.stderr and "Traceback" not in r.stderr
    r = run("bench", "--repeats", "0")
    assert r.returncode == 2 and "--repeats: must be an int >= 1, got 0" in r.stderr


@pytest.mark.parametrize("argv, want", [
    (["generate", "--device", "tpu", "hi"], "--device must be cpu, cuda or cuda:N, got 'tpu'"),
    (["generate", "--model", "/nonexistent", "--device", "cpu", "hi"], "not an embedded model"),
    (["generate", "--model", "tiny", "--device", "cpu", "--temperature", "nan", "hi"], "temperature"),
    (["bench", "--model", "/nonexistent", "--device", "cpu"], "model '/nonexistent': not an embedded model"),
    (["serve", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: must be a number in (0, 1], got 1.5"),
])
def test_user_errors_are_one_line_without_a_traceback(argv, want):
    r = run(*argv)
    assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_gpu_device_without_a_gpu_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = run("generate", "--device", "cuda", "hi")
    assert r.returncode == 2 and "PyTorch sees no CUDA GPU" in r.stderr and "Traceback" not in r.stderr


def test_stream_prints_the_same_text_as_generate():
    want = LLM("tiny", device="cpu").generate("To be, or not", SamplingParams(max_tokens=12, temperature=0.0))[0]
    r = run("generate", "--device", "cpu", "--max-tokens", "12", "--temperature", "0", "--stream", "To be, or not")
    assert r.returncode == 0 and r.stdout == "To be, or not" + want.text + "\n", (r.stdout, r.stderr)
    assert f"[{len(want.token_ids)} tokens]" in r.stderr
    r = run("generate", "--device", "cpu", "--stream", "one", "two")
    assert r.returncode == 2 and "--stream prints one prompt's text" in r.stderr
