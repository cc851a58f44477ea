"""Build it: the course's exercises, an autograder, and a way to run your piece inside the engine.

Each chapter's "Build it" section gives a skeleton (signature, docstring with shapes,
``raise NotImplementedError``) for the piece it teaches. Then

    check("rms_norm", my_rms_norm)          # prints one line: passed, or the first failing case in words
    with swapped("rms_norm", my_rms_norm):  # the engine (PyTorch path, e.g. LLM("tiny", device="cpu"))
        llm.generate(...)                   # now calls your function where it called its own

``check`` runs the reader's function and the reference on the same inputs, random and edge cases, and
prints the first case that differs: its description, then what is wrong (an exception, the shape,
the dtype, or the first element outside the tolerance with expected and got); it never raises for a
wrong answer; ``grade`` returns the verdict as ``(passed, line)`` instead. ``swapped`` replaces the
reference function in every ``dsv2_lib`` module that refers to it, and restores it on exit; on a GPU
the engine runs its CUDA kernels instead, so run the engine on the CPU (or with
``DSV2_BACKEND=torch``) to exercise your piece; ``generate_with`` does that with the tiny model.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from dsv2_lib.core import safetensors_io
from dsv2_lib.core.config import DEEPSEEK_V2_LITE, TINY
from dsv2_lib.engine import block_manager, sampling
from dsv2_lib.engine.sampling import SamplingParams
from dsv2_lib.ops import activation, attention, embedding, mla_decode, moe_routing, norm, rope
from dsv2_lib.tools import roofline

__all__ = ["EXERCISES", "check", "grade", "swapped", "generate_with",
           "reserve_admits_reference", "step_tokens_reference"]


@dataclass(frozen=True)
class _Case:
    """One input of an exercise: ``args`` for both functions, ``what`` says it in words."""

    what: str
    args: tuple
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _Exercise:
    """``reference`` defines the answer; ``cases()`` builds the inputs; ``in_place`` names the argument
    positions the function writes to (compared instead of the return value); ``engine`` is
    ``"module:attribute"``, the engine's function that :func:`swapped` replaces (``None``: none).
    ``bits16``: 16-bit results must have the reference's bits, since a tolerance passes a misplaced
    rounding; the hint says what to do when they do not. ``mistakes``: common wrong answers and their
    names, said when the reader's result is one of them. ``sampling``: how :func:`generate_with` picks
    tokens for this exercise (``None``: greedy; the sampler's own exercise needs seeded sampling)."""

    name: str
    chapter: str
    reference: Callable
    cases: Callable[[], list[_Case]]
    in_place: tuple[int, ...] = ()
    engine: str | None = None
    exact: bool = False  # integer outputs, or results that must match bit for bit
    fp32_tolerance: tuple[float, float] | None = None  # (rtol, atol) for fp32 results, where sums run long
    bits16: str | None = None
    mistakes: tuple[tuple[Callable, str], ...] = ()
    sampling: SamplingParams | None = None


# ---- tolerances ------------------------------------------------------------------------------------
def _tolerance(dtype: torch.dtype, fp32: tuple[float, float] | None = None) -> tuple[float, float]:
    """(rtol, atol) for comparing with the reference: a couple of roundings of the dtype (``fp32``: an
    exercise's own for float32)."""
    if dtype == torch.float32 and fp32 is not None:
        return fp32
    return {torch.float32: (1e-5, 1e-6), torch.float64: (1e-12, 1e-14), torch.bfloat16: (2 ** -7, 1e-3),
            torch.float16: (2 ** -10, 1e-4)}.get(dtype, (0.0, 0.0))


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor {list(x.shape)} {str(x.dtype).removeprefix('torch.')}"
    return type(x).__name__


def _difference(got, want, exact: bool, where: str = "the result",
                fp32: tuple[float, float] | None = None) -> str | None:
    """``None`` when ``got`` matches ``want``, else what differs, in words."""
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)):
            return f"{where}: expected a {type(want).__name__} of {len(want)} items, got {_describe(got)}"
        count = "" if len(got) == len(want) else f" ({len(got)} items, expected {len(want)})"
        for i, (g, w) in enumerate(zip(got, want)):
            problem = _difference(g, w, exact, f"{where}[{i}]", fp32)
            if problem:
                return problem + count
        if count:  # equal as far as both go: name the first item one has and the other lacks
            n = min(len(got), len(want))
            extra = f"item {n} is extra: {got[n]!r}" if len(got) > n else f"item {n} is missing: {want[n]!r}"
            return f"{where}: {len(got)} items, expected {len(want)}; {extra}"
        return None
    if isinstance(want, float) and not exact and isinstance(got, (int, float)) and not isinstance(got, bool):
        # a sum in another order differs in the last bits: a couple of float64 roundings
        return None if math.isclose(got, want, rel_tol=1e-12) else f"{where}: expected {want!r}, got {got!r} (rtol 1e-12)"
    if not isinstance(want, torch.Tensor):
        return None if got == want else f"{where}: expected {want!r}, got {got!r}"
    if not isinstance(got, torch.Tensor):
        return f"{where}: expected a {_describe(want)}, got {_describe(got)}"
    if got.shape != want.shape:
        return f"{where}: shape {list(got.shape)}, expected {list(want.shape)}"
    if got.dtype != want.dtype:
        return f"{where}: dtype {str(got.dtype).removeprefix('torch.')}, expected {str(want.dtype).removeprefix('torch.')}"
    if want.numel() == 0:
        return None
    g, w = got.detach().cpu(), want.detach().cpu()
    if exact or not w.is_floating_point():
        bad = g != w
        if w.is_floating_point():
            bad &= ~(torch.isnan(g) & torch.isnan(w))
    else:
        rtol, atol = _tolerance(w.dtype, fp32)
        g64, w64 = g.double(), w.double()
        # an infinite expectation (a masked logit, say) is met by that infinity only: |g - inf| <= inf holds for any g
        bad = torch.where(torch.isinf(w64), g64 != w64, ~((g64 - w64).abs() <= atol + rtol * w64.abs()))
    if not bool(bad.any()):
        return None
    idx = tuple(int(i) for i in bad.nonzero()[0])
    n = int(bad.sum())
    tol = "" if exact or not w.is_floating_point() else " (rtol {:g}, atol {:g})".format(*_tolerance(w.dtype, fp32))
    return (f"{where}{list(idx)}: expected {w[idx].item():.6g}, got {g[idx].item():.6g}{tol}; "
            f"{n} of {w.numel()} elements differ")


