"""The end-to-end benchmark's machinery on the CPU, with the tiny model (the numbers mean nothing here;
on the H200 `python -m dsv2_lib bench` is the measurement)."""
import json
import math
import shutil
from pathlib import Path

import torch

from dsv2_lib import LLM
from dsv2_lib.core.config import TINY
from dsv2_lib.model.cache import block_bytes
from dsv2_lib.tools import bench


def test_bench_runs_both_engines_and_writes_json_and_plot(tmp_path):
    cfg = bench.BenchConfig(model="tiny", device="cpu", dtype="float32", prompt_len=12, prefill_batches=(2,),
                            decode_batches=(3,), decode_tokens=3, hf_decode_tokens=2, repeats=1)
    record = bench.run(cfg)
    kinds = [(r["engine"], r["kind"], r["batch"]) for r in record["results"]]
    assert kinds == [(e, k, b) for e in ("ours", "transformers") for k, b in (("prefill", 2), ("decode", 3))]
    assert all(r["roofline_fraction"] is None for r in record["results"])  # no roofline off the GPU
    # a rate, or NaN for a decode row whose two timed runs came out in the wrong order on this busy CPU
    assert all(r["tokens_per_s"] > 0 or (r["kind"] == "decode" and math.isnan(r["tokens_per_s"]))
               for r in record["results"])
    decode = [r for r in record["results"] if r["kind"] == "decode"]
    assert all(len(r["seconds"]) == 2 for r in decode)
    js, png = bench.save(record, tmp_path)
    assert json.loads(js.read_text())["config"]["prompt_len"] == 12 and png.stat().st_size > 0
    text = bench.table(record)
    assert text.count("\n") == 2 and "decode" in text and "x" in text.splitlines()[1]


def test_prompts_are_reproducible_and_avoid_special_ids():
    a, b = bench.prompts(100, 3, 7, seed=1), bench.prompts(100, 3, 7, seed=1)
    assert a == b and len(a) == 3 and all(len(p) == 7 and min(p) >= 2 for p in a)


def test_bench_command_line(tmp_path, capsys):
    from dsv2_lib.__main__ import main

    rc = main(["bench", "--model", "tiny", "--device", "cpu", "--dtype", "float32", "--prompt-len", "8",
               "--prefill-batches", "1", "--decode-batches", "2", "--decode-tokens", "2", "--repeats", "1",
               "--no-transformers", "--in-step", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and out.splitlines()[0].split()[:2] == ["batch", "ours"] and "decode" in out
    record = json.loads((tmp_path / "bench.json").read_text())
    assert {r["engine"] for r in record["results"]} == {"ours"} and (tmp_path / "bench.png").is_file()
    assert record["config"]["async_scheduling"] is False
    assert record["sources_sha256"] == bench._sources_sha256()


def test_decode_window_opens_when_no_request_is_still_prefilling():
    from dsv2_lib import LLM, SamplingParams

    assert bench.decode_window_start(128, 512, None) == 1  # one prefill step: decoding from the first token
    assert bench.decode_window_start(128, 512, 8192) == 9 and bench.decode_window_start(1, 512, 8192) == 2
    # 4 prompts of 12 tokens, 16 tokens per step: the prompts take 3-4 steps, requests start decoding apart
    llm = LLM("tiny", device="cpu", max_num_batched_tokens=16)
    ids = bench.prompts(llm.config.vocab_size, 4, 12, seed=0)

    def steps(n):
        llm.generate(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), progress=False)
        return llm.last_stats.scheduler.steps

    m, w = 5, bench.decode_window_start(4, 12, 16)
    assert steps(w + m) - steps(w) == m  # the window holds m steps, each of the whole batch decoding
    assert steps(1 + m) - steps(1) > m   # from the first token, the window would also hold the ramp's steps


def test_every_timed_run_of_ours_computes_its_prompts():
    """The bench repeats the same prompts on one LLM with a pool sized once; without the reset the
    repeats would find their prompts in the prefix cache and time no prefill."""
    llm = LLM("tiny", device="cpu", dtype="float32", kv_cache_mib=64 * block_bytes(TINY, torch.float32, 16) / 2**20)
    ids = [list(range(40, 80)), list(range(90, 130))]
    for _ in range(2):
        bench._ours(llm, ids, 2)
        assert llm.last_stats.scheduler.prefix_hit_tokens == 0
        assert llm.last_stats.scheduler.prefill_tokens == 80


def test_the_record_names_the_measured_sources(tmp_path):
    """bench.json carries a hash of the engine's sources, which changes with any of them (the commit
    field alone can be wrong when the bench runs in a copy of the working tree)."""
    root = Path(bench.__file__).resolve().parents[2]
    copy = tmp_path / "copy"
    shutil.copytree(root / "dsv2_lib", copy / "dsv2_lib", ignore=shutil.ignore_patterns("__pycache__", "assets"))
    shutil.copytree(root / "kernels_cu", copy / "kernels_cu")
    assert bench._sources_sha256(copy) == bench._sources_sha256()
    (copy / "kernels_cu" / "rope.cu").write_text((copy / "kernels_cu" / "rope.cu").read_text() + "// edited\n")
    assert bench._sources_sha256(copy) != bench._sources_sha256()


def test_a_decode_row_whose_longer_run_timed_shorter_is_not_a_number(monkeypatch):
    """tokens/s of decode is b * m over the time the m extra tokens added; when noise makes the longer run
    time shorter there is no such time, and the row says so (it used to report ~1e12 tokens/s)."""
    times = iter([0.30, 0.25, 0.30, 0.40])  # batch 1: t(w), then t(w + m) shorter; batch 2: the usual order
    monkeypatch.setattr(bench, "_median_seconds", lambda fn, repeats, device: next(times))
    cfg = bench.BenchConfig(model="tiny", device="cpu", prefill_batches=(), decode_batches=(1, 2), decode_tokens=4)
    rows = bench.measure("ours", lambda ids, n: None, cfg, TINY, torch.device("cpu"))
    assert [r.batch for r in rows] == [1, 2] and math.isnan(rows[0].tokens_per_s)
    assert math.isclose(rows[1].tokens_per_s, 2 * 4 / 0.10)
