"""Command line: ``python -m dsv2_lib generate --model tiny "To be, or not"``,
``python -m dsv2_lib serve --model tiny --port 8000`` (an OpenAI-compatible HTTP server),
``python -m dsv2_lib bench`` (on a GPU: our engine against transformers, chapter 14), and
``python -m dsv2_lib diff --model DIR "prompt"`` (the first step where our engine and transformers part)."""
from __future__ import annotations

import argparse
import sys


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help with each option's default appended ("off by default" for a flag), except where
    the help already says what the default is (one computed at run time, such as the device)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or isinstance(action, argparse._HelpAction):
            return text
        if action.nargs == 0:
            return f"{text} (off by default)"
        return super()._get_help_string(action)


def fraction(text: str) -> float:
    """An argparse type: a number in (0, 1], else a clear error naming the value."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {value}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1, else a clear error naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: ``generate`` and ``bench``, every option with its help and default."""
    parser = argparse.ArgumentParser(prog="python -m dsv2_lib", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a continuation for each prompt", formatter_class=HelpFormatter,
                         description="Generate a continuation for each prompt with the batching engine (chapters 09-14).")
    gen.add_argument("prompts", nargs="+", help="prompt texts (served together by the batching scheduler)")
    gen.add_argument("--model", default="tiny", help="'tiny' or a DeepSeek-V2 checkpoint directory")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, else cpu)")
    gen.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                     help="weights' dtype (default: bfloat16 on CUDA, float32 on a CPU)")
    gen.add_argument("--max-tokens", type=positive_int, default=32, help="most tokens generated per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = all")
    gen.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set of tokens with this much "
                                                                "probability; 1 = all")
    gen.add_argument("--seed", type=int, default=None, help="random seed of sampling (default: none, a fresh draw)")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--continuous", dest="scheduling", action="store_const", const="continuous",
                      help="continuous batching: admit a request whenever blocks allow (the default)")
    mode.add_argument("--static", dest="scheduling", action="store_const", const="static",
                      help="static batching: admit a group, wait until all of it finishes")
    gen.add_argument("--max-model-len", type=positive_int, default=None,
                     help="most tokens of prompt + output per request (default: the model's context)")
    gen.add_argument("--kv-cache-mib", type=float, default=None,
                     help="KV cache size in MiB (default: room for every request at once)")
    gen.add_argument("--max-num-batched-tokens", type=positive_int, default=8192, metavar="N",
                     help="most tokens one step computes: decodes first, then prompt chunks (chunked prefill)")
    gen.add_argument("--eager", dest="cuda_graphs", action="store_false",
                     help="launch every kernel from Python (no CUDA graphs)")
    gen.add_argument("--in-step", dest="async_scheduling", action="store_false",
                     help="read each step's tokens back before planning the next (no host/GPU overlap)")
    gen.add_argument("--stats", action="store_true", help="print the scheduler and cache statistics to stderr")
    gen.add_argument("--stream", action="store_true", help="print the text as it is generated (one prompt)")
    gen.add_argument("--tuning", default=None, metavar="FILE",
                     help="kernel-path thresholds measured by `calibrate` (default: the shipped ones)")
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_calibrate_parser(sub)
    from dsv2_lib.tools.diff import add_diff_parser

    add_diff_parser(sub, HelpFormatter)
    return parser