def _clone(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def grade(name: str, fn: Callable) -> tuple[bool, str]:
    """Run ``fn`` against exercise ``name`` (see :data:`EXERCISES`) on every case: ``(passed, one line)``,
    the line naming the first failing case and what differs, in words."""
    ex = _exercise(name)
    cases = ex.cases()
    for i, case in enumerate(cases, 1):
        where = f"✗ {name}, case {i} of {len(cases)} ({case.what})"
        ref_args, my_args = _clone(case.args), _clone(case.args)
        try:
            want = ex.reference(*ref_args, **case.kwargs)
        except Exception as e:  # bad input: the reader's function must refuse it too
            want = e
        try:
            got = fn(*my_args, **case.kwargs)
        except NotImplementedError:
            return False, f"✗ {name}: not implemented yet (the skeleton still raises NotImplementedError)"
        except Exception as e:  # the reader's bug, reported as a fact about the case, not a traceback
            if isinstance(want, Exception) and _same_refusal(e, want):
                continue
            if isinstance(want, Exception):  # refused, but by whatever failed first (PyTorch's indexing, say)
                return False, (f"{where}: raised {type(e).__name__}: {e}; refuse it yourself with a "
                               f"{type(want).__name__}, as the reference does: {want}")
            return False, f"{where}: raised {type(e).__name__}: {e}"
        if isinstance(want, Exception):
            return False, (f"{where}: returned a result, but this input must be refused (the reference raises "
                           f"{type(want).__name__}: {want})")
        if ex.in_place:
            got = tuple(my_args[j] for j in ex.in_place)
            want = tuple(ref_args[j] for j in ex.in_place)
            if all(torch.equal(g, case.args[j]) for g, j in zip(got, ex.in_place)):
                return False, (f"{where}: the arguments to write in place are unchanged: assign into them "
                               f"(x[...] = ... or x.copy_(...)); binding a name to a new tensor changes nothing")
        problem = (_difference(got, want, ex.exact, fp32=ex.fp32_tolerance)
                   or (ex.bits16 and _bits16(got, want, ex.bits16)))
        if problem:
            mistake = next((what for wrong, what in ex.mistakes if _gives(wrong, case, ex, got)), None)
            return False, f"{where}: {problem}" + (f" ({mistake})" if mistake else "")
    return True, f"✓ {name}: all {len(cases)} cases match the reference"


def _same_refusal(got: Exception, want: Exception) -> bool:
    """The reader refused an input as the reference does: the same kind of error (the reference's class, or
    one it derives from, such as ValueError for a format error), not whatever failed first."""
    return isinstance(got, type(want)) or (type(got) is not Exception and isinstance(want, type(got)))


def _bits16(got: torch.Tensor, want: torch.Tensor, hint: str) -> str | None:
    """``None`` unless a 16-bit result differs from the reference's bits in more than one element in 100 (a few
    may: an fp32 sum in another order, or another square root, can tip a rounding); a rounding in another
    place than the reference's moves about a quarter of them, all within any tolerance."""
    if want.dtype not in (torch.bfloat16, torch.float16):
        return None
    n = int((got != want).sum())
    if n <= max(2, want.numel() // 100):
        return None
    dtype = str(want.dtype).removeprefix("torch.")
    return f"{n} of {want.numel()} {dtype} outputs are off in their last bit: {hint}"


def _gives(wrong: Callable, case: _Case, ex: _Exercise, got) -> bool:
    """Whether the common wrong answer ``wrong`` gives the reader's result on ``case``."""
    args = _clone(case.args)
    result = wrong(*args, **case.kwargs)
    if ex.in_place:
        result = tuple(args[j] for j in ex.in_place)
    return _difference(got, result, ex.exact, fp32=ex.fp32_tolerance) is None


def check(name: str, fn: Callable) -> None:
    """Grade ``fn`` against exercise ``name`` and print the verdict: one line, never a traceback."""
    print(grade(name, fn)[1])


def _exercise(name: str) -> _Exercise:
    if name not in EXERCISES:
        raise KeyError(f"no exercise {name!r}; the exercises are {sorted(EXERCISES)}")
    return EXERCISES[name]


@contextlib.contextmanager
def swapped(name: str, fn: Callable) -> Iterator[None]:
    """Run the engine with ``fn`` in place of exercise ``name``'s engine function: every ``dsv2_lib``
    module attribute that is that function is replaced while the block runs, then restored."""
    ex = _exercise(name)
    if ex.engine is None:
        raise ValueError(f"exercise {name!r} has no engine function to swap")
    module_name, attr = ex.engine.split(":")
    original = getattr(importlib.import_module(module_name), attr)
    patched = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "dsv2_lib" or mod_name.startswith("dsv2_lib.")):
            continue
        for key, value in list(vars(mod).items()):
            if value is original:
                setattr(mod, key, fn)
                patched.append((mod, key))
    try:
        yield
    finally:
        for mod, key in patched:
            setattr(mod, key, original)


def generate_with(name: str, fn: Callable, prompt: str = "To be, or not", max_tokens: int = 16) -> str:
    """Text from the tiny model, loaded and run on the CPU (greedy, or the exercise's seeded ``sampling``),
    with the engine's own function and then with ``fn`` swapped in for exercise ``name``: one sentence saying
    whether the tokens are identical, or at which token they part, or that ``fn`` is still the
    skeleton (it raised NotImplementedError)."""
    from dsv2_lib.engine.llm import LLM

    sp = _exercise(name).sampling
    params = (SamplingParams(max_tokens=max_tokens, temperature=0.0) if sp is None
              else dataclasses.replace(sp, max_tokens=max_tokens))
    how = "" if sp is None else \
        f" (sampled: temperature {sp.temperature}, top_k {sp.top_k}, top_p {sp.top_p}, seed {sp.seed})"
    def run():  # the engine built inside the swap too: some pieces (the header parser) act while it loads
        return LLM("tiny", device="cpu").generate(prompt, params)[0]

    ours = run()
    try:
        with swapped(name, fn):
            yours = run()
    except NotImplementedError:
        return f"your {name} is not written yet (the skeleton still raises NotImplementedError): nothing generated"
    if yours.token_ids == ours.token_ids:
        return (f"{len(yours.token_ids)} tokens{how} through your {name}, identical to the engine's own: "
                f"{prompt!r} -> {yours.text!r}")
    at = next((i for i, (a, b) in enumerate(zip(yours.token_ids, ours.token_ids)) if a != b),
              min(len(yours.token_ids), len(ours.token_ids)))
    return (f"through your {name} the tokens{how} part from the engine's at token {at}: yours {yours.text!r}, "
            f"the engine's {ours.text!r}")


# ---- the exercises' inputs ------------------------------------------------------------------------------
def _n(count: int, one: str, many: str | None = None) -> str:
    return f"{count} {one if count == 1 else many or one + 's'}"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rms_norm_cases() -> list[_Case]:
    cases = []
    for i, (shape, dtype) in enumerate([((1, 8), torch.float32), ((3, 64), torch.float32), ((2, 5, 256), torch.float32),
                                        ((4, 2048), torch.bfloat16), ((3, 512), torch.float16), ((7, 576), torch.bfloat16)]):
        g = _gen(i)
        x = (torch.randn(shape, generator=g) * 3).to(dtype)
        w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
        cases.append(_Case(f"x {list(shape)} {str(dtype).removeprefix('torch.')}, eps 1e-6", (x, w, 1e-6)))
    x = torch.zeros(2, 16)
    x[1] = 1e4
    cases.append(_Case("a row of zeros and a row of 1e4 (eps decides the first)", (x, torch.ones(16), 1e-6)))
    x = torch.randn(3, 64, generator=_gen(7)) * 1e-3  # mean square ~1e-6: eps inside the square root matters
    cases.append(_Case("rows of scale 1e-3 (mean square near eps)", (x, torch.ones(64), 1e-6)))
    x = (torch.randn(2, 256, generator=_gen(8)) * 500).half()  # squares up to ~1e6: past fp16's 65,504
    cases.append(_Case("fp16 rows of scale 500 (their squares overflow fp16)", (x, torch.ones(256).half(), 1e-6)))
    return cases


def _neox_rope(q_pe: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> None:
    """Chapter 04's rotation with the NeoX pairing, ``(x[i], x[i + d/2])`` instead of DeepSeek's ``(x[2i], x[2i+1])``:
    the mistake ``check`` names (and the tests plant)."""
    cos, sin = cache[positions].chunk(2, dim=-1)
    for x, c, s in ((q_pe, cos[:, None], sin[:, None]), (k_pe, cos, sin)):
        a, b = x.float().chunk(2, dim=-1)
        x.copy_(torch.cat((a * c - b * s, a * s + b * c), dim=-1))


def _rope_cases() -> list[_Case]:
    cases = []
    for i, (T, h, dtype) in enumerate([(1, 1, torch.float32), (5, 4, torch.float32), (9, 16, torch.bfloat16)]):
        g = _gen(10 + i)
        d = TINY.qk_rope_head_dim
        cache = rope.rope_cos_sin_cache(TINY, 64)
        q = torch.randn(T, h, d, generator=g).to(dtype)
        k = torch.randn(T, d, generator=g).to(dtype)
        pos = torch.randint(0, 64, (T,), generator=g)
        cases.append(_Case(f"{_n(T, 'token')}, {_n(h, 'head')}, rope dim {d}, {str(dtype).removeprefix('torch.')}, "
                          f"positions {pos.tolist()[:4]}{'...' if T > 4 else ''}", (q, k, pos, cache)))
    return cases


def _route_cases() -> list[_Case]:
    grouped = dataclasses.replace(TINY, topk_method="group_limited_greedy", n_group=4, topk_group=2)
    scaled = dataclasses.replace(TINY, routed_scaling_factor=2.5)
    renorm = dataclasses.replace(TINY, norm_topk_prob=True)
    cases = []
    for i, (cfg, what) in enumerate([(TINY, "greedy top-2 of 16, tiny model"), (scaled, "routed_scaling_factor 2.5"),
                                     (renorm, "norm_topk_prob: renormalise the k weights"),
                                     (grouped, "group-limited: 4 groups, keep the best 2")]):
        logits = torch.randn(6, cfg.n_routed_experts, generator=_gen(20 + i))
        cases.append(_Case(what, (logits, cfg)))
    tie = torch.zeros(2, TINY.n_routed_experts)
    tie[0, [3, 7, 11]] = 1.0  # three equal best scores: the lowest ids win
    cases.append(_Case("ties: experts 3, 7 and 11 score equal (lowest id first)", (tie, TINY)))
    return cases


def _moe_align_cases() -> list[_Case]:
    cases = []
    for i, (T, k, E, block) in enumerate([(1, 2, 4, 4), (6, 2, 16, 4), (33, 6, 64, 16), (5, 1, 8, 1)]):
        ids = torch.stack([torch.randperm(E, generator=_gen(30 + i + 7 * t))[:k] for t in range(T)])
        cases.append(_Case(f"{_n(T, 'token')} x {_n(k, 'choice')} over {E} experts, tiles of {block}", (ids, E, block)))
    cases.append(_Case("every token picks the same 2 experts", (torch.tensor([[5, 2]] * 9), 8, 4)))
    return cases


def _filter_cases() -> list[_Case]:
    logits = torch.randn(50, generator=_gen(40)) * 2
    flat = torch.zeros(6)
    return [_Case("temperature 0.7 only", (logits, SamplingParams(temperature=0.7))),
            _Case("top_k 5", (logits, SamplingParams(temperature=1.0, top_k=5))),
            _Case("top_p 0.9", (logits, SamplingParams(temperature=1.0, top_p=0.9))),
            _Case("top_k 10, top_p 0.5, temperature 1.3", (logits, SamplingParams(temperature=1.3, top_k=10, top_p=0.5))),
            _Case("six equal logits, top_p 0.5: the first three (in order) reach the mass",
                 (flat, SamplingParams(temperature=1.0, top_p=0.5)))]


def _segment_cases() -> list[_Case]:
    """Chapter 13's balanced schedules ``(per, first, workers)``, as ``balanced_schedule`` deals them."""
    cases = []
    for what, lengths, workers, min_tiles in [
            ("section 3's batch: 6 entries of 17 to 4,000 rows, 12 workers", [4000, 300, 50, 2500, 17, 900], 12, 1),
            ("one entry of 32,768 rows over 8 workers", [32768], 8, 1),
            ("an empty entry (0 rows) between two others", [100, 0, 70], 3, 1),
            ("more workers than tiles: the idle ones have no segments", [100], 264, 1),
            ("a floor of 4 tiles per worker", [100, 33, 640], 6, 4),
            ("worker ranges that end exactly where entries end", [64, 64, 64, 64], 4, 1)]:
        per, first = mla_decode.balanced_schedule(lengths, workers, min_tiles)
        cases.append(_Case(what, (per, first, workers)))
    return cases


def _decode_bytes_cases() -> list[_Case]:
    lite = DEEPSEEK_V2_LITE
    return [_Case("V2-Lite, batch 1, nothing cached yet", (lite, 1, 0)),
            _Case("V2-Lite, batch 32, 1,024 cached tokens each", (lite, 32, 1024)),
            _Case("V2-Lite, batch 256, 4,096 cached tokens each (more cache than weights)", (lite, 256, 4096)),
            _Case("V2-Lite, batch 8, 512 cached tokens, 1 byte per value (fp8)", (lite, 8, 512), {"bytes_per_value": 1}),
            _Case("V2-Lite with tied embeddings (lm_head is the embedding table, still read)",
                  (dataclasses.replace(lite, tie_word_embeddings=True), 4, 100)),
            _Case("V2-Lite with a dense MLP in its first 3 layers", (dataclasses.replace(lite, first_k_dense_replace=3), 16, 64)),
            _Case("the tiny model, batch 3, 40 cached tokens", (TINY, 3, 40)),
            _Case("batch -1 (must be refused)", (lite, -1, 0))]


@functools.cache
def _header_cases() -> list[_Case]:
    """Small safetensors files, written once per process into a temporary folder removed at exit."""
    import atexit
    import json
    import shutil
    import struct
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix="dsv2_exercise_"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)

    def file(name: str, header: dict | bytes, data: bytes, length: int | None = None) -> Path:
        raw = header if isinstance(header, bytes) else json.dumps(header).encode()
        path = folder / name
        path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
        return path

    good = {"__metadata__": {"format": "pt"}, "a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
            "b": {"dtype": "F32", "shape": [4], "data_offsets": [12, 28]}}
    return [
        _Case("two tensors and metadata", (file("good.safetensors", good, bytes(28)),)),
        _Case("a scalar and an empty tensor", (file("small.safetensors", {
            "s": {"dtype": "I64", "shape": [], "data_offsets": [0, 8]},
            "e": {"dtype": "F16", "shape": [0, 5], "data_offsets": [8, 8]}}, bytes(8)),)),
        _Case("the header length points past the end of the file (must be refused)",
              (file("short.safetensors", good, bytes(28), length=10_000),)),
        _Case("a tensor's bytes do not match its shape and dtype (must be refused)", (file("size.safetensors", {
            "a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 10]}}, bytes(10)),)),
        _Case("a tensor ends past the data section: a truncated file (must be refused)",
              (file("past.safetensors", good, bytes(20)),)),
        _Case("four bytes no tensor claims, between two tensors (must be refused)", (file("gap.safetensors", {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}}, bytes(20)),)),
        _Case("bytes after the last tensor (must be refused)", (file("trailing.safetensors", good, bytes(32)),)),
        _Case("two tensors overlap (must be refused)", (file("overlap.safetensors", {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)),)),
        _Case("an unknown dtype (must be refused)", (file("dtype.safetensors", {
            "a": {"dtype": "F13", "shape": [1], "data_offsets": [0, 2]}}, bytes(2)),)),
    ]


def _embedding_cases() -> list[_Case]:
    g = _gen(70)
    w = torch.randn(50, 16, generator=g).to(torch.bfloat16)
    return [_Case("ids [5] int64 over a [50, 16] bf16 table", (torch.randint(0, 50, (5,), generator=g), w)),
            _Case("ids [2, 3] int32 (the shape is kept)", (torch.randint(0, 50, (2, 3), generator=g).int(), w)),
            _Case("ids 0 and 49, the table's edges", (torch.tensor([0, 49]), w.float())),
            _Case("an id of 50 in a table of 50 rows (must be refused)", (torch.tensor([3, 50]), w)),
            _Case("a negative id (must be refused)", (torch.tensor([-1]), w)),
            _Case("float ids (must be refused: 1.7 names no row)", (torch.tensor([1.7, 2.0]), w))]


def _mla_projections_reference(x: torch.Tensor, q_proj: torch.Tensor, kv_a_proj: torch.Tensor, kv_a_norm: torch.Tensor,
                               kv_b_proj: torch.Tensor, heads: int, rope_dim: int) -> tuple[torch.Tensor, ...]:
    """Chapter 05's projections of one MLA layer (no ``q_lora_rank``), computed by the engine's ``MLA``
    with these weights: ``x [T, H]``, ``q_proj [h(n + r), H]``, ``kv_a_proj [C + r, H]``,
    ``kv_a_norm [C]``, ``kv_b_proj [h(n + v), C]`` -> ``q_nope [T, h, n]``, ``q_pe [T, h, r]``,
    ``latent [T, C]`` (RMS-normalised), ``k_pe [T, r]``, ``k_nope [T, h, n]``, ``v [T, h, v]``."""
    from dsv2_lib.core.dtypes import default_dtype
    from dsv2_lib.model.mla import MLA

    c = kv_a_norm.shape[0]
    nope = q_proj.shape[0] // heads - rope_dim
    cfg = dataclasses.replace(TINY, hidden_size=x.shape[1], num_attention_heads=heads, q_lora_rank=None,
                              kv_lora_rank=c, qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
                              v_head_dim=kv_b_proj.shape[0] // heads - nope)
    with default_dtype(x.dtype):
        attn = MLA(cfg)
    for param, w in ((attn.q_proj.weight, q_proj), (attn.kv_a_proj_with_mqa.weight, kv_a_proj),
                     (attn.kv_a_layernorm.weight, kv_a_norm), (attn.kv_b_proj.weight, kv_b_proj)):
        param.copy_(w)
    q_nope, q_pe = attn.project_q(x).split([nope, rope_dim], dim=-1)
    latent, k_pe = attn.kv_a_proj_with_mqa(x).split([c, rope_dim], dim=-1)
    latent = attn.kv_a_layernorm(latent)
    k_nope, v = attn.kv_b_proj(latent).view(x.shape[0], heads, -1).split([nope, cfg.v_head_dim], dim=-1)
    return q_nope, q_pe, latent, k_pe, k_nope, v


def _mla_cases() -> list[_Case]:
    cases = []
    for i, (T, H, h, n, r, c, v, dtype) in enumerate([
            (5, 256, 4, 32, 16, 64, 32, torch.float32),     # the tiny model's layer
            (1, 64, 2, 16, 8, 32, 24, torch.float32),       # one token; value heads wider than k_nope
            (2, 128, 16, 128, 64, 512, 128, torch.float32),  # V2-Lite's heads and latent, a narrow model
            (3, 256, 4, 32, 16, 64, 32, torch.bfloat16)]):
        g = _gen(80 + i)
        w = lambda rows, cols: torch.randn(rows, cols, generator=g) / cols ** 0.5  # noqa: E731
        args = (torch.randn(T, H, generator=g), w(h * (n + r), H), w(c + r, H), 1 + 0.1 * torch.randn(c, generator=g),
                w(h * (n + v), c))
        cases.append(_Case(f"{_n(T, 'token')}, H {H}, {_n(h, 'head')} of {n} + {r} (query/key) and {v} (value), "
                           f"latent {c}, {str(dtype).removeprefix('torch.')}",
                           tuple(a.to(dtype) for a in args) + (h, r)))
    return cases


def _attention_cases() -> list[_Case]:
    """``(q [n, h, d], k [start + n, h, d], v [start + n, h, dv], start, scale)``: causal_attention's arguments."""
    cases = []
    for i, (n, h, start, d, dv) in enumerate([(1, 1, 0, 8, 8), (4, 2, 12, 8, 8), (37, 2, 0, 16, 8),
                                             (8, 4, 122, 64, 32)]):
        g = _gen(90 + i)
        m = start + n
        cases.append(_Case(f"{_n(n, 'query', 'queries')} after {_n(start, 'cached token')}, {_n(h, 'head')}, "
                           f"head dim {d}",
                           (torch.randn(n, h, d, generator=g), torch.randn(m, h, d, generator=g),
                            torch.randn(m, h, dv, generator=g), start, d ** -0.5)))
    g = _gen(99)
    k = torch.randn(40, 1, 8, generator=g)
    k[35] = 3.0  # one key far above the rest, late: the running maximum must rescale what came before
    cases.append(_Case("a late key with a much larger score (the running max changes)",
                       (torch.rand(2, 1, 8, generator=g) + 1, k, torch.randn(40, 1, 8, generator=g), 38, 1.0)))
    return cases


def _silu_cases() -> list[_Case]:
    cases = []
    for i, (shape, dtype) in enumerate([((1, 8), torch.float32), ((3, 64), torch.bfloat16), ((2, 5, 32), torch.float16)]):
        cases.append(_Case(f"x {list(shape)} {str(dtype).removeprefix('torch.')} = [gate | up]",
                           ((torch.randn(shape, generator=_gen(100 + i)) * 4).to(dtype),)))
    return cases


def _split_decode_cases() -> list[_Case]:
    """fp32 entries with the tiny model's rows (latent 64 + rope 16) and V2-Lite's (512 + 64): one row, lengths
    around a 32-row tile, several chunks, slots out of order, and an entry with no row (zeros, as the kernel
    writes)."""
    cases = []
    for i, (h, c, r, lengths, slots) in enumerate([(4, 64, 16, [1], [0]), (4, 64, 16, [31, 32, 33], [2, 0, 1]),
                                                   (16, 512, 64, [1000], [0]), (2, 64, 16, [0, 70], [1, 0])]):
        g = _gen(120 + i)
        cache = torch.randn(max(slots) + 1, max(max(lengths), 1), c + r, generator=g)
        query = torch.randn(len(lengths), h, c + r, generator=g) * 0.2
        cases.append(_Case(f"{_n(len(lengths), 'entry', 'entries')} of {lengths} rows (slots {slots}), {_n(h, 'head')}, "
                           f"rows of {c} + {r}", (query, cache, slots, lengths, 0.1147, c)))
    return cases


def reserve_admits_reference(num_blocks: int, block_size: int, running: list[tuple[int, int]], prompt_len: int,
                             max_tokens: int) -> bool:
    """Chapter 11's admission with ``admission="reserve"`` (no prefix cache): every running request may
    grow to its ``max_len`` cached tokens (``running``: ``(cached now, max_len)`` each), so it holds the
    blocks of its worst case; a new request is admitted when its worst case, ``prompt_len + max_tokens
    - 1`` rows (the last token is never fed back), fits beside them in the pool of ``num_blocks``."""
    blocks = lambda tokens: -(-tokens // block_size)  # noqa: E731
    committed = sum(blocks(max_len) for _, max_len in running)
    return committed + blocks(prompt_len + max_tokens - 1) <= num_blocks


def _admit_cases() -> list[_Case]:
    return [_Case("an empty pool of 4 blocks of 16, a request of 40 + 25 tokens (64 rows: exactly 4 blocks)",
                  (4, 16, [], 40, 25)),
            _Case("the same request with 26 tokens to generate (65 rows: one block too many)", (4, 16, [], 40, 26)),
            _Case("running requests that may grow to 20 and 33 rows (5 blocks), a request of 60 + 21 tokens, 10 blocks of 16",
                  (10, 16, [(5, 20), (33, 33)], 60, 21)),
            _Case("the same with one generated token more (81 rows: 6 blocks)", (10, 16, [(5, 20), (33, 33)], 60, 22)),
            _Case("block size 1, max_tokens 1 (the prompt alone)", (7, 1, [(3, 4)], 3, 1))]


def _prefix_cases() -> list[_Case]:
    """Chapter 12's prefix-cache lookup, blocks of 4: caches (name -> block) as the block manager fills them."""
    bs, shared = 4, list(range(100, 112))  # three full blocks
    names, parent = [], None
    for i in range(3):
        parent = block_manager.block_hash(parent, shared[i * bs:(i + 1) * bs])
        names.append(parent)
    cached = dict(zip(names, (7, 2, 9)))
    return [_Case("an empty cache", ({}, shared + [1, 2], bs)),
            _Case("three cached blocks, then the prompt's own tokens", (cached, shared + [1, 2, 3], bs)),
            _Case("a prompt of exactly three cached blocks (its last token's logits must be computed)",
                  (cached, shared, bs)),
            _Case("the second block's tokens differ (the walk stops at the first miss)",
                  (cached, shared[:4] + [0, 0, 0, 0] + shared[8:] + [1], bs)),
            _Case("block 1 evicted, blocks 0 and 2 still cached (nothing after a miss counts)",
                  ({names[0]: 7, names[2]: 9}, shared + [1], bs)),
            _Case("block 1's tokens cached as the start of another prompt (names are chained)",
                  ({block_manager.block_hash(None, shared[4:8]): 5}, shared[4:8] + shared + [1], bs))]


def _slot_cases() -> list[_Case]:
    return [_Case("one block, block size 16", ([7], [0, 1, 15], 16)),
            _Case("three scattered blocks", ([4, 0, 9], [0, 15, 16, 31, 32, 40], 16)),
            _Case("block size 1", ([3, 1, 2], [0, 1, 2], 1)),
            _Case("a position past the last block (must be refused)", ([2, 5], [31, 32], 16)),
            _Case("a negative position (must be refused: table[-1] is the last block)", ([2, 5], [3, -1], 16))]


def step_tokens_reference(budget: int, decoding: int, partial: int, waiting: list[int]) -> tuple[int, int, list[int]]:
    """Chapter 14's order of a step's token budget, memory permitting: one token for each of the
    ``decoding`` requests, then the next chunk of the prompt being prefilled (``partial`` tokens still to
    compute; 0: none), then prompts from the queue (``waiting``: their lengths, first come first), each
    taking at most what is left -> (decode tokens, the partial prompt's chunk, [each admitted prompt's
    chunk]). A budget below one token is refused."""
    if budget < 1:
        raise ValueError(f"a step's budget must be at least 1 token, got {budget}")
    decode = min(decoding, budget)
    chunk = min(partial, budget - decode)
    left, admitted = budget - decode - chunk, []
    for length in waiting:
        if left < 1:
            break
        admitted.append(min(length, left))
        left -= admitted[-1]
    return decode, chunk, admitted


def _step_cases() -> list[_Case]:
    return [_Case("budget 16, nothing running, one prompt of 40 (its first chunk)", (16, 0, 0, [40])),
            _Case("budget 16, 2 decoding, 5 left of a prompt, a prompt of 20 waiting", (16, 2, 5, [20])),
            _Case("budget 8, 3 decoding, prompts of 2, 2 and 9 waiting (the last gets what is left)",
                  (8, 3, 0, [2, 2, 9])),
            _Case("budget 4, 6 decoding (decodes alone exceed the budget)", (4, 6, 10, [3])),
            _Case("budget 10, 4 decoding, 6 left of a prompt (exactly the rest): none admitted", (10, 4, 6, [1, 1])),
            _Case("budget 8192, 32 decoding, 32,768 left of a prompt", (8192, 32, 32768, [100])),
            _Case("a budget of 0 tokens (must be refused)", (0, 1, 0, [5]))]


EXERCISES: dict[str, _Exercise] = {e.name: e for e in [
    _Exercise("decode_bytes", "00", roofline.decode_bytes_per_step, _decode_bytes_cases),
    _Exercise("read_header", "01", safetensors_io.read_header, _header_cases,
              engine="dsv2_lib.core.safetensors_io:read_header"),
    _Exercise("embedding", "02", embedding.embedding_reference, _embedding_cases,
              engine="dsv2_lib.ops.embedding:embedding_reference", exact=True),
    _Exercise("rms_norm", "03", norm.rms_norm_reference, _rms_norm_cases,
              bits16="round the normalised row to the input's dtype, then multiply by the weight (transformers' order)",
              engine="dsv2_lib.ops.norm:rms_norm_reference"),
    _Exercise("mla_projections", "05", _mla_projections_reference, _mla_cases,
              fp32_tolerance=(1e-5, 1e-5)),  # two chained fp32 products over K up to 512, summed in any order
    _Exercise("online_attention", "06", attention.causal_attention, _attention_cases,
              engine="dsv2_lib.ops.attention:causal_attention"),
    _Exercise("silu_and_mul", "07", activation.silu_and_mul_reference, _silu_cases,
              bits16="rounded step by step? Compute in fp32 and round once at the end",
              engine="dsv2_lib.ops.activation:silu_and_mul_reference"),
    _Exercise("split_kv_decode", "10", mla_decode.mla_decode_reference, _split_decode_cases,
              fp32_tolerance=(1e-5, 1e-5),  # softmax sums over up to 1,000 rows, in another order
              engine="dsv2_lib.ops.mla_decode:mla_decode_reference"),
    _Exercise("reserve_admits", "11", reserve_admits_reference, _admit_cases),
    _Exercise("slot_mapping", "12", block_manager.slot_mapping, _slot_cases, exact=True,
              engine="dsv2_lib.engine.block_manager:slot_mapping"),
    _Exercise("prefix_hits", "12", block_manager.cached_prefix, _prefix_cases, exact=True,
              engine="dsv2_lib.engine.block_manager:cached_prefix"),
    _Exercise("rope", "04", rope.apply_rope_reference_, _rope_cases, in_place=(0, 1),
              mistakes=((_neox_rope, "the NeoX pairing (x[i], x[i + d/2]); DeepSeek rotates (x[2i], x[2i+1])"),),
              engine="dsv2_lib.ops.rope:apply_rope_reference_"),
    _Exercise("route", "08", moe_routing.route, _route_cases, engine="dsv2_lib.ops.moe_routing:route"),
    _Exercise("moe_align", "08", moe_routing.moe_align_reference, _moe_align_cases, exact=True,
              engine="dsv2_lib.ops.moe_routing:moe_align_reference"),
    _Exercise("filter_logits", "09", sampling.filter_logits, _filter_cases,
              engine="dsv2_lib.engine.sampling:filter_logits",
              sampling=SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=0)),
    _Exercise("balanced_segments", "13", mla_decode.balanced_segments, _segment_cases, exact=True),
    _Exercise("step_tokens", "14", step_tokens_reference, _step_cases, exact=True),
]}
