"""The end-to-end benchmark of chapter 14: ``python -m dsv2_lib bench`` (on a GPU).

Both engines load the same safetensors files — by default DeepSeek-V2-Lite with random bf16 weights,
written once from a fixed seed — and are measured in one run, one after the other, on the same
prompts (random token ids, greedy, EOS ignored so every request runs to its length):

* **prefill** tokens/s at ``B × n`` (default 1 × 512 and 8 × 512): ``B·n`` over the time to the first
  generated token of every request;
* **decode** tokens/s at batch 1, 8, 32, 128, steady state at context ≈ n: ``B·m`` over the time of
  ``w + m`` generated tokens minus the time of ``w`` — the difference removes the prefill and every
  step in which some request is still prefilling (``w``: :func:`decode_window_start`);
* the fraction of chapter 00's roofline each figure reaches (``roofline``), and the peak GPU memory.

Times are medians of ``repeats`` runs after a warm-up run, with the device synchronised around each.
transformers runs ``model.generate`` (greedy, ``min_new_tokens`` = ``max_new_tokens``) on a batch of
equal-length prompts. The result is a JSON record (GPU, versions, date, commit) and a bar chart.
"""
from __future__ import annotations

import datetime
import gc
import hashlib
import json
import math
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dsv2_lib.core.config import DEEPSEEK_V2_LITE, load_config
from dsv2_lib.engine.llm import LLM, resolve_model
from dsv2_lib.engine.sampling import SamplingParams
from dsv2_lib.tools import roofline
from dsv2_lib.tools.calibrate import load_tuning
from dsv2_lib.tools.random_checkpoint import write_random_checkpoint


@dataclass
class BenchConfig:
    """What to measure. ``model``: a checkpoint directory or ``"tiny"``; ``None`` writes DeepSeek-V2-Lite
    with random weights to ``checkpoint_dir`` (reused when it is already there)."""

    model: str | None = None
    checkpoint_dir: str = "/tmp/dsv2_bench_v2lite"
    device: str = "cuda"
    dtype: str = "bfloat16"
    prompt_len: int = 512
    prefill_batches: tuple[int, ...] = (1, 8)
    decode_batches: tuple[int, ...] = (1, 8, 32, 128)
    decode_tokens: int = 64  # m: tokens timed per decode measurement (ours)
    hf_decode_tokens: int = 8  # m for transformers, whose steps are slower
    repeats: int = 5
    transformers: bool = True
    seed: int = 0
    cuda_graphs: bool = True  # ours: steps of <= 512 tokens as CUDA graphs (False: eager, every launch from Python)
    async_scheduling: bool = True  # ours: step t+1 planned and launched before step t's tokens are read back
    gpu_memory_utilization: float | None = 0.85  # ours on a GPU: one KV pool for the whole run (graphs kept)
    tuning: str | None = None  # ours: a file of kernel-path thresholds (python -m dsv2_lib calibrate); None: the H200's


@dataclass
class Measurement:
    engine: str  # "ours" or "transformers"
    kind: str  # "prefill" or "decode"
    batch: int
    tokens_per_s: float
    seconds: list[float] = field(default_factory=list)  # the medians: [t(1 token)], or [t(w), t(w + m)] for decode
    roofline_fraction: float | None = None
    window_start: int | None = None  # decode: w, the tokens per request generated before the timed window


def checkpoint(cfg: BenchConfig) -> Path:
    """The checkpoint both engines load: ``cfg.model``, or DeepSeek-V2-Lite with random weights."""
    if cfg.model is not None:
        return resolve_model(cfg.model)
    path = Path(cfg.checkpoint_dir)
    if not (path / "model.safetensors.index.json").is_file():
        write_random_checkpoint(DEEPSEEK_V2_LITE, path, seed=cfg.seed, shard_bytes=4 << 30,
                                device="cuda" if torch.cuda.is_available() else "cpu")
    return path


def prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` random token ids (ids 0 and 1 left out: special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (batch, length), generator=g).tolist()


def _median_seconds(fn, repeats: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # warm-up: kernels compiled, caches and graphs built
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ours(llm: LLM, ids: list[list[int]], new_tokens: int) -> None:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.reset_prefix_cache()  # every run computes its prompts: an earlier run of the same prompts would hit
    out = llm.generate(ids, params, progress=False)
    assert all(len(o.token_ids) == new_tokens for o in out)


def _transformers(model, ids: list[list[int]], new_tokens: int) -> None:
    x = torch.tensor(ids, device=model.device)
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens)
    assert out.shape == (len(ids), x.shape[1] + new_tokens)


def decode_window_start(batch: int, prompt_len: int, step_budget: int | None) -> int:
    """``w``: tokens per request generated before the timed decode window opens.

    An engine that prefills every prompt in one step (transformers; ours without a token budget) has
    all requests decoding after their first token: ``w = 1``. With chunked prefill the prompts take
    about ``P = ceil(batch · prompt_len / budget)`` steps (decode tokens share the budget: ``P + 1`` at
    most while they are few); request group ``g`` produces its first token in step ``g``. A run of
    ``w >= P`` tokens then has the same ramp-up and ramp-down as a run of ``w + m``, which adds exactly
    ``m`` steps in which the whole batch decodes. ``t(1 + m) - t(1)`` would count the ramp's smaller,
    mixed steps as decode steps.
    """
    if step_budget is None:
        return 1
    return -(-batch * prompt_len // step_budget) + 1


def measure(engine: str, run, cfg: BenchConfig, model_cfg, device: torch.device,
            step_budget: int | None = None) -> list[Measurement]:
    """Prefill and decode measurements of one engine; ``run(ids, new_tokens)`` generates; ``step_budget``:
    the engine's tokens per step (chunked prefill), ``None`` if it prefills a batch in one step."""
    out, m = [], cfg.decode_tokens if engine == "ours" else cfg.hf_decode_tokens
    on_h200 = device.type == "cuda"
    for b in cfg.prefill_batches:
        ids = prompts(model_cfg.vocab_size, b, cfg.prompt_len, cfg.seed + b)
        t1 = _median_seconds(lambda: run(ids, 1), cfg.repeats, device)
        tps = b * cfg.prompt_len / t1
        out.append(Measurement(engine, "prefill", b, tps, [t1],
                               tps / roofline.prefill_roofline_tokens_per_s(model_cfg, b * cfg.prompt_len) if on_h200
                               else None))
    for b in cfg.decode_batches:
        ids = prompts(model_cfg.vocab_size, b, cfg.prompt_len, cfg.seed + b)
        w = decode_window_start(b, cfg.prompt_len, step_budget)
        tw = _median_seconds(lambda: run(ids, w), cfg.repeats, device)
        tm = _median_seconds(lambda: run(ids, w + m), cfg.repeats, device)
        # the m extra tokens' time; noise can make the longer run time shorter (on a busy CPU): not a number
        tps = b * m / (tm - tw) if tm > tw else math.nan
        limit = roofline.decode_roofline_tokens_per_s(model_cfg, b, cfg.prompt_len + w + m // 2)
        out.append(Measurement(engine, "decode", b, tps, [tw, tm], tps / limit if on_h200 else None, w))
    return out


def run(cfg: BenchConfig) -> dict:
    """Measure both engines; return the JSON record."""
    device = torch.device(cfg.device)
    path = checkpoint(cfg)
    model_cfg = load_config(path)
    results, memory = [], {}

    def peak_reset():
        gc.collect()  # the previous engine's weights, cache and graphs go before the next one loads
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)

    def peak() -> int | None:
        return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None

    peak_reset()
    llm = LLM(path, device=cfg.device, dtype=cfg.dtype, cuda_graphs=cfg.cuda_graphs,
              async_scheduling=cfg.async_scheduling, tuning=None if cfg.tuning is None else load_tuning(cfg.tuning),
              gpu_memory_utilization=cfg.gpu_memory_utilization if device.type == "cuda" else None)
    results += measure("ours", lambda ids, n: _ours(llm, ids, n), cfg, model_cfg, device,
                       llm.engine_config.max_num_batched_tokens)
    memory["ours"] = peak()
    llm = None  # the engine's memory goes before transformers loads
    if cfg.transformers:
        from transformers import DeepseekV2ForCausalLM

        peak_reset()
        hf = DeepseekV2ForCausalLM.from_pretrained(path, dtype=getattr(torch, cfg.dtype)).to(device).eval()
        with torch.no_grad():
            results += measure("transformers", lambda ids, n: _transformers(hf, ids, n), cfg, model_cfg, device)
        memory["transformers"] = peak()
        del hf
    peak_reset()
    return {
        "what": "end-to-end prefill and decode throughput, ours vs transformers, same checkpoint and prompts",
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()},
        "checkpoint": str(path),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "cuda": torch.version.cuda, "transformers": _version("transformers")},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "sources_sha256": _sources_sha256(),
        "results": [asdict(r) for r in results],
        "peak_memory_bytes": memory,
    }


def table(record: dict) -> str:
    """The record as a text table: one row per measurement, ours and transformers side by side."""
    rows = {}
    for r in record["results"]:
        rows.setdefault((r["kind"], r["batch"]), {})[r["engine"]] = r
    lines = [f"{'':8} {'batch':>5} {'ours tok/s':>11} {'roofline':>9} {'transformers':>13} {'speed-up':>9}"]
    for (kind, b), e in rows.items():
        ours, hf = e.get("ours"), e.get("transformers")
        frac = f"{ours['roofline_fraction']:.0%}" if ours and ours["roofline_fraction"] is not None else "-"
        lines.append(f"{kind:8} {b:>5} {ours['tokens_per_s'] if ours else float('nan'):>11.1f} {frac:>9} "
                     f"{hf['tokens_per_s'] if hf else float('nan'):>13.1f} "
                     f"{ours['tokens_per_s'] / hf['tokens_per_s'] if ours and hf else float('nan'):>8.1f}x")
    return "\n".join(lines)


def plot(record: dict, path: Path | None = None):
    """Bar chart of tokens/s per measurement, both engines, log scale: a matplotlib ``Figure`` (made
    without pyplot, so no global backend changes), written to ``path`` if given."""
    from matplotlib.figure import Figure

    keys = list(dict.fromkeys((r["kind"], r["batch"]) for r in record["results"]))
    fig = Figure(figsize=(8, 3.6))
    ax = fig.add_subplot()
    for off, engine in ((-0.2, "ours"), (0.2, "transformers")):
        vals = {(r["kind"], r["batch"]): r["tokens_per_s"] for r in record["results"] if r["engine"] == engine}
        ax.bar([i + off for i in range(len(keys))], [vals.get(k, 0) for k in keys], width=0.4, label=engine)
    ax.set_xticks(range(len(keys)), [f"{k} ×{b}" for k, b in keys])
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{record['gpu']}: prefill at {record['config']['prompt_len']} tokens, decode at context ≈ "
                 f"{record['config']['prompt_len']}")
    ax.legend()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def save(record: dict, out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``bench.json`` and ``bench.png`` to ``out_dir``; return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    js, png = out_dir / "bench.json", out_dir / "bench.png"
    js.write_text(json.dumps(record, indent=1) + "\n")
    plot(record, png)
    return js, png


def _version(package: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # noqa: BLE001 - a missing package is reported as None
        return None


def _sources_sha256(root: Path = Path(__file__).resolve().parents[2]) -> str:
    """SHA-256 over the engine's sources (``dsv2_lib/**/*.py`` and ``kernels_cu/**``, with their paths): names
    the measured code where git cannot, e.g. in a copy of the working tree whose ``.git`` is older."""
    h = hashlib.sha256()
    for p in sorted([*(root / "dsv2_lib").rglob("*.py"), *(root / "kernels_cu").rglob("*.cu*")]):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _commit() -> str | None:
    """The measured source's commit, ``+dirty`` when tracked files differ from it (what was measured is
    then not that commit)."""
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    try:
        return git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return None