def device_error(device: str | None) -> str | None:
    """Why ``--device`` cannot be used here (one line for the user), or None when it can."""
    import torch

    if device is None:
        return None
    if device != "cpu" and not (device == "cuda" or device.startswith("cuda:")):
        return f"--device must be cpu, cuda or cuda:N, got {device!r}"
    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"--device {device}, but PyTorch sees no CUDA GPU here (a CPU build of torch, or no driver)"
    if device.startswith("cuda:") and not (device[5:].isdigit() and int(device[5:]) < torch.cuda.device_count()):
        return f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        return bench_command(args)
    if args.command == "serve":
        return serve_command(args)
    if args.command == "calibrate":
        return calibrate_command(args)
    if args.command == "diff":
        from dsv2_lib.tools.diff import diff_command

        return diff_command(args)

    from dsv2_lib.engine.llm import LLM
    from dsv2_lib.engine.sampling import SamplingParams

    if error := device_error(args.device):
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.stream and len(args.prompts) != 1:
        print(f"error: --stream prints one prompt's text as it is generated; got {len(args.prompts)} prompts",
              file=sys.stderr)
        return 2
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed)
        llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_cache_mib=args.kv_cache_mib,
                  max_model_len=args.max_model_len, scheduling=args.scheduling or "continuous",
                  max_num_batched_tokens=args.max_num_batched_tokens, cuda_graphs=args.cuda_graphs,
                  async_scheduling=args.async_scheduling, tuning=tuning_of(args))
        if args.stream:
            return stream_one(llm, args.prompts[0], params, args.stats)
        outputs = llm.generate(list(args.prompts), params)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompts, outputs):
        if out.error is not None:
            print(f"error: {out.error}", file=sys.stderr)  # (it names the request: its prompt's index)
            continue
        print(f"{prompt}{out.text}")
        print(f"  [{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    if args.stats:
        print(llm.last_stats.summary(), file=sys.stderr)
    return 2 if any(out.error is not None for out in outputs) else 0


def tuning_of(args):
    """The ``Tuning`` of ``--tuning FILE`` (``None``: the defaults); a bad file raises ``ValueError``."""
    from dsv2_lib.tools.calibrate import load_tuning

    return None if args.tuning is None else load_tuning(args.tuning)


def stream_one(llm, prompt: str, params, stats: bool) -> int:
    """Print ``prompt``, then each piece of its continuation the moment the engine produces it."""
    print(prompt, end="", flush=True)
    tokens = 0
    for _, _, piece in llm.stream(prompt, params):
        tokens += 1
        print(piece or "", end="", flush=True)
    print()
    print(f"  [{tokens} tokens]", file=sys.stderr)
    if stats:
        print(llm.last_stats.summary(), file=sys.stderr)
    return 0


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
                       formatter_class=HelpFormatter,
                       description="Serve a model over HTTP with OpenAI's API; concurrent requests share one "
                                   "continuous batch. Stop it with Ctrl-C.")
    s.add_argument("--model", default="tiny", help="'tiny' or a DeepSeek-V2 checkpoint directory")
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=positive_int, default=8000, help="TCP port")
    s.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, else cpu)")
    s.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="weights' dtype (default: bfloat16 on CUDA, float32 on a CPU)")
    s.add_argument("--max-model-len", type=positive_int, default=None,
                   help="most tokens of prompt + output per request (default: the model's context)")
    s.add_argument("--kv-cache-mib", type=float, default=None,
                   help="KV cache size in MiB (default on CUDA: what is left of --gpu-memory-utilization of the "
                        "GPU's memory after the weights and the activations' reserve, at most what is free; "
                        "256 MiB on a CPU)")
    s.add_argument("--gpu-memory-utilization", type=fraction, default=0.9, metavar="F",
                   help="on CUDA without --kv-cache-mib, the fraction of the GPU's memory the engine may use in all "
                        "(default: 0.9)")
    s.add_argument("--max-num-batched-tokens", type=positive_int, default=8192, metavar="N",
                   help="most tokens one step computes: decodes first, then prompt chunks (chunked prefill); "
                        "the activations' reserve grows with it")
    s.add_argument("--tuning", default=None, metavar="FILE",
                   help="kernel-path thresholds measured by `calibrate` (default: the shipped ones)")
    s.add_argument("--trace", default=None, metavar="FILE",
                   help="write every scheduler step to FILE as JSON lines (default: no trace)")


def serve_command(args) -> int:
    import torch

    if error := device_error(args.device):
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        import uvicorn

        from dsv2_lib.engine.live_engine import LiveEngine
        from dsv2_lib.engine.llm import LLM
        from dsv2_lib.serve.openai_server import create_app
    except ImportError as e:
        print(f"error: serving needs FastAPI and uvicorn ({e}): pip install -e '.[serve]'", file=sys.stderr)
        return 2
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if args.kv_cache_mib is None and cuda:
        size = {"gpu_memory_utilization": args.gpu_memory_utilization}  # one pool for every request
    else:
        size = {"kv_cache_mib": 256.0 if args.kv_cache_mib is None else args.kv_cache_mib}
    try:
        llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len, trace=args.trace,
                  max_num_batched_tokens=args.max_num_batched_tokens, tuning=tuning_of(args), **size)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or args.model
    with LiveEngine(llm) as engine:
        print(f"serving {name!r} at http://{args.host}:{args.port}/v1 (OpenAI API); Ctrl-C stops", file=sys.stderr)
        uvicorn.run(create_app(engine, name), host=args.host, port=args.port, log_level="warning")
    return 0


def add_calibrate_parser(sub) -> None:
    c = sub.add_parser("calibrate", help="measure where the kernel paths cross over on this GPU; write a tuning file",
                       formatter_class=HelpFormatter,
                       description="Time the MoE paths, prefill attention (ours vs SDPA) and the projections' GEMV "
                                   "against cuBLAS on this GPU at DeepSeek-V2-Lite's shapes (about a minute), choose "
                                   "the thresholds, and write them as JSON for --tuning (chapter 14).")
    c.add_argument("--out", default="tuning.json", help="the tuning file to write")
    c.add_argument("--device", default="cuda", help="the CUDA device to measure")


