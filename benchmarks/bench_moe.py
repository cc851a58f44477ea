"""Benchmark of the DeepSeek-V2-Lite MoE layer on the GPU (chapter 08). Not collected by pytest.

    python benchmarks/bench_moe.py          # prints tables, writes $DSV2_RESULTS_DIR/bench_moe.json (or /tmp)

V2-Lite's shape: 64 routed experts x 1408, top-6, 2 shared experts, hidden 2048, bf16, random weights
(the same in all three implementations), router weights random so that the load is roughly uniform.

1. The layer at 1 / 32 / 512 / 4096 tokens: our MoE (GPU time from a CUDA-graph replay, and the time
   of a call from Python), transformers' DeepseekV2Moe, and the PyTorch baseline (our reference
   ``routed_experts`` + the shared MLP): ms, TFLOP/s (routed + shared FLOPs / time) and, at 1 and 32
   tokens, the weight-read time of the experts touched at the measured copy bandwidth.
2. The regimes behind the thresholds of ``MoETuning`` (dsv2_lib/ops/moe_experts.py): routed experts
   alone (``moe_experts``) with each path forced by a tuning record, at 1 ... 4096 tokens: the per-choice
   GEMV, the skinny GEMM, our mma GEMM, torch._grouped_mm, and chapter 08's grouped GEMV (each expert
   read once; a lesson, never recommended).
3. The grouped GEMV's variants on the whole layer (``moe_decode``) at 1 and 32 tokens (warps per block,
   columns per warp, shared experts' gate|up inside the router launch or not): which wins, and the bars.
4. Beyond the GEMV path, the shared experts on a side stream or not (``shared_stream_max_tokens``), whole
   layer, 8 ... 512 tokens: the largest size where the side stream still wins is the threshold.
5. On the GEMV path (1, 2, 4 tokens), ``moe_few`` (the router in one launch with the shared experts'
   gate|up beside it, the shared experts as GEMV choices: the default) or cuBLAS's router GEMV +
   ``topk_softmax`` + the GEMV kernels, with the shared MLP on the side stream; whole layer.
6. The skinny GEMM's tile height (``SKINNY_ROWS_COMPILED``: 8, 16, 32 sorted rows per tile) at 16 ... 128
   tokens: its alignment and two launches (``skinny_experts``), as a fraction of the copy bandwidth over
   the bytes of the experts touched. Taller tiles read an expert with more than 8 choices fewer times,
   but hold more accumulators and inputs in registers.

It ends with the ``MoETuning(...)`` that sections 2 and 4 recommend (``recommend_moe`` of
``dsv2_lib/tools/calibrate.py``, which ``python -m dsv2_lib calibrate`` runs on a GPU's own sweep).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import torch

from dsv2_lib.core.config import DEEPSEEK_V2_LITE as CFG
from dsv2_lib.core.dtypes import default_dtype
from dsv2_lib.lessons import moe_grouped
from dsv2_lib.model import moe
from dsv2_lib.model.moe import MoE
from dsv2_lib.ops.moe_experts import MoETuning, moe_experts, routed_experts, skinny_experts
from dsv2_lib.ops.moe_routing import SKINNY_ROWS, SKINNY_ROWS_COMPILED, route
from dsv2_lib.tools.benchmark import time_cuda, time_cuda_graph
from dsv2_lib.tools.calibrate import MOE_FORCE, MOE_PATHS, NEVER, recommend_moe

SIZES = (1, 32, 512, 4096)
SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
STREAM_SWEEP = (8, 16, 32, 64, 128, 512)
FOLD_SIZES = (1, 2, 4)
SKINNY_SIZES = (16, 32, 64, 128)
GEMV_SWEEP_MAX = 256  # the GEMV paths are timed up to this many tokens
VARIANTS = [dict(warps=w, cols_per_warp=c, shared_in_router=r)
            for w, c in ((8, 1), (4, 1), (8, 2), (4, 2), (8, 4)) for r in (True, False)]
BARS = {1: ("ours/read", 1.6), 32: ("ours/read", 2.0), 512: ("TFLOP/s", 150.0), 4096: ("TFLOP/s", 400.0)}
H, I, E, K, S = CFG.hidden_size, CFG.moe_intermediate_size, CFG.n_routed_experts, CFG.num_experts_per_tok, CFG.n_shared_experts
EXPERT_BYTES = 3 * H * I * 2  # gate, up, down of one expert in bf16


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write)."""
    a = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    ms = time_cuda(lambda: b.copy_(a), warmup=3, iters=10, inner=3)
    return 2 * a.numel() * 2 / (ms * 1e-3)


