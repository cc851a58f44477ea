"""Full-size DeepSeek-V2-Lite with random bf16 weights on the GPU: our engine vs transformers.

Both load the same safetensors files (Hub layout and Hub config form). Run on the GPU machine:
``pytest -m gpu tests/test_gpu_full_size.py -s``; set ``DSV2_RESULTS_DIR`` to also write the
measured numbers as JSON. The checkpoint (31 GB) goes to ``DSV2_FULL_SIZE_DIR`` or a temp dir.

In fp32 the two engines differ only in summation order, so logits must agree to ~1e-5 and the
argmax at >= 99 % of positions. In bf16 every rounding of 27 layers' residual stream compounds: on
random weights transformers' bf16 logits are ~4 % (relative) from its own fp32 logits and pick a
different top-1 token at ~9 % of positions (measured on the H200). Two bf16
engines that round in different places (our attention and expert sums accumulate in fp32, SDPA
and ``index_add_`` in bf16) can therefore not agree better than that noise floor; the bf16 test
holds both against the fp32 logits instead, and ours must be at least as accurate.
"""
import gc
import json
import os
import time
from pathlib import Path

import pytest
import torch

from dsv2_lib import DEEPSEEK_V2_LITE, LLM
from dsv2_lib.tools.random_checkpoint import write_random_checkpoint

pytestmark = pytest.mark.gpu


