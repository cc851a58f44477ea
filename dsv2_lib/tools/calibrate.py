"""The engine's kernel-path thresholds measured on the GPU at hand (``python -m dsv2_lib calibrate``).

The model's ops switch paths at token counts (:class:`~dsv2_lib.model.tuning.Tuning`); the shipped
defaults are the H200's. This tool times the competing paths on this GPU at DeepSeek-V2-Lite's shapes
and picks each threshold where one path stops winning:

* the MoE layer's routed experts, each path forced (GEMV, skinny GEMM, our mma GEMM,
  ``torch._grouped_mm``) at 1 ... 4,096 tokens: :func:`recommend_moe`, the rule of chapter 08; and its
  router at 8 ... 256 tokens, one ``moe_route_few`` launch against the fp32 GEMM and ``topk_softmax``;
* prefill attention, our kernel against SDPA, one sequence of 256 ... 8,192 tokens: SDPA from the
  first length where it wins there and at every longer one (:func:`sdpa_from`);
* the dense projections at 1 ... 4 tokens, the GEMV kernel against cuBLAS: the GEMV up to the last
  count of the leading run where it wins on every attention projection (:func:`leading_run`); and at
  3 ... 64 tokens the skinny GEMM against cuBLAS, by the same rule over the counts past the GEMV's.

What it does not measure keeps the default: the prefill kernel's variants, the decode kernel's
schedule, the side streams. The result is a JSON file (:func:`save_tuning`) that ``--tuning FILE``
on the command line and ``LLM(tuning=load_tuning(FILE))`` take. Times are GPU times of CUDA-graph
replays (:func:`~dsv2_lib.tools.benchmark.time_cuda_graph`), the weights rotated past the L2 cache.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path

import torch

from dsv2_lib.model.tuning import Tuning
from dsv2_lib.ops.moe_experts import MoETuning
from dsv2_lib.tools.benchmark import rotated, time_cuda_graph

NEVER = 10**9  # a token count no step reaches: "never switch"
MOE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
MOE_PATHS = ("gemv", "skinny", "mma", "grouped_mm")  # what moe_experts can take (choose_path's names)
MOE_FORCE = {"gemv": MoETuning(gemv_max_tokens=NEVER, skinny_max_tokens=0, grouped_mm_min_tokens=NEVER),
             "skinny": MoETuning(gemv_max_tokens=0, skinny_max_tokens=NEVER, grouped_mm_min_tokens=NEVER),
             "mma": MoETuning(gemv_max_tokens=0, skinny_max_tokens=0, grouped_mm_min_tokens=NEVER),
             "grouped_mm": MoETuning(gemv_max_tokens=0, skinny_max_tokens=0, grouped_mm_min_tokens=1)}
MOE_PATH_MAX_TOKENS = {"gemv": 64, "skinny": 256}  # the GEMV paths are timed up to here: beyond, far slower
ATTENTION_LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
ROUTER_TOKENS = (8, 16, 32, 64, 128, 256)  # token counts at which the one-launch router is timed
SKINNY_TOKENS = (3, 4, 8, 16, 32, 64)  # token counts at which the skinny GEMM is timed against cuBLAS
PROJECTIONS = {"q_proj": (3072, 2048), "kv_a_proj": (576, 2048), "o_proj": (2048, 2048)}  # V2-Lite's attention


# ---- choosing thresholds from timings (pure: tested on the CPU) ------------------------------------------

def leading_run(rows: list[dict], wins) -> int:
    """The ``"tokens"`` of the last row of the leading run of ``rows`` where ``wins(row)`` (0: none)."""
    last = 0
    for r in rows:
        if not wins(r):
            break
        last = r["tokens"]
    return last


def recommend_moe(sweep: list[dict], streams: list[dict] = (), base: MoETuning = MoETuning(),
                  router: list[dict] = ()) -> MoETuning:
    """The ``MoETuning`` the sweeps recommend; sets each sweep row's ``"fastest"`` of the paths the engine
    can take. ``sweep``: routed experts alone, each path forced (rows ``{"tokens", "<path>_ms"}`` in
    increasing tokens, a path absent where it was not run); ``streams``: the whole layer with the shared
    experts on a side stream or not (rows ``{"tokens", "side_ms", "one_ms"}``); ``router``: the router as
    one launch or not (rows ``{"tokens", "few_ms", "gemm_ms"}``, tokens past the GEMV path).
    The GEMV up to the last size of the leading run where it is fastest; then the skinny GEMM up to the
    last size of the run that follows where it is fastest (0: no such run); beyond, grouped_mm from the
    first size where it beats mma at every larger size (1: at every size the kernels before it do not
    take; ``NEVER``: at none); the side stream, and the one-launch router, each up to the end of its
    leading run of wins. What the sweeps did not measure (no grouped_mm, no streams, no router) keeps
    ``base``'s value."""
    for r in sweep:
        r["fastest"] = min((r[n + "_ms"], n) for n in MOE_PATHS if n + "_ms" in r)[1]
    gemv_max = leading_run(sweep, lambda r: r["fastest"] == "gemv")
    skinny_max = leading_run([r for r in sweep if r["tokens"] > gemv_max], lambda r: r["fastest"] == "skinny")
    beyond = [r for r in sweep if r["tokens"] > max(gemv_max, skinny_max) and "grouped_mm_ms" in r]
    mm_min = next((r["tokens"] for i, r in enumerate(beyond)
                   if all(b["grouped_mm_ms"] < b["mma_ms"] for b in beyond[i:])), NEVER)
    if beyond and mm_min == beyond[0]["tokens"]:
        mm_min = 1
    side_max = leading_run(streams, lambda r: r["side_ms"] < r["one_ms"]) if streams else base.shared_stream_max_tokens
    router_max = leading_run(router, lambda r: r["few_ms"] < r["gemm_ms"]) if router else base.router_few_max_tokens
    return dataclasses.replace(base, gemv_max_tokens=gemv_max, skinny_max_tokens=skinny_max,
                               grouped_mm_min_tokens=mm_min if beyond else base.grouped_mm_min_tokens,
                               shared_stream_max_tokens=side_max, router_few_max_tokens=router_max)


