"""Benchmark of chapter 06: causal prefill attention, bf16, 16 heads, QK 192 / V 128 (H200).

    python benchmarks/bench_attention_prefill.py        # table on stdout, JSON in $DSV2_RESULTS_DIR (or /tmp)

For each shape B x n (1x256 .. 8x4096, nothing cached) it times our kernels (naive only up to
n = 512: at 4096 it takes seconds; every tensor-core variant, the engine's two and the lesson's
others: lessons/attention_prefill.ALL_MMA_VARIANTS), the
engine's default choice, the engine's SDPA path ("sdpa": including the copy of k_pe to every head,
timed alone as "sdpa_prep"), and torch's
scaled_dot_product_attention with each backend: cuDNN and memory-efficient on the real shapes
(V head 128), FlashAttention with V zero-padded to 192 (it needs equal head sizes; the padding
costs it 192/128 of the P V work, counted as wasted). FLOPs count the causal work once:
2 * (192 + 128) * h * sum_b n_b (n_b + 1) / 2. The engine's rule (attention.AttentionTuning:
sdpa_min_tokens, sdpa_min_max_len) compares our best variant with "sdpa", SDPA as the engine runs it
(k_pe copy included): the bare cuDNN call is faster still but is not what the engine can call. The
run ends with the AttentionTuning values it measured (the defaults are this benchmark's on the H200).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dsv2_lib.lessons import attention_prefill as lesson
from dsv2_lib.ops import attention
from dsv2_lib.tools.benchmark import time_cuda, time_cuda_graph

H, SCALE = 16, 0.114721
SHAPES = [(1, 256), (1, 512), (8, 512), (1, 1024), (1, 4096), (8, 4096)]
BAR_TFLOPS = 200.0  # the bar for our kernel at 8 x 4096


def flops(B: int, n: int) -> float:
    return 2 * (192 + 128) * H * B * n * (n + 1) / 2


def timed(fn) -> float:
    """Milliseconds per call: CUDA-graph replay for fast calls, a few plain calls for slow ones."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = (time.perf_counter() - t0) * 1e3
    if once > 20:
        return time_cuda(fn, warmup=1, iters=3, inner=1)
    return time_cuda_graph(fn, calls=max(1, min(20, int(20 / max(once, 1e-3)))))


