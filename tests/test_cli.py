"""``python -m dsv2_lib generate``: text out on stdout, clear errors with exit code 2."""
import subprocess
import sys

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