def calibrate_command(args) -> int:
    from pathlib import Path

    from dsv2_lib.tools.calibrate import calibrate, save_tuning

    error = device_error(args.device) if args.device.startswith("cuda") else \
        f"--device {args.device}: calibrate measures CUDA kernels, it needs a CUDA GPU"
    if not Path(args.out).parent.is_dir():  # before a minute of measuring, not after
        error = f"--out {args.out}: the directory {str(Path(args.out).parent)!r} does not exist"
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        tuning, measured = calibrate(args.device)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(tuning)
    try:
        print(f"wrote {save_tuning(tuning, args.out, measured)}", file=sys.stderr)
    except OSError as e:
        print(f"error: --out {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


def add_bench_parser(sub) -> None:
    from dsv2_lib.tools.bench import BenchConfig

    d = BenchConfig()
    b = sub.add_parser("bench", help="prefill and decode throughput, ours vs transformers (same weights, same prompts)",
                       formatter_class=HelpFormatter,
                       description="Measure prefill and decode throughput of our engine and of transformers on the "
                                   "same checkpoint and prompts (chapter 14). DeepSeek-V2-Lite needs a CUDA GPU; "
                                   "'--model tiny --device cpu' runs anywhere.")
    b.add_argument("--model", default=None, help="a checkpoint directory or 'tiny' (default: DeepSeek-V2-Lite "
                                                 "with random bf16 weights, written once to --checkpoint-dir)")
    b.add_argument("--checkpoint-dir", default=d.checkpoint_dir,
                   help="where the random DeepSeek-V2-Lite checkpoint is written (about 31 GB) and reused")
    b.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, else cpu)")
    b.add_argument("--dtype", default=d.dtype, choices=["float32", "float16", "bfloat16"], help="weights' dtype")
    b.add_argument("--prompt-len", type=positive_int, default=d.prompt_len, help="tokens per prompt")
    b.add_argument("--prefill-batches", type=positive_int, nargs="+", default=list(d.prefill_batches),
                   help="prompts per prefill measurement")
    b.add_argument("--decode-batches", type=positive_int, nargs="+", default=list(d.decode_batches),
                   help="sequences per decode measurement")
    b.add_argument("--decode-tokens", type=positive_int, default=d.decode_tokens,
                   help="tokens timed per decode measurement")
    b.add_argument("--repeats", type=positive_int, default=d.repeats, help="runs per measurement (the median counts)")
    b.add_argument("--no-transformers", dest="transformers", action="store_false", help="measure our engine only")
    b.add_argument("--eager", dest="cuda_graphs", action="store_false", help="ours without CUDA graphs")
    b.add_argument("--in-step", dest="async_scheduling", action="store_false",
                   help="ours without planning a step ahead of the GPU")
    b.add_argument("--tuning", default=None, metavar="FILE",
                   help="ours with kernel-path thresholds measured by `calibrate` (default: the shipped ones)")
    b.add_argument("--out", default="bench_results", help="directory for bench.json and bench.png (the book's "
                                                          "committed record is benchmarks/: write there on purpose)")


def bench_command(args) -> int:
    import torch

    from dsv2_lib.engine.llm import resolve_model
    from dsv2_lib.tools.bench import BenchConfig, run, save, table

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if error := device_error(device):
        print(f"error: {error}", file=sys.stderr)
        return 2
    if device == "cpu" and args.model is None:
        print("error: the default model, DeepSeek-V2-Lite (a 31 GB checkpoint), needs a CUDA GPU; "
              "on a CPU measure the tiny model: --model tiny --device cpu", file=sys.stderr)
        return 2
    cfg = BenchConfig(model=args.model, checkpoint_dir=args.checkpoint_dir, device=device, dtype=args.dtype,
                      prompt_len=args.prompt_len, prefill_batches=tuple(args.prefill_batches),
                      decode_batches=tuple(args.decode_batches), decode_tokens=args.decode_tokens,
                      repeats=args.repeats, transformers=args.transformers, cuda_graphs=args.cuda_graphs,
                      async_scheduling=args.async_scheduling, tuning=args.tuning)
    try:
        if args.model is not None:
            resolve_model(args.model)  # before anything is measured or written
        tuning_of(args)  # likewise
        record = run(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(record))
    js, png = save(record, args.out)
    print(f"wrote {js} and {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
