"""Command line: ``python -m dsv2_lib generate --model tiny "To be, or not"``, and
``python -m dsv2_lib bench`` (on a GPU: our engine against transformers, chapter 14)."""
from __future__ import annotations

import argparse
import sys

from .llm import LLM
from .sampling import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsv2_lib", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a continuation for each prompt")
    gen.add_argument("prompts", nargs="+", help="prompt texts (served together by the batching scheduler)")
    gen.add_argument("--model", default="tiny", help="'tiny' or a DeepSeek-V2 checkpoint directory")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    gen.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--continuous", dest="scheduling", action="store_const", const="continuous",
                      help="continuous batching: admit a request whenever blocks allow (default)")
    mode.add_argument("--static", dest="scheduling", action="store_const", const="static",
                      help="static batching: admit a group, wait until all of it finishes")
    gen.add_argument("--kv-cache-mib", type=float, default=None,
                     help="KV cache size in MiB (default: room for every request at once)")
    gen.add_argument("--max-num-batched-tokens", type=int, default=8192, metavar="N",
                     help="most tokens one step computes: decodes first, then prompt chunks (chunked prefill; "
                          "default 8192)")
    gen.add_argument("--eager", dest="cuda_graphs", action="store_false",
                     help="launch every kernel from Python (no CUDA graphs for decode steps)")
    gen.add_argument("--in-step", dest="async_scheduling", action="store_false",
                     help="read each step's tokens back before planning the next (no host/GPU overlap)")
    gen.add_argument("--stats", action="store_true", help="print the scheduler and cache statistics to stderr")
    add_bench_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "bench":
        return bench_command(args)

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed)
        llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_cache_mib=args.kv_cache_mib,
                  scheduling=args.scheduling or "continuous", max_num_batched_tokens=args.max_num_batched_tokens,
                  cuda_graphs=args.cuda_graphs, async_scheduling=args.async_scheduling)
        outputs = llm.generate(list(args.prompts), params)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompts, outputs):
        print(f"{prompt}{out.text}")
        print(f"  [{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    if args.stats:
        print(llm.last_stats.summary(), file=sys.stderr)
    return 0


def add_bench_parser(sub) -> None:
    from .bench import BenchConfig

    d = BenchConfig()
    b = sub.add_parser("bench", help="prefill and decode throughput, ours vs transformers (same weights, same prompts)")
    b.add_argument("--model", default=None, help="a checkpoint directory or 'tiny' (default: DeepSeek-V2-Lite "
                                                 "with random bf16 weights, written once to --checkpoint-dir)")
    b.add_argument("--checkpoint-dir", default=d.checkpoint_dir)
    b.add_argument("--device", default=d.device)
    b.add_argument("--dtype", default=d.dtype, choices=["float32", "float16", "bfloat16"])
    b.add_argument("--prompt-len", type=int, default=d.prompt_len)
    b.add_argument("--prefill-batches", type=int, nargs="+", default=list(d.prefill_batches))
    b.add_argument("--decode-batches", type=int, nargs="+", default=list(d.decode_batches))
    b.add_argument("--decode-tokens", type=int, default=d.decode_tokens, help="tokens timed per decode measurement")
    b.add_argument("--repeats", type=int, default=d.repeats)
    b.add_argument("--no-transformers", dest="transformers", action="store_false", help="measure our engine only")
    b.add_argument("--eager", dest="cuda_graphs", action="store_false", help="ours without CUDA graphs")
    b.add_argument("--in-step", dest="async_scheduling", action="store_false",
                   help="ours without planning a step ahead of the GPU")
    b.add_argument("--out", default="bench_results", help="directory for bench.json and bench.png")


def bench_command(args) -> int:
    from .bench import BenchConfig, run, save, table

    cfg = BenchConfig(model=args.model, checkpoint_dir=args.checkpoint_dir, device=args.device, dtype=args.dtype,
                      prompt_len=args.prompt_len, prefill_batches=tuple(args.prefill_batches),
                      decode_batches=tuple(args.decode_batches), decode_tokens=args.decode_tokens,
                      repeats=args.repeats, transformers=args.transformers, cuda_graphs=args.cuda_graphs,
                      async_scheduling=args.async_scheduling)
    record = run(cfg)
    print(table(record))
    js, png = save(record, args.out)
    print(f"wrote {js} and {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
