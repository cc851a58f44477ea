"""Benchmark of chapter 10's latent decode kernel (``dsv2_lib/lessons/mla_decode_split.py``, uniform split-KV
over a contiguous cache) on the GPU: ``python benchmarks/bench_mla_decode.py``. Its sweep sets the lesson's
defaults (``mla_decode_config``, ``FUSED_MAX_SPLITS``).

For each (batch, context) in bf16, DeepSeek-V2-Lite's rows (16 heads, 512 + 64):

* ``kernel``: ``mla_decode`` with its default configuration (``mla_decode_config``), GPU time from
  a replayed CUDA graph (``benchmark.time_cuda_graph``); then every candidate — split count ×
  pipeline depth (``STAGES``) × combine (a second kernel ``k`` or fused into the last block ``f``) —
  printed as a grid per shape, and the winner;
* ``copy``: ``dst.copy_(src)`` of the same cache bytes, the practical bandwidth limit
  (bytes read + written over its time);
* ``torch``: the reference (``mla_decode_reference``, fp32 einsums per sequence) and a batched
  bf16 torch version (two ``bmm`` on cuBLAS, fp32 softmax), timed per call.

Bandwidth = cache bytes read (batch × context × 576 × 2) over the time. The bar: the
kernel at >= 70 % of the copy bandwidth at 64 × 4096 and 1 × 32768, judged for the default and for
the best candidate (PASS/FAIL per bar at the end). Caches smaller than 256 MB
are replicated and rotated between calls so that L2 (50 MB) cannot serve them. Writes JSON to
``$DSV2_RESULTS_DIR`` (default /tmp) as ``bench_mla_decode.json``.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

from dsv2_lib.lessons import mla_decode_split as mla_mod
from dsv2_lib.lessons.mla_decode_split import mla_decode, mla_decode_counters, mla_decode_workspace
from dsv2_lib.ops.mla_decode import STAGES, mla_decode_reference
from dsv2_lib.tools import benchmark

H, DL, DR, SCALE = 16, 512, 64, 0.1147
BARS = [(64, 4096), (1, 32768)]
EXTRA = [(1, 4096), (8, 4096), (32, 8192), (128, 2048), (4, 32768)]


def copy_bandwidth(tensors: list[torch.Tensor], nbytes: int) -> tuple[float, float]:
    """(ms, bytes/s) of ``dst.copy_(src)`` over the rotated ``tensors`` of ``nbytes`` each: bytes read + written."""
    dsts = [torch.empty_like(t) for t in tensors[:2]]
    state = {"i": 0}

    def copy():
        j = state["i"]
        state["i"] += 1
        dsts[j % len(dsts)].copy_(tensors[j % len(tensors)])

    ms = benchmark.time_cuda_graph(copy, calls=max(20, len(tensors)))
    return ms, 2 * nbytes / (ms * 1e-3)


def batched_torch(q, rows):
    """q [B, h, 576] bf16, rows [B, L, 576] bf16 -> [B, h, 512] fp32 (cuBLAS bmm, fp32 softmax)."""
    s = torch.bmm(q, rows.transpose(1, 2)).float() * SCALE
    p = s.softmax(-1).to(rows.dtype)
    return torch.bmm(p, rows[..., :DL]).float()


def kernel_device() -> torch.device | None:
    """The GPU the kernel benchmarks measure on, every op forced to its kernel (``DSV2_BACKEND=cuda``);
    ``None``, after saying so, on a machine without one."""
    if not torch.cuda.is_available():
        print("no GPU: nothing to measure")
        return None
    os.environ.setdefault("DSV2_BACKEND", "cuda")
    return torch.device("cuda")


def main() -> int:
    dev = kernel_device()
    if dev is None:
        return 0
    t_start = time.time()
    results = []
    rows = []
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    header = (f"{'batch':>5} {'ctx':>6} {'MB':>7} | {'kernel µs':>9} {'GB/s':>6} {'% copy':>6} |"
              f" {'best µs':>8} {'% copy':>6} {'(splits,stages,fused)':>18} | {'copy GB/s':>9} | {'ref µs':>8} {'bmm µs':>8} |"
              f" bar default/best")
    for B, L in BARS + EXTRA:
        nbytes = B * L * (DL + DR) * 2
        caches = benchmark.rotated(lambda: torch.randn(B, L, DL + DR, device=dev).to(torch.bfloat16), nbytes)
        n_rot = len(caches)
        q = (torch.randn(B, H, DL + DR, device=dev) * 0.1).to(torch.bfloat16)
        slots = torch.arange(B, dtype=torch.int32, device=dev)
        lengths = torch.full((B,), L, dtype=torch.int32, device=dev)
        out = torch.empty(B, H, DL, device=dev)
        ws = mla_decode_workspace(4096, H, 1, DL, dev)  # room for batch × splits <= 4096
        counters = mla_decode_counters(B, H, dev)
        state = {"i": 0}

        def run(splits=None, stages=None, fused=None):
            cache = caches[state["i"] % n_rot]
            state["i"] += 1
            mla_decode(q, cache, slots, lengths, SCALE, DL, max_length=L, out=out, workspace=ws,
                       num_splits=splits, stages=stages, fused=fused, counters=counters)

        ms = benchmark.time_cuda_graph(run, calls=max(20, n_rot))
        # correctness of the default configuration on this shape
        want = mla_decode_reference(q, caches[0], list(range(B)), [L] * B, SCALE, DL)
        mla_decode(q, caches[0], slots, lengths, SCALE, DL, max_length=L, out=out, workspace=ws, counters=counters)
        err = (out - want).abs().max().item()
        tol = 4 * 2.0**-8 * caches[0].abs().max().float().item()  # tests/test_mla_decode_gpu.py's bound
        sweep = {}
        split_set = sorted(s for s in {1, 2, 4, 8, 16, 32, 64, 128, 256} & set(range(1, L // 32 + 1))
                           if 32 <= B * s <= 600)  # from a quarter wave (1 block per 4 SMs) to ~2 waves at 2 per SM
        for stages in STAGES:
            for fused in (False, True):
                for splits in split_set:
                    if fused and splits == 1:
                        continue
                    sweep[(splits, stages, fused)] = benchmark.time_cuda_graph(
                        lambda: run(splits, stages, fused), calls=max(20, n_rot))
                    # the candidate is correct on this shape (checked once, on cache 0)
                    mla_decode(q, caches[0], slots, lengths, SCALE, DL, max_length=L, out=out, workspace=ws,
                               num_splits=splits, stages=stages, fused=fused, counters=counters)
                    e = (out - want).abs().max().item()
                    assert e <= tol, f"candidate {(splits, stages, fused)} wrong: error {e}"
        best = min(sweep, key=sweep.get)
        print(f"  {B} x {L}: candidates, µs (rows: stages, k = combine kernel / f = fused; columns: splits)")
        print("    " + " " * 6 + "".join(f"{sp:>8}" for sp in split_set))
        for stages in STAGES:
            for fused in (False, True):
                cells = "".join(f"{sweep[(sp, stages, fused)] * 1e3:>8.1f}" if (sp, stages, fused) in sweep
                                else f"{'':>8}" for sp in split_set)
                print(f"    {stages}{'f' if fused else 'k':<5}{cells}")
        print(f"    winner: splits {best[0]}, stages {best[1]}, {'fused' if best[2] else 'combine kernel'}:"
              f" {sweep[best] * 1e3:.1f} µs")
        copy_ms, copy_bw = copy_bandwidth(caches, nbytes)
        ref_list = list(range(B))
        ref_ms = benchmark.time_cuda(lambda: mla_decode_reference(q, caches[0], ref_list, [L] * B, SCALE, DL),
                                     warmup=2, iters=5, inner=1)
        bmm_ms = benchmark.time_cuda(lambda: batched_torch(q, caches[0]), warmup=3, iters=10, inner=2)
        bw = nbytes / (ms * 1e-3)
        frac = bw / copy_bw
        is_bar = (B, L) in BARS
        best_frac = nbytes / (sweep[best] * 1e-3) / copy_bw
        rows.append(f"{B:>5} {L:>6} {nbytes / 1e6:>7.1f} | {ms * 1e3:>9.1f} {bw / 1e9:>6.0f} {100 * frac:>5.0f}% |"
                    f" {sweep[best] * 1e3:>8.1f} {100 * best_frac:>5.0f}% {str(best):>18} | {copy_bw / 1e9:>9.0f} |"
                    f" {ref_ms * 1e3:>8.0f} {bmm_ms * 1e3:>8.0f} |"
                    f" {('PASS' if frac >= 0.7 else 'FAIL') + '/' + ('PASS' if best_frac >= 0.7 else 'FAIL') if is_bar else ''}")
        results.append({
            "batch": B, "context": L, "cache_bytes": nbytes, "kernel_ms": ms, "kernel_GBps": bw / 1e9,
            "fraction_of_copy": frac, "best_ms": sweep[best], "best_splits": best[0], "best_stages": best[1],
            "best_fused": best[2], "best_fraction_of_copy": best_frac,
            "default_config": [None if x is None else x for x in mla_mod.mla_decode_config(B, H, L, sms)],
            "sweep_ms": {f"{s}x{st}{'f' if fu else 'k'}": v for (s, st, fu), v in sweep.items()},
            "copy_ms": copy_ms, "copy_GBps": copy_bw / 1e9, "torch_reference_ms": ref_ms, "torch_bmm_ms": bmm_ms,
            "max_abs_err_vs_reference": err, "bar": is_bar, "bar_met": frac >= 0.7 if is_bar else None,
            "bar_met_by_best": best_frac >= 0.7 if is_bar else None,
        })
        caches = ws = None  # free this shape's caches
        torch.cuda.empty_cache()
    print("\n" + header)
    print("\n".join(rows))
    for r in results:
        if r["bar"]:
            print(f"bar {r['batch']} x {r['context']}: default {100 * r['fraction_of_copy']:.1f} % of copy"
                  f" {'PASS' if r['bar_met'] else 'FAIL'}; best {100 * r['best_fraction_of_copy']:.1f} %"
                  f" (splits {r['best_splits']}, stages {r['best_stages']}, fused {r['best_fused']})"
                  f" {'PASS' if r['bar_met_by_best'] else 'FAIL'}")
    save("bench_mla_decode.json", "latent MLA decode kernel, bf16, 16 heads x (512 + 64)",
         ">= 70% of copy bandwidth at 64x4096 and 1x32768", results, t_start)
    return 0


def save(name: str, what: str, bar: str, results: list, t_start: float, **extra) -> None:
    """The benchmark's JSON record (GPU, torch, date, bar, results, ``extra`` sections, seconds) to
    ``$DSV2_RESULTS_DIR/name``."""
    record = {"what": what, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "bar": bar, "results": results, **extra, "seconds": time.time() - t_start}
    path = Path(os.environ.get("DSV2_RESULTS_DIR", "/tmp")) / name
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path} ({record['seconds']:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