def sdpa_from(rows: list[dict]) -> int:
    """The first ``"tokens"`` of ``rows`` (increasing, ``{"tokens", "kernel_ms", "sdpa_ms"}``) from which
    SDPA is faster than our kernel at that length and every longer one; ``NEVER`` if it never is."""
    return next((r["tokens"] for i, r in enumerate(rows) if all(b["sdpa_ms"] < b["kernel_ms"] for b in rows[i:])),
                NEVER)


def choose(moe_sweep: list[dict], attention_rows: list[dict], gemv_rows: list[dict],
           base: Tuning = Tuning(), skinny_rows: list[dict] | None = None, router_rows: list[dict] = ()) -> Tuning:
    """``base`` with the thresholds the measurements set (see the module docstring); without
    ``skinny_rows`` (``router_rows``) the skinny GEMM's (the router's) threshold stays ``base``'s."""
    t = sdpa_from(attention_rows)
    attention = dataclasses.replace(base.attention, sdpa_min_tokens=t, sdpa_min_max_len=t)
    gemv_max = leading_run(gemv_rows, lambda r: all(p["gemv_ms"] < p["cublas_ms"] for p in r["projections"]))
    skinny_max = base.skinny_max_tokens if skinny_rows is None else leading_run(
        [r for r in skinny_rows if r["tokens"] > gemv_max],
        lambda r: all(p["skinny_ms"] < p["cublas_ms"] for p in r["projections"]))
    moe = recommend_moe(moe_sweep, base=base.moe, router=router_rows)
    return dataclasses.replace(base, moe=moe, attention=attention,
                               gemv_max_tokens=gemv_max, skinny_max_tokens=skinny_max)


# ---- the file ---------------------------------------------------------------------------------------------

def tuning_to_dict(tuning: Tuning) -> dict:
    """``tuning`` as nested plain values (JSON-ready): one object per record, fields by name."""
    return dataclasses.asdict(tuning)


def tuning_from_dict(data: dict, where: str = "tuning") -> Tuning:
    """The :class:`Tuning` that ``data`` (as :func:`tuning_to_dict` writes it) describes; a field left out
    keeps its default. Refuses, naming the field, an unknown field or a value of the wrong type (a bool is
    not an int); the records' own checks (a variant that does not exist) then apply."""
    return _record(Tuning, data, where)


