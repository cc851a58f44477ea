"""Where a decode step's time goes on a GPU: kernels against the gaps between them (chapter 14).
Not collected by pytest.

    python benchmarks/bench_decode_step.py   # prints a table, writes $DSV2_RESULTS_DIR/bench_decode_step.json (or /tmp)

DeepSeek-V2-Lite with random bf16 weights made on the GPU (no checkpoint), B sequences of 512 cached
tokens each decoding one token, as the engine's CUDA graph runs the step (chapter 14):

* **graph**: milliseconds per replayed step, with programmatic dependent launch (Hopper and later) and
  without it (every kernel launched the ordinary way; the graphs captured again);
* **profile** of one replay without dependent launch (with it, a kernel's profiled time includes the
  time its blocks wait parked for the kernel ahead, so durations overlap): the number of kernels, their
  summed time (**busy**), first start to last end (**span**), and **gaps** = span - busy, the time the
  GPU spends between kernels (negative where a side stream's kernels overlap the main stream's: up to
  16 tokens, chapter 14); then busy time by kind of kernel, and every kernel (costliest first: the record
  holds all of them, the printout the twelve costliest and every one that PyTorch launches itself).
* **skinny**: milliseconds per replayed step at 3 to 8 sequences with every ``Linear``'s skinny GEMM off
  (cuBLAS) and at the engine's ``SKINNY_MAX_TOKENS``: the end-to-end check of the per-call choice that
  ``benchmarks/bench_gemv.py`` makes, side streams and all.

Dependent launch is switched off by patching what :class:`~dsv2_lib.core.kernels.KernelFile` asks
(``programmatic_launch_supported``) and forgetting its cached launchers: a measurement's switch, not
an engine setting.
"""
from __future__ import annotations

import collections
import datetime
import json
import os
import time
from pathlib import Path

import torch
from bench_prefill import random_init  # benchmarks/: the same random weights as the prefill benchmark
from torch.profiler import ProfilerActivity, profile

from dsv2_lib.core import dependent_launch, kernels
from dsv2_lib.core.config import DEEPSEEK_V2_LITE as CFG
from dsv2_lib.core.dtypes import default_dtype
from dsv2_lib.engine.graph_runner import DecodeGraphRunner
from dsv2_lib.model.cache import PagedLatentCache
from dsv2_lib.model.deepseek_v2 import DeepseekV2
from dsv2_lib.model.layers import Linear
from dsv2_lib.ops.gemv import SKINNY_MAX_TOKENS
from dsv2_lib.tools import bench

CONTEXT, BLOCK, BATCHES, STEPS = 512, 16, (1, 8, 32, 128), 50
SKINNY_BATCHES = (3, 4, 6, 8)  # sequences at which the dense projections' skinny GEMM is weighed end to end
PER_SEQUENCE = CONTEXT // BLOCK + 1  # blocks per sequence: its context and the new token's row
KINDS = (("linear_gemv", "projections (our GEMV)"), ("linear_skinny", "projections (our skinny GEMM)"),
         ("mla_absorb", "MLA absorbed products"),
         ("mla_decode", "MLA decode attention"), ("moe_route", "MoE routing"), ("topk", "MoE routing"),
         ("moe", "MoE experts"), ("latent_rows", "latent rows (norm, RoPE, cache write)"), ("rms_norm", "RMSNorm"),
         ("rope", "RoPE"), ("cache", "cache write"),
         ("embed", "embedding"), ("nvjet", "cuBLAS"), ("gemm", "cuBLAS"), ("cutlass", "cuBLAS"), ("sm90", "cuBLAS"),
         ("silu", "SwiGLU"))


def kind(kernel_name: str) -> str:
    n = kernel_name.lower()
    return next((k for key, k in KINDS if key in n), "other torch ops")


