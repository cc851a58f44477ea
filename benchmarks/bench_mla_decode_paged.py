"""Benchmark of the paged latent decode kernel (chapter 13): ``python benchmarks/bench_mla_decode_paged.py``.

bf16, DeepSeek-V2-Lite's rows (16 heads, 512 + 64), a paged cache of 16-row blocks whose tables are
a random permutation of the pool. For each batch (equal lengths, and one of mixed lengths) it times
``mla_decode_paged`` with the balanced schedule (every pipeline depth) and chapter 10's uniform splits
(``mla_decode_paged_uniform``, its default configuration), and the balanced schedule over tables in
pool order (every entry's rows contiguous: what scattering the blocks costs), GPU time from replayed
CUDA graphs, and compares the cache bytes read per second with a copy of the same bytes. The bar: >= 75 %
of copy at 1 x 32768, 32 x 4096 and 128 x 1024. Pools smaller than 256 MB are replicated and
rotated so that L2 cannot serve them. Then, at the end-to-end bench's contexts (513 rows, batch 1 to
128), the balanced schedule's ``min_tiles``. These runs set ``DecodeTuning``'s defaults. JSON to
``$DSV2_RESULTS_DIR`` (default /tmp).
"""
from __future__ import annotations

import random
import sys
import time

import torch
from bench_mla_decode import copy_bandwidth, kernel_device, save

from dsv2_lib.lessons.mla_decode_split import mla_decode_paged_uniform
from dsv2_lib.ops.mla_decode import STAGES, DecodeTuning, mla_decode_paged, mla_decode_paged_reference
from dsv2_lib.tools import benchmark

H, DL, DR, SCALE, BLOCK = 16, 512, 64, 0.1147, 16
BARS = {"1x32768": [32768], "32x4096": [4096] * 32, "128x1024": [1024] * 128}
_rng = random.Random(0)  # Python's generator: the same lengths under every torch version (chapter 13 prints them)
EXTRA = {"64x4096": [4096] * 64, "1x4096": [4096], "64 mixed 1..8192": [_rng.randint(1, 8192) for _ in range(64)]}
BAR = 0.75
DEFAULT = DecodeTuning()
MIN_TILES = (1, 2, 4)  # the serving sweep's smallest tiles per worker (the default is DecodeTuning.min_tiles)