def build():
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    torch.manual_seed(0)
    with torch.device("cuda"), default_dtype(torch.bfloat16):
        ours = MoE(CFG)
        hf = DeepseekV2Moe(DeepseekV2Config(**CFG.to_hf_dict()))
    hf = hf.to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        hf.gate.weight.data = ours.gate.weight.detach().clone()  # fp32 router in both
        hf.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)
        hf.experts.down_proj.copy_(ours.experts.down_proj)
        gu = ours.shared_experts.gate_up_proj.weight
        hf.shared_experts.gate_proj.weight.copy_(gu[: S * I])
        hf.shared_experts.up_proj.weight.copy_(gu[S * I :])
        hf.shared_experts.down_proj.weight.copy_(ours.shared_experts.down_proj.weight)
    return ours, hf


def flops(t: int) -> float:
    return t * (K + S) * 3 * 2 * H * I


def skinny_tile_heights(gate_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, bw: float) -> list[dict]:
    """Section 6: the skinny GEMM's two launches and their alignment (``skinny_experts``) at each tile height
    of ``SKINNY_ROWS_COMPILED`` and ``SKINNY_SIZES`` tokens routed by ``gate_w``: ms (GPU time) and the
    fraction of the copy bandwidth ``bw`` (bytes/s) over the bytes of the experts touched."""
    out = []
    with torch.no_grad():
        for t in SKINNY_SIZES:
            x = torch.randn(t, H, device="cuda").to(torch.bfloat16)
            _, ids = route(torch.nn.functional.linear(x.float(), gate_w), CFG)
            touched = int(ids.unique().numel())
            r = {"tokens": t, "experts_touched": touched, "max_choices_per_expert": int(ids.flatten().bincount().max())}
            for rows in SKINNY_ROWS_COMPILED:
                ms = time_cuda_graph(lambda: skinny_experts(x, ids, gate_up, down, rows=rows), calls=10)
                r[f"rows_{rows}_ms"] = ms
                r[f"rows_{rows}_fraction_of_copy"] = touched * EXPERT_BYTES / bw / (ms * 1e-3)
            out.append(r)
    return out


PATHS = MOE_PATHS[:1] + ("gemv_grouped",) + MOE_PATHS[1:]  # the engine's paths and chapter 08's grouped GEMV