def main() -> dict:
    dev = torch.device("cuda")
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    print(f"{'shape':>8} {'version':>16} {'ms':>10} {'TFLOP/s':>9}  max|err| vs SDPA")
    for B, n in SHAPES:
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(B * n, H, 192, device=dev, generator=g, dtype=torch.bfloat16)
        kv = torch.randn(B * n, H, 256, device=dev, generator=g, dtype=torch.bfloat16)
        k_pe = torch.randn(B * n, 576, device=dev, generator=g, dtype=torch.bfloat16)[:, 512:]
        k_nope, v = kv[..., :128], kv[..., 128:]
        cu = [n * i for i in range(B + 1)]  # host lists: no host sync inside the calls, graph-capturable
        # SDPA inputs in its [B, h, n, d] layout, prepared once (the engine would pay the expansion of k_pe)
        k_full = torch.cat([k_nope, k_pe[:, None, :].expand(-1, H, -1)], -1)
        qs, ks, vs = (x.reshape(B, n, H, -1).transpose(1, 2) for x in (q, k_full, v))
        v_pad = F.pad(vs, (0, 64))
        runs = {
            **{name: (lambda name=name: lesson.prefill_attention_version(q, k_nope, k_pe, v, cu, cu, SCALE, name))
               for name in ("naive", "tiled", *lesson.ALL_MMA_VARIANTS)},
            "engine": lambda: attention.prefill_attention(q, k_nope, k_pe, v, cu, cu, SCALE),
            "sdpa": lambda: attention.prefill_attention(q, k_nope, k_pe, v, cu, cu, SCALE, version="sdpa"),
        }
        if n > 512:
            del runs["naive"]
        if n > 1024 and B > 1:
            del runs["tiled"]  # ~0.1 s a call: the 1 x 4096 row shows its rate
        sdpa = {"sdpa_cudnn": (SDPBackend.CUDNN_ATTENTION, vs), "sdpa_flash_vpad": (SDPBackend.FLASH_ATTENTION, v_pad),
                "sdpa_efficient": (SDPBackend.EFFICIENT_ATTENTION, vs)}
        for name, (backend, vv) in sdpa.items():
            def call(backend=backend, vv=vv):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(qs, ks, vv, is_causal=True, scale=SCALE)
            runs[name] = call
        prep_ms = timed(lambda: attention.sdpa_prep(k_nope, k_pe))
        ref = None
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=SCALE).transpose(1, 2).reshape(B * n, H, 128)
        row = {}
        for name, fn in runs.items():
            try:
                out = fn()
                if out.dim() == 4:
                    out = out[..., :128].transpose(1, 2).reshape(B * n, H, 128)
                err = (out.float() - ref.float()).abs().max().item()
                ms = timed(fn)
            except RuntimeError as e:  # a backend that does not take this shape on this GPU
                print(f"{B}x{n:>6} {name:>16} {'n/a':>10}            ({str(e).splitlines()[0][:60]})")
                row[name] = None
                continue
            tf = flops(B, n) / (ms * 1e-3) / 1e12
            row[name] = {"ms": ms, "tflops": tf, "max_abs_err": err}
            print(f"{B}x{n:>6} {name:>16} {ms:>10.4f} {tf:>9.1f}  {err:.2e}")
        row["sdpa_prep"] = {"ms": prep_ms}
        print(f"{B}x{n:>6} {'sdpa_prep':>16} {prep_ms:>10.4f}            (k_pe copied to every head: part of 'sdpa')")
        sdpa_best = max((row[k]["tflops"] for k in sdpa if row.get(k)), default=None)
        row["sdpa_best_tflops"] = sdpa_best
        ours = {k: row[k]["tflops"] for k in lesson.ALL_MMA_VARIANTS if row.get(k)}
        best = max(ours, key=ours.get) if ours else None
        row["best_variant"] = best
        row["best_variant_tflops"] = ours.get(best)
        row["engine_choice"] = attention.prefill_backend(B * n, n)
        row["kernel_beats_sdpa"] = bool(best and sdpa_best and ours[best] > sdpa_best)
        row["kernel_beats_engine_sdpa"] = bool(best and row.get("sdpa") and ours[best] > row["sdpa"]["tflops"])
        results["shapes"][f"{B}x{n}"] = row
        print(f"{B}x{n:>6} best variant {best} {ours.get(best, 0):.1f} TFLOP/s vs best torch SDPA "
              f"{sdpa_best or 0:.1f} (engine's SDPA path {row['sdpa']['tflops'] if row.get('sdpa') else 0:.1f}): "
              f"{'KERNEL' if row['kernel_beats_engine_sdpa'] else 'SDPA'} wins in the engine; engine chose "
              f"{row['engine_choice']}")
    big = results["shapes"]["8x4096"]
    results["bar"] = {"what": "best tensor-core variant TFLOP/s at 8 x 4096, bf16", "need": BAR_TFLOPS,
                      "variant": big["best_variant"], "got": big["best_variant_tflops"],
                      "first_version_mma": big["mma"]["tflops"] if big.get("mma") else None,
                      "met": bool(big["best_variant_tflops"] and big["best_variant_tflops"] >= BAR_TFLOPS)}
    small = results["shapes"]["1x512"]
    results["beats_sdpa_at_1x512"] = small["kernel_beats_sdpa"]
    print(f"bar: {results['bar']}; our best variant beats the best SDPA at 1x512: {results['beats_sdpa_at_1x512']}")
    # crossover: the shortest single sequence (B = 1, so tokens = max_len, the one threshold calibrate sets
    # for both) from which the engine's SDPA path wins at every longer measured one
    singles = sorted(((k, r) for k, r in results["shapes"].items() if k.startswith("1x")),
                     key=lambda kv: int(kv[0].split("x")[1]))
    sdpa_from = None
    for key, row in reversed(singles):
        if row["kernel_beats_engine_sdpa"]:
            break
        sdpa_from = key
    results["crossover"] = {"sdpa_wins_from": sdpa_from,
                            "kernel_variant_large": big["best_variant"],
                            "kernel_variant_small": results["shapes"]["1x256"]["best_variant"]}
    print(f"crossover: the engine's SDPA path wins at every measured single sequence from {sdpa_from} up "
          "(None: our kernel wins at the largest)")
    print(f"suggested AttentionTuning: sdpa_min_tokens = sdpa_min_max_len = "
          f"{int(sdpa_from.split('x')[1]) if sdpa_from else 'beyond the largest shape'}; "
          f"kernel_variant = {big['best_variant']!r}; small_kernel_variant = "
          f"{results['shapes']['1x256']['best_variant']!r} (a variant outside attention.MMA_VARIANTS "
          "moves there from dsv2_lib/lessons/attention_prefill.py)")
    path = Path(os.environ.get("DSV2_RESULTS_DIR", "/tmp")) / "bench_attention_prefill.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
