"""Benchmark of the DeepSeek-V2-Lite MoE layer on the GPU (chapter 08). Not collected by pytest.

    python benchmarks/bench_moe.py          # prints tables, writes $DSV2_RESULTS_DIR/bench_moe.json (or /tmp)

V2-Lite's shape: 64 routed experts x 1408, top-6, 2 shared experts, hidden 2048, bf16, random weights
(the same in all three implementations), router weights random so that the load is roughly uniform.

1. The layer at 1 / 32 / 512 / 4096 tokens: our MoE (GPU time from a CUDA-graph replay, and the time
   of a call from Python), transformers' DeepseekV2Moe, and the PyTorch baseline (our reference
   ``routed_experts`` + the shared MLP): ms, TFLOP/s (routed + shared FLOPs / time) and, at 1 and 32
   tokens, the weight-read time of the experts touched at the measured copy bandwidth.
2. The regimes behind the thresholds in dsv2_lib/model/moe.py (GEMV_MAX_TOKENS, SKINNY_MAX_TOKENS,
   GROUPED_MM_MIN_TOKENS): routed experts alone (``moe_experts``) with each path forced, at 1 ... 4096
   tokens: the per-choice GEMV (first version), the grouped GEMV (each expert read once), the skinny
   GEMM, our mma GEMM, torch._grouped_mm; and the thresholds this sweep recommends.
3. The grouped GEMV's variants on the whole layer at 1 and 32 tokens (warps per block, columns per
   warp, shared experts' gate|up inside the router launch or not): which wins, and the bars.
4. Beyond the GEMV path, the shared experts on a side stream or not (SHARED_STREAM_MAX_TOKENS), whole
   layer, 8 ... 512 tokens: the largest size where the side stream still wins is the threshold.
5. On the GEMV path (1, 2, 4 tokens), ``moe_few`` (the router in one launch with the shared experts'
   gate|up beside it, the shared experts as GEMV choices: the default) or cuBLAS's router GEMV +
   ``topk_softmax`` + the GEMV kernels, with the shared MLP on the side stream; whole layer.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from dsv2_lib.core.config import DEEPSEEK_V2_LITE as CFG
from dsv2_lib.core.dtypes import default_dtype
from dsv2_lib.model import moe
from dsv2_lib.model.moe import MoE, route, routed_experts
from dsv2_lib.tools.benchmark import time_cuda, time_cuda_graph

SIZES = (1, 32, 512, 4096)
SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
STREAM_SWEEP = (8, 16, 32, 64, 128, 512)
FOLD_SIZES = (1, 2, 4)
GEMV_SWEEP_MAX = 256  # the GEMV paths are timed up to this many tokens
VARIANTS = [dict(GEMV_WARPS=w, GEMV_COLS_PER_WARP=c, SHARED_IN_ROUTER=r)
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


PATHS = ("gemv_choice", "gemv", "skinny", "mma", "grouped_mm")  # per-choice GEMV, grouped GEMV, skinny GEMM, mma GEMM, cuBLAS


def recommend(sweep: list[dict]) -> dict:
    """The thresholds the sweep (routed experts alone, each path forced; rows ``{"tokens", "<path>_ms"}``
    in increasing tokens, a path absent where it was not run) recommends; sets each row's ``"fastest"``.
    GEMV up to the last size of the leading run where a GEMV kernel is fastest of all (``GEMV_KERNEL``:
    the one of the two that wins more of those sizes); then the skinny GEMM up to the last size of the
    run that follows where it is fastest (0: no such run); beyond, grouped_mm from the first size where
    it beats mma at every larger size (1: at every size the kernels before it do not take)."""
    for r in sweep:
        r["fastest"] = min((r[n + "_ms"], n) for n in PATHS if n + "_ms" in r)[1]
    gemv_max, wins = 0, {"gemv_choice": 0, "gemv": 0}
    for r in sweep:
        if r["fastest"] not in wins:
            break
        gemv_max = r["tokens"]
        wins[r["fastest"]] += 1
    skinny_max = 0
    for r in (r for r in sweep if r["tokens"] > gemv_max):
        if r["fastest"] != "skinny":
            break
        skinny_max = r["tokens"]
    beyond = [r for r in sweep if r["tokens"] > max(gemv_max, skinny_max) and "grouped_mm_ms" in r]
    mm_min = next((r["tokens"] for i, r in enumerate(beyond)
                   if all(b["grouped_mm_ms"] < b["mma_ms"] for b in beyond[i:])), None)
    if beyond and mm_min == beyond[0]["tokens"]:
        mm_min = 1
    return {"GEMV_MAX_TOKENS": gemv_max, "GEMV_KERNEL": "per_choice" if wins["gemv_choice"] >= wins["gemv"] else "grouped",
            "SKINNY_MAX_TOKENS": skinny_max, "GROUPED_MM_MIN_TOKENS": mm_min}


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

        knobs = ("GEMV_MAX_TOKENS", "SKINNY_MAX_TOKENS", "GROUPED_MM_MIN_TOKENS", "GEMV_KERNEL")
        sweep, defaults = [], [getattr(moe, k) for k in knobs]
        gate_up, down = ours.experts.gate_up_proj, ours.experts.down_proj
        paths = {"gemv_choice": (10**9, 0, 10**9, "per_choice"), "gemv": (10**9, 0, 10**9, "grouped"),
                 "skinny": (0, 10**9, 10**9, "grouped"), "mma": (0, 0, 10**9, "grouped"), "grouped_mm": (0, 0, 1, "grouped")}
        for t in SWEEP:
            x = torch.randn(t, H, device="cuda").to(torch.bfloat16)
            w, ids = route(torch.nn.functional.linear(x.float(), ours.gate.weight), CFG)
            r = {"tokens": t, "routed_flop": t * K * 3 * 2 * H * I}
            for name, values in paths.items():
                if name == "gemv_choice" and t > 64 or name in ("gemv", "skinny") and t > GEMV_SWEEP_MAX \
                        or name == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
                    continue
                for k, v in zip(knobs, values):
                    setattr(moe, k, v)
                r[name + "_ms"] = time_cuda_graph(lambda: moe.moe_experts(x, w, ids, gate_up, down), calls=3)
            sweep.append(r)
        for k, v in zip(knobs, defaults):
            setattr(moe, k, v)

        # the grouped GEMV's variants on the whole layer (the fused decode path), at 1 and 32 tokens
        variants, saved = [], {k: getattr(moe, k) for k in VARIANTS[0]}
        saved_max = moe.GEMV_MAX_TOKENS
        moe.GEMV_MAX_TOKENS = max(moe.GEMV_MAX_TOKENS, 32)
        for v in VARIANTS:
            for k, val in v.items():
                setattr(moe, k, val)
            r = dict(v)
            for t in (1, 32):
                x = torch.randn(t, H, device="cuda").to(torch.bfloat16)
                r[f"ms_{t}"] = time_cuda_graph(lambda: ours(x), calls=10)
            variants.append(r)
        for k, val in saved.items():
            setattr(moe, k, val)
        # the per-choice GEMV (the default) on the whole layer, the shared experts as more of its choices
        saved_kernel, moe.GEMV_KERNEL = moe.GEMV_KERNEL, "per_choice"
        per_choice = {}
        for t in (1, 32):
            x = torch.randn(t, H, device="cuda").to(torch.bfloat16)
            per_choice[f"ms_{t}"] = time_cuda_graph(lambda: ours(x), calls=10)
        moe.GEMV_KERNEL = saved_kernel
        moe.GEMV_MAX_TOKENS = saved_max

        # the shared experts on a side stream (10**9: always) or on the layer's stream (0)
        streams, saved_streams = [], moe.SHARED_STREAM_MAX_TOKENS
        for t in STREAM_SWEEP:
            x = torch.randn(t, H, device="cuda").to(torch.bfloat16)
            r = {"tokens": t}
            for name, limit in (("side_ms", 10**9), ("one_ms", 0)):
                moe.SHARED_STREAM_MAX_TOKENS = limit
                r[name] = time_cuda_graph(lambda: ours(x), calls=10)
            streams.append(r)
        moe.SHARED_STREAM_MAX_TOKENS = saved_streams

        # moe_few, or the router GEMV + topk_softmax + GEMVs with the shared MLP on the side stream
        fold, applies = [], moe._few_applies
        for t in FOLD_SIZES:
            x = torch.randn(t, H, device="cuda").to(torch.bfloat16)
            r = {"tokens": t, "moe_few_ms": time_cuda_graph(lambda: ours(x), calls=10)}
            moe._few_applies = lambda *a: False
            r["mlp_side_stream_ms"] = time_cuda_graph(lambda: ours(x), calls=10)
            moe._few_applies = applies
            fold.append(r)

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
    print("\nrouted experts alone, each path forced (ms, GPU time; gemv_choice = the per-choice GEMV):")
    print(f"{'tokens':>6} " + " ".join(f"{n:>11}" for n in PATHS) + "  fastest")
    recommended = recommend(sweep)
    for r in sweep:
        print(f"{r['tokens']:>6} " + " ".join(f"{r.get(n + '_ms', float('nan')):>11.4f}" for n in PATHS) + f"  {r['fastest']}")
    print(f"recommended: {recommended} (a crossover lies between a threshold and the next size measured); "
          f"set now: {dict(GEMV_MAX_TOKENS=moe.GEMV_MAX_TOKENS, GEMV_KERNEL=moe.GEMV_KERNEL, SKINNY_MAX_TOKENS=moe.SKINNY_MAX_TOKENS, GROUPED_MM_MIN_TOKENS=moe.GROUPED_MM_MIN_TOKENS)}")
    print("\nthe grouped GEMV's variants, whole layer (ms, GPU time):")
    print(f"{'warps':>5} {'cols/warp':>9} {'shared in router':>16} {'1 token':>9} {'32 tokens':>9}")
    for v in variants:
        print(f"{v['GEMV_WARPS']:>5} {v['GEMV_COLS_PER_WARP']:>9} {str(v['SHARED_IN_ROUTER']):>16} {v['ms_1']:>9.4f} {v['ms_32']:>9.4f}")
    print(f"{'per-choice GEMV (shared experts as choices)':>32} {per_choice['ms_1']:>9.4f} {per_choice['ms_32']:>9.4f}")
    read = {r["tokens"]: r["weight_read_ms"] for r in rows}
    for t in (1, 32):
        best = min(variants, key=lambda v: v[f"ms_{t}"])
        cur = next(v for v in variants if all(v[k] == getattr(moe, k) for k in VARIANTS[0]))
        print(f"best at {t:>2} tokens: warps {best['GEMV_WARPS']}, cols/warp {best['GEMV_COLS_PER_WARP']}, shared in router "
              f"{best['SHARED_IN_ROUTER']}: {best[f'ms_{t}']:.4f} ms = {best[f'ms_{t}'] / read[t]:.2f} x read "
              f"(bar {BARS[t][1]}); the configured one: {cur[f'ms_{t}']:.4f} ms")
    print("\nshared experts on a side stream or on the layer's stream, whole layer (ms, GPU time):")
    print(f"{'tokens':>6} {'side':>9} {'one':>9}")
    for r in streams:
        print(f"{r['tokens']:>6} {r['side_ms']:>9.4f} {r['one_ms']:>9.4f}")
    wins = [r["tokens"] for r in streams if r["side_ms"] < r["one_ms"]]
    lead = max((t for t in wins if all(u in wins for u in STREAM_SWEEP if u <= t)), default=0)
    print(f"side stream wins up to {lead} tokens (leading run); SHARED_STREAM_MAX_TOKENS = {moe.SHARED_STREAM_MAX_TOKENS}")
    print("\nmoe_few, or router GEMV + topk_softmax + GEMVs with the shared MLP on the side stream, whole layer "
          "(ms, GPU time):")
    print(f"{'tokens':>6} {'moe_few':>9} {'MLP':>9}")
    for r in fold:
        print(f"{r['tokens']:>6} {r['moe_few_ms']:>9.4f} {r['mlp_side_stream_ms']:>9.4f}")
    for c in checks:
        print(f"ours vs transformers at {c['tokens']} tokens: max |diff| {c['max_abs_diff_vs_transformers']:.3g} "
              f"(max |out| {c['max_abs_ref']:.3g})")
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "copy_bandwidth_Bps": bw,
        "thresholds": {"GEMV_MAX_TOKENS": moe.GEMV_MAX_TOKENS, "SKINNY_MAX_TOKENS": moe.SKINNY_MAX_TOKENS,
                       "GROUPED_MM_MIN_TOKENS": moe.GROUPED_MM_MIN_TOKENS},
        "gemv": {"GEMV_KERNEL": moe.GEMV_KERNEL, "GEMV_WARPS": moe.GEMV_WARPS,
                 "GEMV_COLS_PER_WARP": moe.GEMV_COLS_PER_WARP, "SHARED_IN_ROUTER": moe.SHARED_IN_ROUTER},
        "recommended": recommended, "layer": rows, "paths": sweep, "gemv_variants": variants, "per_choice_layer": per_choice,
        "shared_stream": streams, "shared_stream_max_tokens": moe.SHARED_STREAM_MAX_TOKENS, "moe_few": fold, "checks": checks, "seconds": time.time() - start,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_moe.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out_dir / 'bench_moe.json'} in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
