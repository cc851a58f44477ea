"""Where a prefill step's time goes on the GPU machine: the host's work against the GPU's (chapter 14).
Not collected by pytest.

    python benchmarks/bench_prefill.py      # prints a table, writes $DSV2_RESULTS_DIR/bench_prefill.json (or /tmp)
    python benchmarks/bench_prefill.py --profile   # also: the host's time per op and module in one 1 x 512 forward

DeepSeek-V2-Lite with random bf16 weights made on the GPU (no checkpoint), B x 512-token prompts
(B = 1, 8) in one step, as the engine runs them:

* **host**: the time until the forward pass returns, i.e. until the host has queued every kernel
  (the GPU still running), then **wall**: until the GPU is done, synchronised before and after;
* **GPU**: the same forward queued behind a ~100 ms spin kernel, so that the host is far ahead and
  the GPU never waits for it; the difference between wall and GPU is what the host costs;
* **generate**: ``LLM.generate(prompts, max_tokens=1)``, timed as ``python -m dsv2_lib bench`` times
  prefill (with the scheduler, the block manager, sampling; prefix cache reset before each run).

Medians of 7 runs after a warm-up. A step whose host time is close to its GPU time runs at the
host's speed, which varies between machines; a faster host or fewer launches per layer helps it.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import dsv2_lib.engine.llm as llm_module
from dsv2_lib.core.config import DEEPSEEK_V2_LITE as CFG
from dsv2_lib.model.cache import PagedBatch, PagedLatentCache
from dsv2_lib.tools import bench

PROMPT, BLOCK, REPEATS = 512, 16, 7


def random_init(model: torch.nn.Module, path=None, progress=None) -> None:
    """Fill the model with random weights on its device (norm weights near 1); the checkpoint loader's signature."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1, 0.1) if name.endswith("norm.weight") else p.normal_(0, 0.02)


def forward_step(llm: llm_module.LLM, B: int):
    """A function that runs one B x 512 prefill forward (and the last positions' logits) as the engine does."""
    per = -(-PROMPT // BLOCK)
    cache = PagedLatentCache(CFG, B * per, BLOCK, torch.bfloat16, "cuda")
    tables = tuple(tuple(range(b * per, (b + 1) * per)) for b in range(B))
    slots = tuple(t[p // BLOCK] * BLOCK + p % BLOCK for t in tables for p in range(PROMPT))
    tokens = torch.randint(2, CFG.vocab_size, (B * PROMPT,), device="cuda")
    last = torch.arange(PROMPT - 1, B * PROMPT, PROMPT, device="cuda")

    def step():
        batch = PagedBatch((0,) * B, (PROMPT,) * B, tables, BLOCK, slots, device=torch.device("cuda"), host_checked=True)
        return llm.model.compute_logits(llm.model(tokens, batch, cache)[last])

    return step


def forward_times(llm: llm_module.LLM, B: int) -> dict:
    """Host, wall and GPU-only milliseconds of one B x 512 prefill forward (median of REPEATS)."""
    step = forward_step(llm, B)
    step()
    host, wall, gpu = [], [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append(t1 - t0)
        wall.append(time.perf_counter() - t0)
        torch.cuda._sleep(200_000_000)  # ~100 ms of spinning: the host queues the whole step meanwhile
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) / 1e3)
    return {k: statistics.median(v) * 1e3 for k, v in (("host_ms", host), ("wall_ms", wall), ("gpu_ms", gpu))}


def profile_host(llm: llm_module.LLM) -> None:
    """Print where the host spends a 1 x 512 forward: torch.profiler's ops by self CPU time, and the
    number of kernel launches (CuPy's launches are not ops: they show as time between ops)."""
    from torch.profiler import ProfilerActivity, profile

    step = forward_step(llm, 1)
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=False) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"GPU kernels in one 1 x {PROMPT} forward: {len(kernels)}")


def main() -> None:
    import sys
    out_dir = Path(os.environ.get("DSV2_RESULTS_DIR", "/tmp"))
    model_dir = Path(tempfile.mkdtemp())
    (model_dir / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    llm_module.load_checkpoint = random_init  # random weights instead of a 31 GB checkpoint on disk
    llm = llm_module.LLM(model_dir, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.85)
    if "--profile" in sys.argv[1:]:
        profile_host(llm)
    rows = []
    for B in (1, 8):
        r = {"batch": B, **forward_times(llm, B)}
        ids = bench.prompts(CFG.vocab_size, B, PROMPT, seed=B)
        t = bench._median_seconds(lambda: bench._ours(llm, ids, 1), REPEATS, torch.device("cuda"))
        r["generate_ms"], r["generate_tok_s"] = t * 1e3, B * PROMPT / t
        rows.append(r)
    print(f"{torch.cuda.get_device_name()}; prefill of B x {PROMPT} tokens, ms (median of {REPEATS})")
    print(f"{'B':>3} {'host':>8} {'wall':>8} {'GPU':>8} {'generate':>9} {'tok/s':>9} {'GPU-bound tok/s':>16}")
    for r in rows:
        print(f"{r['batch']:3d} {r['host_ms']:8.1f} {r['wall_ms']:8.1f} {r['gpu_ms']:8.1f} {r['generate_ms']:9.1f} "
              f"{r['generate_tok_s']:9,.0f} {r['batch'] * PROMPT / r['gpu_ms'] * 1e3:16,.0f}")
    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "sources_sha256": bench._sources_sha256(),
              "prompt_len": PROMPT, "repeats": REPEATS, "rows": rows}
    (out_dir / "bench_prefill.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
