"""Command line: ``python -m dsv2_lib generate --model tiny "To be, or not"``."""
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
    gen.add_argument("--stats", action="store_true", help="print the scheduler and cache statistics to stderr")
    args = parser.parse_args(argv)

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed)
        llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_cache_mib=args.kv_cache_mib,
                  scheduling=args.scheduling or "continuous")
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


if __name__ == "__main__":
    sys.exit(main())