def _record(cls, data, where: str):
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object of {cls.__name__}'s fields, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} ({cls.__name__} has {', '.join(names)})")
    values = {}
    for name, value in data.items():
        hint, field = hints[name], f"{where}.{name}"
        if dataclasses.is_dataclass(hint):
            values[name] = _record(hint, value, field)
            continue
        allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        if not any(_is(value, a) for a in allowed):
            want = " or ".join("null" if a is type(None) else a.__name__ for a in allowed)
            raise ValueError(f"{field}: expected {want}, got {value!r}")
        values[name] = value
    try:
        return cls(**values)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _is(value, kind) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def save_tuning(tuning: Tuning, path: str | Path, measured: dict | None = None) -> Path:
    """Write ``{"gpu", "torch", "tuning", "measured"}`` as JSON to ``path``; returns it."""
    path = Path(path)
    record = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
              "torch": torch.__version__, "tuning": tuning_to_dict(tuning), "measured": measured or {}}
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def load_tuning(path: str | Path) -> Tuning:
    """The :class:`Tuning` of a file :func:`save_tuning` wrote (its ``"tuning"`` object); every problem
    raises ``ValueError`` naming the file and, where it lies in the tuning, the field."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read the tuning file ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a JSON tuning file ({e})") from None
    if not isinstance(record, dict) or "tuning" not in record:
        raise ValueError(f"{path}: no 'tuning' object (write one with python -m dsv2_lib calibrate)")
    return tuning_from_dict(record["tuning"], f"{path}: tuning")


# ---- measuring on the GPU ---------------------------------------------------------------------------------

def _time_rotating(fn, copies: int) -> float:
    """GPU milliseconds of ``fn(i)``, the ``i``-th call reading copy ``i % copies``."""
    state = {"i": 0}

    def call():
        fn(state["i"] % copies)
        state["i"] += 1

    return time_cuda_graph(call, calls=max(6, copies))


def measure_moe(device: torch.device) -> list[dict]:
    """Routed experts of V2-Lite's shape (64 x 1408, top-6, hidden 2048, bf16, random weights and router),
    each path forced, at :data:`MOE_TOKENS`: rows ``{"tokens", "<path>_ms"}``."""
    from dsv2_lib.core.config import DEEPSEEK_V2_LITE as cfg
    from dsv2_lib.ops.moe_experts import moe_experts
    from dsv2_lib.ops.moe_routing import route

    torch.manual_seed(0)
    e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    gate_up = (torch.randn(e, 2 * i, h, device=device) * h**-0.5).to(torch.bfloat16)
    down = (torch.randn(e, h, i, device=device) * i**-0.5).to(torch.bfloat16)
    router = torch.randn(e, h, device=device) * h**-0.5
    rows = []
    for t in MOE_TOKENS:
        x = torch.randn(t, h, device=device).to(torch.bfloat16)
        w, ids = route(torch.nn.functional.linear(x.float(), router), cfg)
        row = {"tokens": t}
        for name in MOE_PATHS:
            if t > MOE_PATH_MAX_TOKENS.get(name, t) or (name == "grouped_mm" and not hasattr(torch, "_grouped_mm")):
                continue
            force = MOE_FORCE[name]
            row[name + "_ms"] = time_cuda_graph(lambda: moe_experts(x, w, ids, gate_up, down, tuning=force), calls=6)
        rows.append(row)
    return rows


def measure_router(device: torch.device) -> list[dict]:
    """V2-Lite's router (64 experts, hidden 2048, bf16 input, fp32 weight) at :data:`ROUTER_TOKENS`: one
    ``moe_route_few`` launch against the fp32 GEMM and ``topk_softmax``, rows ``{"tokens", "few_ms", "gemm_ms"}``."""
    from dsv2_lib.core.config import DEEPSEEK_V2_LITE as cfg
    from dsv2_lib.ops.moe_routing import router_few, topk_softmax

    torch.manual_seed(0)
    router = torch.randn(cfg.n_routed_experts, cfg.hidden_size, device=device) * cfg.hidden_size**-0.5
    rows = []
    for t in ROUTER_TOKENS:
        x = torch.randn(t, cfg.hidden_size, device=device).to(torch.bfloat16)
        router_few(x, router, cfg)  # its arrival counters are made outside the timed graph

        def gemm(x=x):
            return topk_softmax(torch.nn.functional.linear(x.float(), router), cfg)

        rows.append({"tokens": t, "few_ms": time_cuda_graph(lambda: router_few(x, router, cfg), calls=6),
                     "gemm_ms": time_cuda_graph(gemm, calls=6)})
    return rows


def measure_attention(device: torch.device) -> list[dict]:
    """Prefill attention of one sequence of each of :data:`ATTENTION_LENGTHS` tokens (16 heads, 128 + 64 /
    128, bf16): our kernel (its variant as the engine picks it) and SDPA as the engine calls it."""
    from dsv2_lib.ops import attention

    kernel_only = dataclasses.replace(Tuning().attention, sdpa_min_tokens=NEVER)
    rows = []
    for n in ATTENTION_LENGTHS:
        def r(*shape):
            return torch.randn(*shape, device=device).to(torch.bfloat16)
        q, k_nope, k_pe, v = r(n, 16, 192), r(n, 16, 128), r(n, 64), r(n, 16, 128)
        cu = [0, n]
        ours = time_cuda_graph(lambda: attention.prefill_attention(q, k_nope, k_pe, v, cu, cu, 0.1,
                                                                   tuning=kernel_only), calls=6)
        sdpa = time_cuda_graph(lambda: attention.prefill_attention(q, k_nope, k_pe, v, cu, cu, 0.1, version="sdpa"),
                               calls=6)
        rows.append({"tokens": n, "kernel_ms": ours, "sdpa_ms": sdpa})
    return rows


def measure_gemv(device: torch.device) -> list[dict]:
    """The attention projections at 1 ... ``TOKENS_COMPILED`` tokens: the GEMV kernel against cuBLAS,
    rows ``{"tokens", "projections": [{"name", "gemv_ms", "cublas_ms"}]}``."""
    from dsv2_lib.ops.gemv import TOKENS_COMPILED, linear

    return _against_cublas(device, range(1, TOKENS_COMPILED + 1), "gemv",
                           lambda x, w: linear(x, w, max_tokens=x.shape[0]))


def measure_skinny(device: torch.device) -> list[dict]:
    """The attention projections at :data:`SKINNY_TOKENS` tokens: the skinny GEMM against cuBLAS, rows
    ``{"tokens", "projections": [{"name", "skinny_ms", "cublas_ms"}]}``."""
    from dsv2_lib.ops.gemv import linear_skinny

    return _against_cublas(device, SKINNY_TOKENS, "skinny", linear_skinny)


def _against_cublas(device: torch.device, tokens, name: str, ours) -> list[dict]:
    """``ours(x, w)`` and cuBLAS on each of :data:`PROJECTIONS` (bf16 weights rotated past L2) at each of
    ``tokens``: rows ``{"tokens", "projections": [{"name", "<name>_ms", "cublas_ms"}]}``."""
    rows = [{"tokens": t, "projections": []} for t in tokens]
    for proj, (n, k) in PROJECTIONS.items():
        weights = rotated(lambda: (torch.randn(n, k, device=device) * k**-0.5).to(torch.bfloat16), n * k * 2)
        for row in rows:
            x = torch.randn(row["tokens"], k, device=device).to(torch.bfloat16)
            row["projections"].append({
                "name": proj,
                f"{name}_ms": _time_rotating(lambda j: ours(x, weights[j]), len(weights)),
                "cublas_ms": _time_rotating(lambda j: torch.nn.functional.linear(x, weights[j]), len(weights)),
            })
    return rows


def calibrate(device: str | torch.device = "cuda") -> tuple[Tuning, dict]:
    """Measure on ``device`` (a CUDA GPU with the kernels on) and choose: ``(tuning, measured)``."""
    from dsv2_lib.core import kernels

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not kernels.cupy_works() \
            or not kernels.gpu_supported(device.index if device.index is not None else torch.cuda.current_device()):
        raise RuntimeError("calibrate times the engine's CUDA kernels: it needs a CUDA GPU of compute capability "
                           "8.0 or newer with CuPy working")
    with torch.no_grad():
        measured = {"moe": measure_moe(device), "attention": measure_attention(device), "gemv": measure_gemv(device),
                    "skinny": measure_skinny(device), "router": measure_router(device)}
    return choose(measured["moe"], measured["attention"], measured["gemv"], skinny_rows=measured["skinny"],
                  router_rows=measured["router"]), measured
