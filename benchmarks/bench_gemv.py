"""Benchmark of the dense GEMV (chapter 14) on the GPU: ``python benchmarks/bench_gemv.py``.

For V2-Lite's projections in bf16 (the attention's q_proj, kv_a_proj_with_mqa and o_proj, layer 0's
gate_up and down, the LM head) and 1 to 4 tokens, the GPU time (replayed CUDA graphs,
``benchmark.time_cuda_graph``) of ``F.linear`` (cuBLAS) and of ``gemv.linear`` forced to the kernel,
each as bandwidth (the weight's bytes over the time) against a copy of the same bytes. Weights are
replicated and rotated past 256 MB so that L2 cannot serve them. The engine's threshold
``gemv.GEMV_MAX_TOKENS`` is the largest token count at which the kernel wins on every attention
projection. Then the same for the skinny GEMM (``gemv.linear_skinny``, tensor cores) at 3 to 64 tokens
on the same projections and the shared experts' (record section ``skinny``): the largest token count up
to which it wins on every attention projection. JSON to ``$DSV2_RESULTS_DIR`` (default /tmp) as
``bench_gemv.json``.
"""
from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
from bench_mla_decode import copy_bandwidth, kernel_device, save

from dsv2_lib.ops.gemv import GEMV_MAX_TOKENS, SKINNY_MAX_TOKENS, TOKENS_COMPILED, linear, linear_skinny
from dsv2_lib.tools import benchmark

SHAPES = {"q_proj": (3072, 2048), "kv_a_proj": (576, 2048), "o_proj": (2048, 2048),
          "mlp gate_up": (21888, 2048), "mlp down": (2048, 10944), "lm_head": (102400, 2048)}
SKINNY_SHAPES = {**SHAPES, "shared gate_up": (5632, 2048), "shared down": (2048, 2816)}
ATTENTION = ("q_proj", "kv_a_proj", "o_proj")
SKINNY_TOKENS = (3, 4, 8, 16, 32, 64)


def main() -> int:
    dev = kernel_device()
    if dev is None:
        return 0
    t0 = time.time()
    results, threshold = sweep(dev, SHAPES, range(1, TOKENS_COMPILED + 1), "gemv",
                               lambda x, w: linear(x, w, max_tokens=x.shape[0]))
    print(f"the GEMV wins on every attention projection up to {threshold} token(s); "
          f"gemv.GEMV_MAX_TOKENS = {GEMV_MAX_TOKENS}{'' if threshold == GEMV_MAX_TOKENS else '  <- update it'}")
    skinny, skinny_threshold = sweep(dev, SKINNY_SHAPES, SKINNY_TOKENS, "skinny", linear_skinny)
    print(f"the skinny GEMM wins on every attention projection up to {skinny_threshold} tokens; "
          f"gemv.SKINNY_MAX_TOKENS = {SKINNY_MAX_TOKENS}")
    save("bench_gemv.json", "dense GEMV vs cuBLAS, bf16, V2-Lite's projections", "faster than cuBLAS up to "
         "GEMV_MAX_TOKENS tokens on every attention projection", results, t0, measured_threshold=threshold,
         skinny=skinny, skinny_measured_threshold=skinny_threshold)
    return 0


def sweep(dev: torch.device, shapes: dict, tokens, name: str, ours) -> tuple[list[dict], int]:
    """cuBLAS against ``ours(x, w)`` on each of ``shapes`` (weights rotated past L2) at each of ``tokens``:
    the records (``cublas_ms``, ``<name>_ms`` and their fractions of a copy of the same bytes), and the
    largest token count up to which ours wins on every attention projection at every count measured."""
    rows, wins = [], {t: True for t in tokens}
    print(f"\n{'projection':>14} {'MB':>6} {'T':>2} | {'cuBLAS µs':>9} {'% copy':>6} | {name + ' µs':>9} {'% copy':>6}"
          " | speed-up")
    for proj, (n, k) in shapes.items():
        nbytes = n * k * 2
        weights = benchmark.rotated(lambda: (torch.randn(n, k, device=dev) / k**0.5).to(torch.bfloat16), nbytes)
        _, copy_bw = copy_bandwidth(weights, nbytes)
        for t in tokens:
            x = torch.randn(t, k, device=dev).to(torch.bfloat16)
            state = {"i": 0}

            def call(fn):
                w = weights[state["i"] % len(weights)]
                state["i"] += 1
                fn(x, w)

            ms = [benchmark.time_cuda_graph(lambda: call(fn), calls=max(20, len(weights))) for fn in (F.linear, ours)]
            frac = [nbytes / (m * 1e-3) / copy_bw for m in ms]
            print(f"{proj:>14} {nbytes / 1e6:>6.1f} {t:>2} | {ms[0] * 1e3:>9.1f} {100 * frac[0]:>5.0f}% |"
                  f" {ms[1] * 1e3:>9.1f} {100 * frac[1]:>5.0f}% | {ms[0] / ms[1]:>6.2f}x")
            if proj in ATTENTION:
                wins[t] &= ms[1] < ms[0]
            rows.append({"projection": proj, "n": n, "k": k, "tokens": t, "weight_bytes": nbytes, "cublas_ms": ms[0],
                         f"{name}_ms": ms[1], "cublas_fraction_of_copy": frac[0], f"{name}_fraction_of_copy": frac[1],
                         "copy_GBps": copy_bw / 1e9})
        weights = None  # freed before the next shape's copies
        torch.cuda.empty_cache()
    threshold = max([t for t in tokens if all(wins[s] for s in tokens if s <= t)], default=0)
    return rows, threshold


if __name__ == "__main__":
    sys.exit(main())