def step_inputs(B: int) -> tuple:
    """``(ids, starts, tables, slots)`` of B sequences at position CONTEXT, each in blocks of its own."""
    tables = [list(range(b * PER_SEQUENCE, (b + 1) * PER_SEQUENCE)) for b in range(B)]
    slots = [t[CONTEXT // BLOCK] * BLOCK + CONTEXT % BLOCK for t in tables]
    return [(7 * b + 3) % (CFG.vocab_size - 2) + 2 for b in range(B)], [CONTEXT] * B, tables, slots


def ms_per_step(runner: DecodeGraphRunner, inputs: tuple) -> float:
    runner(*inputs)  # capture (or warm up)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        runner(*inputs)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / STEPS * 1e3


def dependent_launches(on: bool) -> None:
    """Launch the waiting kernels as dependent launches (where the GPU has them) or the ordinary way."""
    kernels.programmatic_launch_supported = dependent_launch.programmatic_launch_supported if on else (lambda i: False)
    kernels._launchers.clear()


def skinny_step_ms(model: DeepseekV2, cache: PagedLatentCache) -> dict:
    """Milliseconds per replayed step at each of ``SKINNY_BATCHES`` with every ``Linear``'s
    ``skinny_max_tokens`` at 0 (cuBLAS from 3 tokens) and at ``SKINNY_MAX_TOKENS``; the model's own
    thresholds are put back after."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    own = [m.skinny_max_tokens for m in linears]
    ms = {}
    for threshold in (0, SKINNY_MAX_TOKENS):
        for m in linears:
            m.skinny_max_tokens = threshold
        runner = DecodeGraphRunner(model, cache)
        ms[threshold] = {B: ms_per_step(runner, step_inputs(B)) for B in SKINNY_BATCHES}
        del runner
    for m, t in zip(linears, own):
        m.skinny_max_tokens = t
    return ms


def replay_profile(runner: DecodeGraphRunner, inputs: tuple) -> dict:
    """Kernels of one replay (the last of three profiled): count, busy, span and gaps (ms), busy by kind,
    and every kernel's busy time and launches, costliest first."""
    runner(*inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            runner(*inputs)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    events = events[-(len(events) // 3):]
    busy = sum(e.time_range.elapsed_us() for e in events) / 1e3
    span = (events[-1].time_range.end - events[0].time_range.start) / 1e3
    by_kind, by_name = collections.Counter(), collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        by_kind[kind(e.name)] += e.time_range.elapsed_us() / 1e3
        by_name[e.name][0] += e.time_range.elapsed_us() / 1e3
        by_name[e.name][1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    return {"kernels": len(events), "busy_ms": busy, "span_ms": span, "gaps_ms": span - busy,
            "busy_ms_by_kind": dict(by_kind.most_common()),
            "by_kernel": [{"name": n[:160], "kind": kind(n), "ms": ms, "count": c} for n, (ms, c) in ranked]}


def main() -> None:
    out_dir = Path(os.environ.get("DSV2_RESULTS_DIR", "/tmp"))
    with torch.device("cuda"), default_dtype(torch.bfloat16):
        model = DeepseekV2(CFG)
    random_init(model)
    model.eval()
    cache = PagedLatentCache(CFG, max(BATCHES) * PER_SEQUENCE, BLOCK, torch.bfloat16, "cuda",
                             max_len=PER_SEQUENCE * BLOCK)
    cache.rows.normal_(0, 0.5)
    dependent = dependent_launch.programmatic_launch_supported(torch.cuda.current_device())
    graph_ms = {}
    for on in (True, False) if dependent else (False,):
        dependent_launches(on)
        runner = DecodeGraphRunner(model, cache)
        graph_ms["dependent" if on else "ordinary"] = {B: ms_per_step(runner, step_inputs(B)) for B in BATCHES}
        del runner
    dependent_launches(dependent)  # as the engine launches
    skinny_ms = skinny_step_ms(model, cache) if SKINNY_MAX_TOKENS else {}
    dependent_launches(False)
    runner = DecodeGraphRunner(model, cache)
    profiles = {B: replay_profile(runner, step_inputs(B)) for B in BATCHES}
    dependent_launches(True)
    print(f"{torch.cuda.get_device_name()}; one decode step of B sequences at context {CONTEXT}, CUDA graph")
    print(f"{'B':>4} " + " ".join(f"{k + ' ms':>13}" for k in graph_ms)
          + f" {'kernels':>8} {'busy ms':>8} {'span ms':>8} {'gaps ms':>8}")
    for B in BATCHES:
        p = profiles[B]
        print(f"{B:4d} " + " ".join(f"{graph_ms[k][B]:13.3f}" for k in graph_ms)
              + f" {p['kernels']:8d} {p['busy_ms']:8.3f} {p['span_ms']:8.3f} {p['gaps_ms']:8.3f}")
    if skinny_ms:
        print(f"\ndense projections of 3 to {SKINNY_MAX_TOKENS} tokens, ms per step: cuBLAS | skinny GEMM")
        for B in SKINNY_BATCHES:
            print(f"{B:4d} {skinny_ms[0][B]:8.3f} | {skinny_ms[SKINNY_MAX_TOKENS][B]:8.3f}")
    for B in BATCHES:
        print(f"\nB = {B}, busy ms by kind:", {k: round(v, 3) for k, v in profiles[B]["busy_ms_by_kind"].items()})
        for i, t in enumerate(profiles[B]["by_kernel"]):  # the costliest, and every kernel torch launches
            if i < 12 or t["kind"] == "other torch ops":
                print(f"  {t['ms']:7.3f} ms {t['count']:4d} x  {t['name'][:110]}")
    record = {"gpu": torch.cuda.get_device_name(), "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "sources_sha256": bench._sources_sha256(),
              "context": CONTEXT, "steps": STEPS, "graph_ms": graph_ms, "profiles": profiles,
              "skinny_ms": skinny_ms}
    (out_dir / "bench_decode_step.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