def main() -> None:
    out_dir = Path(os.environ.get("DSV2_RESULTS_DIR", "/tmp"))
    start = time.time()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    bw = copy_bandwidth()
    ours, hf = build()

    def baseline(x):  # the PyTorch baseline: our reference (sort + one matmul pair per expert) + shared MLP
        w, ids = route(torch.nn.functional.linear(x.float(), ours.gate.weight), CFG)
        e = ours.experts
        return routed_experts(x, w, ids, e.gate_up_proj, e.down_proj) + ours.shared_experts(x)

    rows, checks = [], []
    with torch.no_grad():
        for t in SIZES:
            x = torch.randn(t, H, device="cuda").to(torch.bfloat16)
            _, ids = route(torch.nn.functional.linear(x.float(), ours.gate.weight), CFG)
            touched = int(ids.unique().numel())
            slow = dict(warmup=2, iters=5, inner=2)
            r = {
                "tokens": t,
                "experts_touched": touched,
                "ours_graph_ms": time_cuda_graph(lambda: ours(x), calls=10),
                "ours_call_ms": time_cuda(lambda: ours(x)),
                "transformers_ms": time_cuda(lambda: hf(x[None])[0], **slow),
                "baseline_ms": time_cuda(lambda: baseline(x), **slow),
                "flop": flops(t),
                "weight_read_ms": (touched + S) * EXPERT_BYTES / bw * 1e3,
            }
            for key in ("ours_graph", "ours_call", "transformers", "baseline"):
                r[key + "_tflops"] = r["flop"] / (r[key + "_ms"] * 1e-3) / 1e12
            r["ours_over_weight_read"] = r["ours_graph_ms"] / r["weight_read_ms"]
            a, b = ours(x).float(), hf(x[None])[0].float()
            checks.append({"tokens": t, "max_abs_diff_vs_transformers": float((a - b).abs().max()),
                           "max_abs_ref": float(b.abs().max())})
            rows.append(r)

        sweep = []
        gate_up, down = ours.experts.gate_up_proj, ours.experts.down_proj
        limits = {"gemv": 64, "gemv_grouped": GEMV_SWEEP_MAX, "skinny": GEMV_SWEEP_MAX}  # the GEMVs stop early
        for t in SWEEP:
            x = torch.randn(t, H, device="cuda").to(torch.bfloat16)
            w, ids = route(torch.nn.functional.linear(x.float(), ours.gate.weight), CFG)
            r = {"tokens": t, "routed_flop": t * K * 3 * 2 * H * I}
            for name in PATHS:
                if t > limits.get(name, t) or name == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
                    continue
                if name == "gemv_grouped":
                    run = lambda: moe_grouped.grouped_experts(x, w, ids, gate_up, down)
                else:
                    run = lambda: moe_experts(x, w, ids, gate_up, down, tuning=MOE_FORCE[name])
                r[name + "_ms"] = time_cuda_graph(run, calls=3)
            sweep.append(r)

        # the grouped GEMV's variants on the whole layer (moe_decode after the router GEMM), at 1 and 32 tokens
        sh = ours.shared_experts
        shared_w = (sh.gate_up_proj.weight, sh.down_proj.weight)

        def decode(x, **variant):
            logits = torch.nn.functional.linear(x.float(), ours.gate.weight)
            return moe_grouped.moe_decode(x, logits, CFG, gate_up, down, shared_w, **variant)

        variants = []
        for v in VARIANTS:
            r = dict(v)
            for t in (1, 32):
                x = torch.randn(t, H, device="cuda").to(torch.bfloat16)
                r[f"ms_{t}"] = time_cuda_graph(lambda: decode(x, **v), calls=10)
            variants.append(r)
        # the per-choice GEMV on the whole layer (moe_few up to 32 tokens), the shared experts as more of its choices
        ours.tuning = MoETuning(gemv_max_tokens=32)
        per_choice = {}
        for t in (1, 32):
            x = torch.randn(t, H, device="cuda").to(torch.bfloat16)
            per_choice[f"ms_{t}"] = time_cuda_graph(lambda: ours(x), calls=10)

        # the shared experts on a side stream (NEVER: always) or on the layer's stream (0)
        streams = []
        for t in STREAM_SWEEP:
            x = torch.randn(t, H, device="cuda").to(torch.bfloat16)
            r = {"tokens": t}
            for name, limit in (("side_ms", NEVER), ("one_ms", 0)):
                ours.tuning = MoETuning(shared_stream_max_tokens=limit)
                r[name] = time_cuda_graph(lambda: ours(x), calls=10)
            streams.append(r)
        ours.tuning = MoETuning()

        # moe_few, or the router GEMV + topk_softmax + GEMVs with the shared MLP on the side stream
        fold, applies = [], moe.few_applies
        for t in FOLD_SIZES:
            x = torch.randn(t, H, device="cuda").to(torch.bfloat16)
            r = {"tokens": t, "moe_few_ms": time_cuda_graph(lambda: ours(x), calls=10)}
            moe.few_applies = lambda *a: False
            r["mlp_side_stream_ms"] = time_cuda_graph(lambda: ours(x), calls=10)
            moe.few_applies = applies
            fold.append(r)
        skinny_rows = skinny_tile_heights(ours.gate.weight, gate_up, down, bw)

    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; GPU {torch.cuda.get_device_name()}")
    print(f"{'tokens':>6} {'ours ms':>9} {'(call)':>8} {'HF ms':>8} {'base ms':>8} {'ours TF/s':>9} "
          f"{'weights ms':>10} {'ours/read':>9}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['ours_graph_ms']:>9.4f} {r['ours_call_ms']:>8.3f} {r['transformers_ms']:>8.3f} "
              f"{r['baseline_ms']:>8.3f} {r['ours_graph_tflops']:>9.1f} {r['weight_read_ms']:>10.4f} "
              f"{r['ours_over_weight_read']:>9.2f}")
    for r in rows:
        name, bar = BARS.get(r["tokens"], (None, None))
        if name:
            val = r["ours_over_weight_read"] if name == "ours/read" else r["ours_graph_tflops"]
            ok = val <= bar if name == "ours/read" else val >= bar
            faster = r["ours_graph_ms"] < min(r["transformers_ms"], r["baseline_ms"])
            print(f"bar at {r['tokens']:>4} tokens: {name} {val:.2f} {'<=' if name == 'ours/read' else '>='} {bar}: "
                  f"{'MET' if ok else 'FAIL'}; faster than transformers and baseline: {faster}")
    print("\nrouted experts alone, each path forced (ms, GPU time; gemv_grouped = chapter 08's lesson):")
    print(f"{'tokens':>6} " + " ".join(f"{n:>12}" for n in PATHS) + "  fastest")
    recommended = recommend_moe(sweep, streams)
    for r in sweep:
        print(f"{r['tokens']:>6} " + " ".join(f"{r.get(n + '_ms', float('nan')):>12.4f}" for n in PATHS) + f"  {r['fastest']}")
    print("\nthe grouped GEMV's variants, whole layer (ms, GPU time):")
    print(f"{'warps':>5} {'cols/warp':>9} {'shared in router':>16} {'1 token':>9} {'32 tokens':>9}")
    for v in variants:
        print(f"{v['warps']:>5} {v['cols_per_warp']:>9} {str(v['shared_in_router']):>16} {v['ms_1']:>9.4f} {v['ms_32']:>9.4f}")
    print(f"{'per-choice GEMV (shared experts as choices)':>32} {per_choice['ms_1']:>9.4f} {per_choice['ms_32']:>9.4f}")
    read = {r["tokens"]: r["weight_read_ms"] for r in rows}
    for t in (1, 32):
        best = min(variants, key=lambda v: v[f"ms_{t}"])
        cur = next(v for v in variants if (v["warps"], v["cols_per_warp"], v["shared_in_router"])
                   == (moe_grouped.WARPS, moe_grouped.COLS_PER_WARP, False))
        print(f"best at {t:>2} tokens: warps {best['warps']}, cols/warp {best['cols_per_warp']}, shared in router "
              f"{best['shared_in_router']}: {best[f'ms_{t}']:.4f} ms = {best[f'ms_{t}'] / read[t]:.2f} x read "
              f"(bar {BARS[t][1]}); the lesson's defaults: {cur[f'ms_{t}']:.4f} ms")
    print("\nshared experts on a side stream or on the layer's stream, whole layer (ms, GPU time):")
    print(f"{'tokens':>6} {'side':>9} {'one':>9}")
    for r in streams:
        print(f"{r['tokens']:>6} {r['side_ms']:>9.4f} {r['one_ms']:>9.4f}")
    print("\nmoe_few, or router GEMV + topk_softmax + GEMVs with the shared MLP on the side stream, whole layer "
          "(ms, GPU time):")
    print(f"{'tokens':>6} {'moe_few':>9} {'MLP':>9}")
    for r in fold:
        print(f"{r['tokens']:>6} {r['moe_few_ms']:>9.4f} {r['mlp_side_stream_ms']:>9.4f}")
    print(f"\nthe skinny GEMM's tile height, routed experts' GEMMs alone (ms, GPU time; fraction of the copy "
          f"bandwidth over the experts touched; the engine's: {SKINNY_ROWS} rows):")
    print(f"{'tokens':>6} {'touched':>7} {'most':>4} " + " ".join(f"{f'{r_} rows':>16}" for r_ in SKINNY_ROWS_COMPILED))
    for r in skinny_rows:
        print(f"{r['tokens']:>6} {r['experts_touched']:>7} {r['max_choices_per_expert']:>4} " + " ".join(
            f"{r[f'rows_{r_}_ms']:>8.4f} ({r[f'rows_{r_}_fraction_of_copy']:.2f})" for r_ in SKINNY_ROWS_COMPILED))
    for c in checks:
        print(f"ours vs transformers at {c['tokens']} tokens: max |diff| {c['max_abs_diff_vs_transformers']:.3g} "
              f"(max |out| {c['max_abs_ref']:.3g})")
    print(f"\nrecommended: {recommended} (a crossover lies between a threshold and the next size measured)\n"
          f"set now:     {MoETuning()}")
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "copy_bandwidth_Bps": bw,
        "tuning": dataclasses.asdict(MoETuning()), "recommended": dataclasses.asdict(recommended),
        "layer": rows, "paths": sweep, "gemv_variants": variants, "per_choice_layer": per_choice,
        "shared_stream": streams, "moe_few": fold, "skinny_rows": skinny_rows, "checks": checks,
        "seconds": time.time() - start,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_moe.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out_dir / 'bench_moe.json'} in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