class Case:
    """One batch of ``lengths`` over a paged pool (replicated and rotated past L2): tables over a random
    permutation of the pool (``table``) and in pool order (``in_order``), and ``timed``."""

    def __init__(self, lengths: list[int], g: torch.Generator, dev: torch.device):
        self.lengths, B = lengths, len(lengths)
        self.need = [-(-n // BLOCK) for n in lengths]
        num_blocks = sum(self.need)
        self.nbytes = sum(lengths) * (DL + DR) * 2  # cache bytes the kernel reads
        self.pool_bytes = num_blocks * BLOCK * (DL + DR) * 2
        self.pools = benchmark.rotated(
            lambda: torch.randn(num_blocks * BLOCK, DL + DR, device=dev).to(torch.bfloat16), self.pool_bytes)
        self.table = self.as_table(torch.randperm(num_blocks, generator=g).tolist(), dev)
        self.in_order = self.as_table(list(range(num_blocks)), dev)  # every entry's rows contiguous in the pool
        self.q = (torch.randn(B, H, DL + DR, device=dev) * 0.1).to(torch.bfloat16)
        self.lens_t = torch.tensor(lengths, dtype=torch.int32, device=dev)
        self.out = torch.empty(B, H, DL, device=dev)
        self.i = 0
        self.want = {id(t): mla_decode_paged_reference(self.q, self.pools[0], t, lengths, BLOCK, SCALE, DL)
                     for t in (self.table, self.in_order)}
        self.tol = 4 * 2.0**-8 * self.pools[0].abs().max().float().item()  # tests/test_mla_decode_gpu.py's bound

    def as_table(self, blocks: list[int], dev) -> torch.Tensor:
        """Entry b takes the next need[b] blocks of ``blocks``; rows padded with -1."""
        it = iter(blocks)
        rows = [[next(it) for _ in range(k)] for k in self.need]
        return torch.tensor([r + [-1] * (max(self.need) - len(r)) for r in rows], dtype=torch.int32, device=dev)

    def run(self, tab, uniform=False, **kw):
        pool = self.pools[self.i % len(self.pools)]
        self.i += 1
        op = mla_decode_paged_uniform if uniform else mla_decode_paged
        op(self.q, pool, tab, self.lens_t, BLOCK, SCALE, DL, max_length=max(self.lengths), out=self.out, **kw)

    def timed(self, tab=None, **kw) -> float:
        """GPU ms of one call with ``kw`` (``uniform=True``: chapter 10's splits; else the balanced schedule
        with ``tuning``), after checking that configuration against the reference."""
        tab = self.table if tab is None else tab
        ms = benchmark.time_cuda_graph(lambda: self.run(tab, **kw), calls=max(20, len(self.pools)))
        self.i = 0
        self.run(tab, **kw)
        err = (self.out - self.want[id(tab)]).abs().max().item()
        assert err <= self.tol, f"{len(self.lengths)} entries, {kw}: error {err}"
        return ms

    def fraction(self, ms: float, copy_bw: float) -> float:
        return self.nbytes / (ms * 1e-3) / copy_bw


def serving(dev, g) -> list[dict]:
    """The contexts of the end-to-end bench (prompt 512 + a token): the balanced schedule's smallest
    tiles per worker (``min_tiles``), time per layer and for V2-Lite's 27 layers."""
    print(f"\nserving contexts (513 rows each): µs per call for min_tiles {', '.join(map(str, MIN_TILES))}")
    rows = []
    for B in (1, 8, 32, 128):
        case = Case([513] * B, g, dev)
        ms = {m: case.timed(tuning=DecodeTuning(min_tiles=m)) for m in MIN_TILES}
        best = min(ms, key=ms.get)
        print(f"{B:>5} x 513 | " + " ".join(f"{v * 1e3:>7.1f}" for v in ms.values())
              + f" | best min_tiles {best}: {27 * ms[best]:.2f} ms for 27 layers (default {DEFAULT.min_tiles}: "
              f"{27 * ms[DEFAULT.min_tiles]:.2f})")
        rows.append({"batch": B, "length": 513, "ms_by_min_tiles": {str(k): v for k, v in ms.items()}, "best": best})
        del case
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    dev = kernel_device()
    if dev is None:
        return 0
    t0, results = time.time(), []
    g = torch.Generator().manual_seed(1)
    print(f"{'batch':>18} {'MB':>7} | {'balanced µs (stages ' + ','.join(map(str, STAGES)) + ')':>36} "
          f"{'% copy':>7} | {'uniform µs':>10} {'% copy':>7} | {'in order µs':>10} {'% copy':>7} | {'copy GB/s':>9}")
    for name, lengths in {**BARS, **EXTRA}.items():
        case = Case(lengths, g, dev)
        balanced = {stages: case.timed(tuning=DecodeTuning(stages=stages)) for stages in STAGES}
        uniform = case.timed(uniform=True)
        _, copy_bw = copy_bandwidth(case.pools, case.pool_bytes)
        best = min(balanced, key=balanced.get)
        ordered = case.timed(case.in_order, tuning=DecodeTuning(stages=best))  # the same kernel, tables in pool order
        frac = {k: case.fraction(v, copy_bw) for k, v in balanced.items()}
        frac_u, frac_o = case.fraction(uniform, copy_bw), case.fraction(ordered, copy_bw)
        cells = " ".join(f"{v * 1e3:>7.1f}" for v in balanced.values())
        bar = f"  bar {'PASS' if frac[best] >= BAR else 'FAIL'}" if name in BARS else ""
        print(f"{name:>18} {case.nbytes / 1e6:>7.1f} | {cells:>36} {100 * frac[best]:>6.0f}% | {uniform * 1e3:>10.1f}"
              f" {100 * frac_u:>6.0f}% | {ordered * 1e3:>10.1f} {100 * frac_o:>6.0f}% | {copy_bw / 1e9:>9.0f}{bar}")
        results.append({"batch": name, "lengths": lengths if len(set(lengths)) > 1 else [lengths[0], len(lengths)],
                        "cache_bytes": case.nbytes, "balanced_ms": {str(k): v for k, v in balanced.items()},
                        "best_stages": best, "balanced_fraction_of_copy": frac[best], "uniform_ms": uniform,
                        "in_order_ms": ordered, "in_order_fraction_of_copy": frac_o,
                        "uniform_fraction_of_copy": frac_u, "copy_GBps": copy_bw / 1e9,
                        "bar": name in BARS, "bar_met": frac[best] >= BAR if name in BARS else None})
        del case
        torch.cuda.empty_cache()
    save("bench_mla_decode_paged.json", "paged latent MLA decode kernel, bf16, 16 heads x (512 + 64), 16-row blocks",
         f">= {BAR:.0%} of copy bandwidth at {', '.join(BARS)}", results, t0, serving=serving(dev, g))
    return 0


if __name__ == "__main__":
    sys.exit(main())
