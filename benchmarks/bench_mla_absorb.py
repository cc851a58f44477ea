"""Benchmark of MLA's absorbed products (chapter 14) on the GPU: ``python benchmarks/bench_mla_absorb.py``.

For V2-Lite in bf16 (16 heads, ``W_k [16, 128, 512]`` and ``W_v [16, 128, 512]``, views of ``kv_b_proj``'s
weight as ``MLA.split_kv_b`` makes them) and 1 to 256 tokens, the GPU time (replayed CUDA graphs,
``benchmark.time_cuda_graph``) of each product three ways: the einsums (cuBLAS, with the ``torch.cat`` of
the query and the dtype copy of ``o``), the CUDA-core kernels (a block per token; ``max_tokens`` = T) and
the tensor-core ones (``max_tokens`` = 0). Weights are replicated and rotated past 256 MB so that L2
cannot serve them, as in a decode step, where the other layers' weights pass through L2 between two
calls. The engine's threshold ``mla_absorb.ABSORB_MAX_TOKENS`` is the largest token count up to which
the CUDA-core kernels beat the tensor-core ones on both products. JSON to ``$DSV2_RESULTS_DIR``
(default /tmp) as ``bench_mla_absorb.json``.
"""
from __future__ import annotations

import sys
import time

import torch
from bench_mla_decode import kernel_device, save

from dsv2_lib.core.config import DEEPSEEK_V2_LITE
from dsv2_lib.ops import mla_absorb
from dsv2_lib.tools import benchmark

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def main() -> int:
    dev = kernel_device()
    if dev is None:
        return 0
    t0 = time.time()
    cfg, dtype = DEEPSEEK_V2_LITE, torch.bfloat16
    h, nope, rope, c, v = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                           cfg.v_head_dim)
    nbytes = h * (nope + v) * c * 2
    weights = benchmark.rotated(lambda: (torch.randn(h * (nope + v), c, device=dev) * 0.05).to(dtype), nbytes)
    views = [w.view(h, nope + v, c) for w in weights]
    products = {
        "query": lambda t, w, m: mla_absorb.absorbed_query(*t, w[:, :nope], dtype, **m),
        "output": lambda t, w, m: mla_absorb.absorbed_output(t, w[:, nope:], dtype, **m),
    }
    reference = {
        "query": lambda t, w: mla_absorb.absorbed_query_reference(*t, w[:, :nope], dtype),
        "output": lambda t, w: mla_absorb.absorbed_output_reference(t, w[:, nope:], dtype),
    }
    rows, cuda_core_wins = [], {t: True for t in TOKENS}
    print(f"{'product':>7} {'T':>4} | {'einsum µs':>9} | {'CUDA cores µs':>13} | {'tensor cores µs':>15}")
    for name in products:
        for t in TOKENS:
            q = torch.randn(t, h, nope + rope, device=dev).to(dtype)
            inputs = (q[..., :nope], q[..., nope:]) if name == "query" else torch.randn(t, h, c, device=dev)
            state = {"i": 0}

            def call(fn):
                w = views[state["i"] % len(views)]
                state["i"] += 1
                fn(inputs, w)

            calls = max(20, len(views))
            ms = [benchmark.time_cuda_graph(lambda: call(fn), calls=calls) for fn in (
                reference[name], lambda x, w: products[name](x, w, {"max_tokens": t}),
                lambda x, w: products[name](x, w, {"max_tokens": 0}))]
            print(f"{name:>7} {t:>4} | {ms[0] * 1e3:>9.1f} | {ms[1] * 1e3:>13.1f} | {ms[2] * 1e3:>15.1f}")
            cuda_core_wins[t] &= ms[1] < ms[2]
            rows.append({"product": name, "tokens": t, "einsum_ms": ms[0], "cuda_cores_ms": ms[1],
                         "tensor_cores_ms": ms[2]})
    threshold = 0
    for t in TOKENS:  # the leading run of token counts at which the CUDA-core kernels win
        if not cuda_core_wins[t]:
            break
        threshold = t
    print(f"the CUDA-core kernels win on both products up to {threshold} token(s); "
          f"mla_absorb.ABSORB_MAX_TOKENS = {mla_absorb.ABSORB_MAX_TOKENS}")
    save("bench_mla_absorb.json", "MLA's absorbed products: einsums, CUDA-core and tensor-core kernels, bf16, "
         "V2-Lite", "the engine's kernels faster than the einsums at every token count", rows, t0,
         measured_threshold=threshold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