def hub_config(cfg) -> dict:
    """The config.json as DeepSeek ships it on the Hub (rope_theta + rope_scaling.type = yarn)."""
    d = cfg.to_hf_dict()
    rope = d.pop("rope_parameters")
    d["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    d["rope_scaling"] = rope
    d.update(n_group=1, topk_group=1, moe_layer_freq=1, scoring_func="softmax", torch_dtype="bfloat16")
    return d


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = Path(os.environ.get("DSV2_FULL_SIZE_DIR") or tmp_path_factory.mktemp("v2lite"))
    if not (path / "model.safetensors.index.json").is_file():
        write_random_checkpoint(DEEPSEEK_V2_LITE, path, seed=0, shard_bytes=4 << 30, device="cuda")
        (path / "config.json").write_text(json.dumps(hub_config(DEEPSEEK_V2_LITE), indent=2))
    return path


PROMPTS = torch.randint(0, DEEPSEEK_V2_LITE.vocab_size, (4, 512), generator=torch.Generator().manual_seed(0)).tolist()
IDS = PROMPTS[0]


def free_gpu():
    gc.collect()
    torch.cuda.empty_cache()


def hf_logits(path, dtype) -> tuple[torch.Tensor, float]:
    """transformers' prefill logits for PROMPTS ``[4 * 512, vocab]`` (fp32, on the GPU) and its load time."""
    from transformers import DeepseekV2ForCausalLM

    t0 = time.perf_counter()
    model = DeepseekV2ForCausalLM.from_pretrained(path, dtype=dtype, device_map="cuda").eval()
    load_s = time.perf_counter() - t0
    with torch.no_grad():
        logits = torch.cat([model(torch.tensor([p], device="cuda")).logits[0].float() for p in PROMPTS])
    del model
    free_gpu()
    return logits, load_s


def our_logits(path, dtype: str, backends=("auto",)) -> tuple[list[torch.Tensor], float]:
    """Our prefill logits for PROMPTS, once per ``DSV2_BACKEND`` in ``backends`` (one load), and the load time."""
    t0 = time.perf_counter()
    llm = LLM(path, device="cuda", dtype=dtype)
    load_s = time.perf_counter() - t0
    assert llm.config == DEEPSEEK_V2_LITE
    out = []
    with pytest.MonkeyPatch.context() as mp:
        for backend in backends:
            mp.setenv("DSV2_BACKEND", backend)
            out.append(torch.cat([llm.logits(p).cuda() for p in PROMPTS]))
    del llm
    free_gpu()
    return out, load_s


def rel_err(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def top1_agreement(a, b) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


@pytest.fixture(scope="module")
def results(checkpoint):
    """Logits of both engines in fp32 and bf16 on four 512-token prompts, compared; written as JSON.

    Ours in bf16 runs twice, on our kernels and on the PyTorch reference ops: two equally precise
    paths that round differently, whose top-1 gap shows the size of run-to-run noise in that metric."""
    hf32, hf32_load = hf_logits(checkpoint, torch.float32)
    (ours32,), _ = our_logits(checkpoint, "float32")
    hf16, hf16_load = hf_logits(checkpoint, torch.bfloat16)
    (ours16, ours16_torch), ours16_load = our_logits(checkpoint, "bfloat16", backends=("cuda", "torch"))
    r = {
        "positions": sum(map(len, PROMPTS)),
        "logit_std": hf32.std().item(),
        "fp32_rel_err_ours_vs_hf": rel_err(ours32, hf32),
        "fp32_max_abs_ours_vs_hf": (ours32 - hf32).abs().max().item(),
        "fp32_top1_agree_ours_vs_hf": top1_agreement(ours32, hf32),
        "bf16_rel_err_ours_vs_hf_bf16": rel_err(ours16, hf16),
        "bf16_top1_agree_ours_vs_hf_bf16": top1_agreement(ours16, hf16),
        "bf16_rel_err_ours_vs_fp32": rel_err(ours16, hf32),
        "bf16_rel_err_hf_vs_fp32": rel_err(hf16, hf32),
        "bf16_top1_agree_ours_vs_fp32": top1_agreement(ours16, hf32),
        "bf16_top1_agree_hf_vs_fp32": top1_agreement(hf16, hf32),
        "bf16_rel_err_ours_torch_ops_vs_fp32": rel_err(ours16_torch, hf32),
        "bf16_top1_agree_ours_torch_ops_vs_fp32": top1_agreement(ours16_torch, hf32),
        "bf16_top1_agree_ours_cuda_vs_torch_ops": top1_agreement(ours16, ours16_torch),
        "bf16_logit_ties_at_top1_ours": (ours16 == ours16.max(-1, keepdim=True).values).sum(-1).gt(1).float().mean().item(),
        "bf16_logit_ties_at_top1_hf": (hf16 == hf16.max(-1, keepdim=True).values).sum(-1).gt(1).float().mean().item(),
        "load_s_ours_bf16": ours16_load,
        "load_s_transformers_bf16": hf16_load,
        "load_s_transformers_fp32": hf32_load,
    }
    print(json.dumps(r, indent=2))
    if os.environ.get("DSV2_RESULTS_DIR"):
        Path(os.environ["DSV2_RESULTS_DIR"], "full_size_parity.json").write_text(json.dumps(r, indent=2))
    return r


def test_full_size_fp32_logits_match_transformers(results):
    """Same architecture at full size: in fp32 only summation order differs. Measured on the H200:
    5.2e-4 relative, 2,047 of 2,048 argmaxes equal. Over 2,048 tokens × 26 MoE layers a few expert
    choices sit on near-ties of the router's top-6, where an fp32 rounding difference picks the
    other expert and moves that token's output by far more than rounding; the tiny CPU models,
    with fewer such ties, agree to 1e-5. Hence 1e-3 here, with >= 99 % equal argmaxes."""
    assert results["fp32_rel_err_ours_vs_hf"] < 1e-3
    assert results["fp32_top1_agree_ours_vs_hf"] >= 0.99


def test_full_size_bf16_is_as_accurate_as_transformers_bf16(results):
    """bf16 vs bf16 top-1 agreement is capped by bf16 itself on random weights (transformers' own bf16
    agrees with its fp32 at ~90 % of positions), so both bf16 runs are held against the fp32 logits:
    ours must be at least as close as transformers' (2 % slack on the relative error). The top-1
    rate is noisy: over these 2,048 positions (H200) ours picked fp32's token at 89.2 %,
    transformers at 89.8 %, and ours on the PyTorch reference ops at 89.6 %, while our two paths,
    equally precise, picked different tokens at 5.9 % of positions. A run of 512 positions once
    showed ours 3.7 points below transformers with a *smaller* relative error. The top-1 check
    therefore allows 3 points: about 3 sigma of the difference of two such rates
    (sqrt(2 · 0.9 · 0.1 / 2048) = 0.9 points). An error larger than bf16 rounding shows first in the
    relative error, which keeps its 2 % slack."""
    assert results["bf16_rel_err_ours_vs_fp32"] <= 1.02 * results["bf16_rel_err_hf_vs_fp32"]
    assert results["bf16_top1_agree_ours_vs_fp32"] >= results["bf16_top1_agree_hf_vs_fp32"] - 0.03
    assert results["bf16_rel_err_ours_vs_hf_bf16"] < 6e-2  # two independent bf16 roundings of a ~4 % noise floor


def test_tiny_on_gpu_fp32_matches_cpu():
    ids = list(range(2, 60))
    cpu = LLM("tiny", device="cpu", dtype="float32").logits(ids)
    gpu = LLM("tiny", device="cuda", dtype="float32").logits(ids)
    torch.testing.assert_close(gpu, cpu, atol=1e-4, rtol=0)


def test_full_size_greedy_tokens_same_with_kernels_and_reference(checkpoint, monkeypatch):
    """fp32 on the GPU: 16 greedy tokens with every op on our CUDA kernels equal those of the PyTorch reference."""
    from dsv2_lib import SamplingParams

    llm = LLM(checkpoint, device="cuda", dtype="float32")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("cuda", "torch"):
        monkeypatch.setenv("DSV2_BACKEND", backend)
        tokens[backend] = llm.generate([IDS[:64]], params)[0].token_ids
    del llm
    free_gpu()
    assert tokens["cuda"] == tokens["torch"]


def test_full_size_serves_256_concurrent_requests(checkpoint):
    """bf16: 256 requests of mixed lengths (16-300 tokens, one shared 64-token system prompt) at once
    through the continuous scheduler on a paged cache sized for all of them: every request finishes
    with its 32 tokens, all 256 run in one decode batch, the shared prefix is prefilled once, and every
    block is free again at the end. Prints the statistics (``--stats``) and writes them as JSON."""
    from dsv2_lib import SamplingParams

    gen = torch.Generator().manual_seed(1)
    system = torch.randint(0, DEEPSEEK_V2_LITE.vocab_size, (64,), generator=gen).tolist()
    lens = torch.randint(16, 300, (256,), generator=gen).tolist()
    prompts = [system + torch.randint(0, DEEPSEEK_V2_LITE.vocab_size, (n - 64 if n > 64 else n,), generator=gen).tolist()
               for n in lens]
    llm = LLM(checkpoint, device="cuda", dtype="bfloat16")
    out = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), progress=False)
    stats = llm.last_stats
    del llm
    free_gpu()
    print(stats.summary())
    s, b = stats.scheduler, stats.blocks
    if os.environ.get("DSV2_RESULTS_DIR"):
        Path(os.environ["DSV2_RESULTS_DIR"], "serve_256.json").write_text(json.dumps(
            {"scheduler": vars(s), "blocks": vars(b), "generated_tokens": stats.generated_tokens,
             "seconds": stats.seconds}, indent=2))
    assert [len(o.token_ids) for o in out] == [32] * 256 and {o.finish_reason for o in out} == {"length"}
    assert s.peak_running == 256 and s.max_decode_batch == 256 and s.preemptions == 0
    assert s.free_blocks == s.pool_blocks and b.used_blocks == 0
    # the 64-token system prompt is 4 blocks of 16: computed for the first request, hit by the other 255
    assert s.prefix_hit_tokens == 255 * 64 and s.prefill_tokens == sum(map(len, prompts)) - 255 * 64


def test_full_size_greedy_tokens_same_with_graphs_and_eager_padded_steps(checkpoint):
    """bf16, 3 prompts, 16 greedy tokens: decode steps replayed as CUDA graphs give the same tokens as
    the same padded steps run eagerly (the graph changes how kernels are launched, not what they compute)."""
    from dsv2_lib import SamplingParams
    from dsv2_lib.engine.graph_runner import DecodeGraphRunner

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [IDS[:64], IDS[100:130], IDS[200:203]]
    llm = LLM(checkpoint, device="cuda", dtype="bfloat16", kv_cache_mib=256)
    tokens = {}
    for capture in (True, False):
        llm.runner._graphs = DecodeGraphRunner(llm.model, llm.runner.cache, capture=capture)
        llm.reset_prefix_cache()  # both runs compute their prompts: a prefix hit would change the prefill's shapes
        tokens[capture] = [o.token_ids for o in llm.generate(prompts, params)]
    del llm
    free_gpu()
    assert tokens[True] == tokens[False]
