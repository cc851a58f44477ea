"""Benchmark of the paged latent decode kernel (chapter 13): ``python tests/bench_mla_decode_paged.py``.

bf16, DeepSeek-V2-Lite's rows (16 heads, 512 + 64), a paged cache of 16-row blocks whose tables are
a random permutation of the pool. For each batch (equal lengths, and one of mixed lengths) it times
``mla_decode_paged`` with the balanced schedule (the default; every pipeline depth) and with the
uniform splits of chapter 10 (its default configuration), and the balanced schedule over tables in
pool order (every entry's rows contiguous: what scattering the blocks costs), GPU time from replayed
CUDA graphs, and compares the cache bytes read per second with a copy of the same bytes. The bar (issue 7): >= 75 %
of copy at 1 x 32768, 32 x 4096 and 128 x 1024. Pools smaller than 256 MB are replicated and
rotated so that L2 cannot serve them. JSON to ``$DSV2_RESULTS_DIR`` (default /tmp).
"""
from __future__ import annotations

import os
import random
import sys
import time

import torch
from bench_mla_decode import copy_bandwidth, rotated, save

from dsv2_lib import benchmark
from dsv2_lib.mla_decode import STAGES, mla_decode_paged, mla_decode_paged_reference

H, DL, DR, SCALE, BLOCK = 16, 512, 64, 0.1147, 16
BARS = {"1x32768": [32768], "32x4096": [4096] * 32, "128x1024": [1024] * 128}
_rng = random.Random(0)  # Python's generator: the same lengths under every torch version (chapter 13 prints them)
EXTRA = {"64x4096": [4096] * 64, "1x4096": [4096], "64 mixed 1..8192": [_rng.randint(1, 8192) for _ in range(64)]}
BAR = 0.75


def main() -> int:
    if not torch.cuda.is_available():
        print("no GPU: nothing to measure")
        return 0
    os.environ.setdefault("DSV2_BACKEND", "cuda")
    dev, t0, results = torch.device("cuda"), time.time(), []
    g = torch.Generator().manual_seed(1)
    print(f"{'batch':>18} {'MB':>7} | {'balanced µs (stages ' + ','.join(map(str, STAGES)) + ')':>36} "
          f"{'% copy':>7} | {'uniform µs':>10} {'% copy':>7} | {'in order µs':>10} {'% copy':>7} | {'copy GB/s':>9}")
    for name, lengths in {**BARS, **EXTRA}.items():
        B, need = len(lengths), [-(-n // BLOCK) for n in lengths]
        num_blocks = sum(need)
        nbytes = sum(lengths) * (DL + DR) * 2  # cache bytes the kernel reads
        pools = rotated(lambda: torch.randn(num_blocks * BLOCK, DL + DR, device=dev).to(torch.bfloat16),
                        num_blocks * BLOCK * (DL + DR) * 2)
        def as_table(blocks: list[int]) -> torch.Tensor:
            """Entry b takes the next need[b] blocks of ``blocks``; rows padded with -1."""
            it = iter(blocks)
            rows = [[next(it) for _ in range(k)] for k in need]
            return torch.tensor([r + [-1] * (max(need) - len(r)) for r in rows], dtype=torch.int32, device=dev)

        table = as_table(torch.randperm(num_blocks, generator=g).tolist())
        in_order = as_table(list(range(num_blocks)))  # every entry's rows contiguous in the pool
        q = (torch.randn(B, H, DL + DR, device=dev) * 0.1).to(torch.bfloat16)
        lens_t = torch.tensor(lengths, dtype=torch.int32, device=dev)
        out = torch.empty(B, H, DL, device=dev)
        state = {"i": 0}

        def run(tab, **kw):
            pool = pools[state["i"] % len(pools)]
            state["i"] += 1
            mla_decode_paged(q, pool, tab, lens_t, BLOCK, SCALE, DL, max_length=max(lengths), out=out, **kw)

        want = {id(t): mla_decode_paged_reference(q, pools[0], t, lengths, BLOCK, SCALE, DL) for t in (table, in_order)}
        tol = 4 * 2.0**-8 * pools[0].abs().max().float().item()  # tests/test_mla_decode_gpu.py's bound

        def timed(tab=table, **kw) -> float:
            """GPU ms of one call with ``kw``, after checking that configuration against the reference."""
            ms = benchmark.time_cuda_graph(lambda: run(tab, **kw), calls=max(20, len(pools)))
            state["i"] = 0
            run(tab, **kw)
            err = (out - want[id(tab)]).abs().max().item()
            assert err <= tol, f"{name}, {kw}: error {err}"
            return ms

        balanced = {stages: timed(stages=stages) for stages in STAGES}
        uniform = timed(schedule="uniform")
        _, copy_bw = copy_bandwidth(pools, num_blocks * BLOCK * (DL + DR) * 2)
        best = min(balanced, key=balanced.get)
        # the same kernel over tables in pool order: what scattering the blocks costs
        ordered = timed(in_order, stages=best)
        frac = {k: nbytes / (v * 1e-3) / copy_bw for k, v in balanced.items()}
        frac_u = nbytes / (uniform * 1e-3) / copy_bw
        cells = " ".join(f"{v * 1e3:>7.1f}" for v in balanced.values())
        bar = f"  bar {'PASS' if frac[best] >= BAR else 'FAIL'}" if name in BARS else ""
        print(f"{name:>18} {nbytes / 1e6:>7.1f} | {cells:>36} {100 * frac[best]:>6.0f}% | {uniform * 1e3:>10.1f}"
              f" {100 * frac_u:>6.0f}% | {ordered * 1e3:>10.1f} {100 * nbytes / (ordered * 1e-3) / copy_bw:>6.0f}%"
              f" | {copy_bw / 1e9:>9.0f}{bar}")
        results.append({"batch": name, "lengths": lengths if len(set(lengths)) > 1 else [lengths[0], B],
                        "cache_bytes": nbytes, "balanced_ms": {str(k): v for k, v in balanced.items()},
                        "best_stages": best, "balanced_fraction_of_copy": frac[best], "uniform_ms": uniform,
                        "in_order_ms": ordered, "in_order_fraction_of_copy": nbytes / (ordered * 1e-3) / copy_bw,
                        "uniform_fraction_of_copy": frac_u, "copy_GBps": copy_bw / 1e9,
                        "bar": name in BARS, "bar_met": frac[best] >= BAR if name in BARS else None})
        del pools
        torch.cuda.empty_cache()
    save("bench_mla_decode_paged.json", "paged latent MLA decode kernel, bf16, 16 heads x (512 + 64), 16-row blocks",
         f">= {BAR:.0%} of copy bandwidth at {', '.join(BARS)}", results, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
