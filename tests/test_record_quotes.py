"""Numbers the prose quotes from the committed benchmark records agree with those records: a new
`python -m dsv2_lib bench` (or `benchmarks/bench_prefill.py`, `benchmarks/bench_decode_step.py`) run that
changes a figure fails here until every sentence and table that quotes it is rewritten. Each quote is
rebuilt from the record with the prose's own formatting; whitespace (line breaks) is ignored."""
import json
import re
from pathlib import Path

import pytest
from test_book_surface import markdown

from dsv2_lib.core.config import DEEPSEEK_V2_LITE
from dsv2_lib.tools import roofline

ROOT = Path(__file__).resolve().parent.parent
BENCH = json.loads((ROOT / "benchmarks" / "bench.json").read_text())
PREFILL = {r["batch"]: r for r in json.loads((ROOT / "benchmarks" / "bench_prefill.json").read_text())["rows"]}
STEP = json.loads((ROOT / "benchmarks" / "bench_decode_step.json").read_text())["graph_ms"]


def _rate(engine: str, kind: str, batch: int) -> float:
    return next(r["tokens_per_s"] for r in BENCH["results"]
                if (r["engine"], r["kind"], r["batch"]) == (engine, kind, batch))


def _k(v: float, sep: str = "") -> str:  # 25466 -> "25.5k" (or "25.5 k" in a table)
    return f"{v / 1e3:.1f}{sep}k"


TARGETS = {1: 400, 32: 3_000, 128: 7_000}  # chapter 14's decode targets on an H200, tokens/s
PREFILL_TARGET = 90_000                       # and its prefill target at 8 x 512


def _verdict(d: dict, p: dict) -> str:
    """Chapter 14's summary of the record against the targets: rewritten when a target is met or missed."""
    if not all(d[b] >= t for b, t in TARGETS.items()) or p[8] >= PREFILL_TARGET:
        return "(a record that meets or misses other targets than the summary says: rewrite it)"
    return (f"meets the decode targets at batch 1, 32 and 128 ({d[1]:,.0f}, {d[32]:,.0f} and {d[128]:,.0f} "
            f"tokens/s) and misses eager prefill at 8 × 512 narrowly ({_k(p[8])})")


def _quotes() -> dict[str, list[str]]:
    d = {b: _rate("ours", "decode", b) for b in (1, 8, 32, 128)}
    hd = {b: _rate("transformers", "decode", b) for b in (1, 8, 32, 128)}
    p = {b: _rate("ours", "prefill", b) for b in (1, 8)}
    hp = {b: _rate("transformers", "prefill", b) for b in (1, 8)}
    frac = {r["batch"]: r["roofline_fraction"] for r in BENCH["results"]
            if (r["engine"], r["kind"]) == ("ours", "decode")}
    bound = {b: d[b] / frac[b] for b in frac}
    host, gpu = PREFILL[8]["host_ms"], PREFILL[8]["gpu_ms"]
    read_bound = roofline.prefill_roofline_tokens_per_s(DEEPSEEK_V2_LITE, BENCH["config"]["prompt_len"])
    return {
        "notebooks/00_inference_explained.ipynb": [
            f"batch-1 point, {hd[1]:.1f} tokens/s", f"at batch 128 it reaches {hd[128]:,.0f} tokens/s"],
        "notebooks/11_batching.ipynb": [
            f"grows {d[128] / d[1]:.0f}-fold and stays at "
            f"{100 * min(frac.values()):.0f}–{100 * max(frac.values()):.0f} % "
            f"of the bound, which grows {bound[128] / bound[1]:.0f}-fold"],
        "notebooks/14_performance.ipynb": [
            f"prefills at {_k(p[1])} tokens/s, {p[1] / hp[1]:.1f} times transformers",
            _verdict(d, p), f"decode at least {TARGETS[1]} tokens/s at batch 1, {TARGETS[32]:,} at batch 32 and "
            f"{TARGETS[128]:,} at batch 128", f"prefill at least {PREFILL_TARGET // 1000}k tokens/s at 8 × 512",
            f"1 × 512 prompt prefills at {_k(p[1])} tokens/s", f"(1 / {d[1]:.1f} tokens/s = {1e3 / d[1]:.2f} ms)",
            f"spending {host:.0f} ms on the host for {gpu:.0f} ms of GPU time",
            f"{100 * p[1] / read_bound:.0f} % of the {read_bound / 1e3:.0f}k that reading the weights allows",
            f"its forward costs {PREFILL[1]['host_ms']:.0f} ms of host time",
            f"from {STEP['ordinary']['1']:.2f} to {STEP['dependent']['1']:.2f} ms at batch 1"],
        "book/real_model.md": [
            f"| 1 | {d[1]:,.0f} | {hd[1]:.1f} |",
            *(f"| {b} | {d[b]:,.0f} | {hd[b]:,.0f} |" for b in (8, 32, 128)),
            *(f"| {b} | {_k(p[b], ' ')} | {_k(hp[b], ' ')} |" for b in (1, 8)),
            f"Our batch-1 decode reaches {100 * frac[1]:.0f} % of the bound",
            f"about {host:.0f} ms on the host to queue {gpu:.0f} ms of GPU work"],
    }


def _prose(path: Path) -> str:
    text = "\n".join(markdown(path)) if path.suffix == ".ipynb" else path.read_text()
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("name", sorted(_quotes()))
def test_the_prose_quotes_the_current_records(name):
    prose = _prose(ROOT / name)
    stale = [q for q in _quotes()[name] if q not in prose]
    assert not stale, f"{name} does not quote the committed record as {stale}: rewrite those sentences from the record"
