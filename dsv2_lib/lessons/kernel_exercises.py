"""Build it on the GPU: write the chapter's CUDA kernel yourself, compile it with CuPy, grade it.

    check_kernel("rms_norm_kernel", source)   # source: CUDA C text defining the kernel the exercise names

On a CUDA GPU the source is compiled by NVRTC (through CuPy, as the engine compiles ``kernels_cu/``),
launched on the exercise's cases with a fixed grid, and graded against the PyTorch reference exactly
as :func:`~dsv2_lib.lessons.exercises.check` grades a Python function: one line, the first failing
case in words. Without a GPU the part that needs none still runs: the source is compiled for sm_90
with ``nvcc`` when it is installed, so syntax and type errors show up on any machine.

Each kernel is ``extern "C"`` (a plain name to look up) and works in float32; the launch is fixed
by the exercise, so the signature and the grid are part of the task (the launchers name each argument
as the signature below does, and :func:`~dsv2_lib.core.kernels.bind` puts them in its order):

* ``embedding_kernel`` (chapter 02): ``embedding(const long long* ids, const float* weight, float* out,
  int hidden)``, one block of 256 threads per id of ``ids [n]``, copying row ``ids[t]`` of ``weight [V, hidden]``
  to row ``t`` of ``out [n, hidden]`` (the ids are in range: the reference refuses the others first).
* ``rms_norm_kernel`` (chapter 03): ``rms_norm(const float* x, const float* weight, float* out,
  int cols, float eps)``, one block of 256 threads per row of ``x [rows, cols]``.
* ``silu_and_mul_kernel`` (chapter 07): ``silu_and_mul(const float* x, float* out, int rows, int inter)``,
  one thread per output element of ``out [rows, inter]``, blocks of 256 threads, for ``x [rows, 2 * inter]``.
* ``combine_kernel`` (chapter 08): ``combine(const float* y, const float* weights, const int* slot_of,
  float* out, int k, int hidden)``, one block of 256 threads per token of ``out [T, hidden]``: row ``t`` is
  the sum over the picks ``j = 0 .. k-1``, in that order, of ``weights[t*k + j] * y[slot_of[t*k + j]]``,
  a pick whose slot is -1 (a dropped choice) skipped (:func:`_combine_reference`).
"""
from __future__ import annotations

import math
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from dsv2_lib.core import kernels
from dsv2_lib.lessons.exercises import _Case, _difference
from dsv2_lib.ops import activation, embedding, norm
from dsv2_lib.ops.moe_routing import moe_align_reference

THREADS = 256  # threads per block of every exercise's launch
EMBEDDING_PARAMS = ("ids", "weight", "out", "hidden")  # the exercises' signatures (module doc)
RMS_NORM_PARAMS = ("x", "weight", "out", "cols", "eps")
SILU_PARAMS = ("x", "out", "rows", "inter")
COMBINE_PARAMS = ("y", "weights", "slot_of", "out", "k", "hidden")
GUARD = 1024  # marked floats after each launch's ``out``: a store past its end lands there
FILL_BITS = 0x7FA5A5A5  # the mark: a NaN with a payload no arithmetic produces (a computed NaN is 0x7FFFFFFF)


class KernelCompileError(ValueError):
    """The reader's source does not compile (the compiler's log is the message)."""


@dataclass(frozen=True)
class _KernelExercise:
    """``kernel``: the ``extern "C"`` name to launch; ``launch(fn, *args)`` runs it on CUDA copies of a
    case's arguments and returns the result and the guard after it (:func:`_nan_out`) on the CPU."""

    chapter: str
    kernel: str
    reference: Callable
    cases: Callable[[], list[_Case]]
    launch: Callable
    exact: bool = False  # bit for bit (a copy), else within the rounding of another summation order


def _embedding_cases() -> list[_Case]:
    g = torch.Generator().manual_seed(2)
    cases = []
    for n, v, h in [(1, 1, 1), (3, 10, 7), (5, 64, 256), (4, 50, 300), (37, 1000, 2048)]:
        ids = torch.randint(0, v, (n,), generator=g)
        ids[0], ids[-1] = 0, v - 1  # the table's first and last rows
        if n >= 3:
            ids[1] = v - 1  # an id twice
        cases.append(_Case(f"ids [{n}] into weight [{v}, {h}] float32", (ids, torch.randn(v, h, generator=g))))
    return cases


def _launch_embedding(fn, ids, weight):
    ids, weight = ids.cuda().contiguous(), weight.cuda().contiguous()
    out, guard = _nan_out((ids.shape[0], weight.shape[1]), weight.device)
    args = dict(ids=kernels.ptr(ids), weight=kernels.ptr(weight), out=kernels.ptr(out),
                hidden=np.int32(weight.shape[1]))
    kernels.launch(fn, (ids.shape[0],), (THREADS,), kernels.bind(EMBEDDING_PARAMS, args, "embedding", "the exercise"))
    return out.cpu(), guard.cpu()


def _rms_norm_cases() -> list[_Case]:
    g = torch.Generator().manual_seed(3)
    shapes = [(1, 1), (3, 33), (5, 1000), (4, 2048), (2, 300)]
    return [_Case(f"x [{r}, {c}] float32, eps 1e-6", (torch.randn(r, c, generator=g) * 3, torch.randn(c, generator=g), 1e-6))
            for r, c in shapes] + [_Case("x [2, 64] float32 of zeros: only eps keeps the scale finite",
                                         (torch.zeros(2, 64), torch.randn(64, generator=g), 1e-6))]


def _nan_out(shape: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` of ``shape`` and the :data:`GUARD` floats after it, in one buffer of marked NaN
    (:data:`FILL_BITS`): after the launch an element still marked was never stored, and a guard element
    no longer marked was stored past the end. A NaN the kernel computes (0 · inf) has other bits."""
    n = math.prod(shape)
    buf = torch.full((n + GUARD,), FILL_BITS, dtype=torch.int32, device=device).view(torch.float32)
    return buf[:n].view(shape), buf[n:]


def _marked(t: torch.Tensor) -> torch.Tensor:
    """Where ``t`` (fp32) still holds the mark :data:`FILL_BITS` the launch put there."""
    return t.contiguous().view(torch.int32) == FILL_BITS


def _launch_rms_norm(fn, x, weight, eps):
    x, weight = x.cuda().contiguous(), weight.cuda().contiguous()
    out, guard = _nan_out(tuple(x.shape), x.device)
    args = dict(x=kernels.ptr(x), weight=kernels.ptr(weight), out=kernels.ptr(out), cols=np.int32(x.shape[1]),
                eps=np.float32(eps))
    kernels.launch(fn, (x.shape[0],), (THREADS,), kernels.bind(RMS_NORM_PARAMS, args, "rms_norm", "the exercise"))
    return out.cpu(), guard.cpu()


def _silu_cases() -> list[_Case]:
    g = torch.Generator().manual_seed(7)
    shapes = [(1, 1), (3, 7), (2, 1000), (5, 1408), (1, 10944)]
    return [_Case(f"x [{r}, {2 * i}] float32", (torch.randn(r, 2 * i, generator=g) * 4,)) for r, i in shapes]


def _launch_silu(fn, x):
    x = x.cuda().contiguous()
    rows, inter = x.shape[0], x.shape[1] // 2
    out, guard = _nan_out((rows, inter), x.device)
    args = dict(x=kernels.ptr(x), out=kernels.ptr(out), rows=np.int32(rows), inter=np.int32(inter))
    kernels.launch(fn, (-(-rows * inter // THREADS),), (THREADS,), kernels.bind(SILU_PARAMS, args, "silu_and_mul",
                                                                                "the exercise"))
    return out.cpu(), guard.cpu()


def _combine_reference(y: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor) -> torch.Tensor:
    """Chapter 08's combine in fp32: ``out [T, H]``, row t = Σ_j weights[t, j] · y[slot_of[t·k + j]] over the
    picks j = 0 .. k-1 in order, a slot of -1 skipped. ``y [rows, H]``: the experts' outputs in sorted
    order; ``weights [T, k]`` fp32; ``slot_of [T·k]`` int32 (:func:`~dsv2_lib.ops.moe_routing.moe_align_reference`)."""
    t, k = weights.shape
    slots = slot_of.view(t, k).long()
    out = torch.zeros(t, y.shape[1])
    for j in range(k):  # the kernel's order: pick 0 first
        kept = slots[:, j] >= 0
        out[kept] += weights[kept, j, None] * y[slots[kept, j]]
    return out


def _combine_cases() -> list[_Case]:
    """The experts' outputs ``y`` in the order ``moe_align_reference`` sorts the choices into (16-row
    tiles, padding rows included); in the last two cases some choices are dropped (slot -1)."""
    g = torch.Generator().manual_seed(8)
    cases = []
    for t, k, e, h, dropped in [(1, 1, 1, 1, 0), (3, 2, 4, 7, 0), (5, 6, 64, 300, 0), (4, 6, 16, 2048, 3),
                                (7, 3, 8, 33, 5)]:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        _, slot_of, _, _ = moe_align_reference(ids, e, 16)
        slot_of = slot_of.clone()
        slot_of[torch.randperm(t * k, generator=g)[:dropped]] = -1
        rows = (t * k + e * 15) // 16 * 16  # moe_align_reference's cap
        what = f"T {t}, k {k}, y [{rows}, {h}] float32" + (f", {dropped} choices dropped" if dropped else "")
        cases.append(_Case(what, (torch.randn(rows, h, generator=g), torch.rand(t, k, generator=g), slot_of)))
    return cases


def _launch_combine(fn, y, weights, slot_of):
    y, weights, slot_of = y.cuda().contiguous(), weights.cuda().contiguous(), slot_of.cuda().contiguous()
    t, k = weights.shape
    out, guard = _nan_out((t, y.shape[1]), y.device)
    args = dict(y=kernels.ptr(y), weights=kernels.ptr(weights), slot_of=kernels.ptr(slot_of), out=kernels.ptr(out),
                k=np.int32(k), hidden=np.int32(y.shape[1]))
    kernels.launch(fn, (t,), (THREADS,), kernels.bind(COMBINE_PARAMS, args, "combine", "the exercise"))
    return out.cpu(), guard.cpu()


KERNEL_EXERCISES = {
    "embedding_kernel": _KernelExercise("02", "embedding", embedding.embedding_reference, _embedding_cases,
                                        _launch_embedding, exact=True),
    "rms_norm_kernel": _KernelExercise("03", "rms_norm", norm.rms_norm_reference, _rms_norm_cases, _launch_rms_norm),
    "silu_and_mul_kernel": _KernelExercise("07", "silu_and_mul", activation.silu_and_mul_reference, _silu_cases,
                                           _launch_silu),
    "combine_kernel": _KernelExercise("08", "combine", _combine_reference, _combine_cases, _launch_combine),
}


def _exercise(name: str) -> _KernelExercise:
    if name not in KERNEL_EXERCISES:
        raise KeyError(f"no kernel exercise {name!r}; they are {sorted(KERNEL_EXERCISES)}")
    return KERNEL_EXERCISES[name]


def compile_kernel(source: str, kernel: str, device: torch.device | None = None):
    """The kernel ``kernel`` of ``source`` compiled by NVRTC for the GPU at hand (CuPy's RawModule)."""
    import cupy

    if not re.search(rf"\b{kernel}\s*\(", source):  # asking the driver for a missing name is an API error
        raise KernelCompileError(f'no kernel named {kernel!r} in the source; declare it extern "C" __global__ void {kernel}(...)')
    device = device or torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(device)
    with cupy.cuda.Device(device.index):
        try:
            module = cupy.RawModule(code=source, options=("-std=c++17", f"--gpu-architecture=sm_{major}{minor}",
                                                          f"-I{kernels.KERNEL_DIR}"))
            return module.get_function(kernel)
        except cupy.cuda.compiler.CompileException as e:
            raise KernelCompileError(_first_error(str(e))) from None
        except cupy.cuda.driver.CUDADriverError as e:  # compiled, but no such (extern "C") function
            raise KernelCompileError(f"no kernel named {kernel!r} in the source ({e}); declare it "
                                     f'extern "C" __global__ void {kernel}(...)') from None


def nvcc_check(source: str) -> str | None:
    """Compile ``source`` for sm_90 with nvcc (no GPU needed): None when it compiles, else the log;
    raises FileNotFoundError where nvcc is not installed."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc is not installed")
    with tempfile.TemporaryDirectory() as tmp:
        unit = Path(tmp) / "exercise.cu"
        unit.write_text("#include <cuda_runtime.h>\n" + source)
        r = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", f"-I{kernels.KERNEL_DIR}", "-c", str(unit),
                            "-o", str(Path(tmp) / "k.o")], capture_output=True, text=True)
    if r.returncode == 0:
        return None
    return _first_error(r.stderr, lines_added=1)


def _first_error(log: str, lines_added: int = 0) -> str:
    """The compiler's first error, located in the reader's own source: ``"/tmp/x/k.cu(8): error: ..."``
    becomes ``"line 7: error: ..."`` when one line was prepended."""
    log = re.sub(r"\S*\.cu\((\d+)\): ", lambda m: f"line {int(m[1]) - lines_added}: ", log.strip())
    return next((line for line in log.splitlines() if "error" in line), log.splitlines()[0] if log else "")


def grade_kernel(name: str, source: str) -> tuple[bool | None, str]:
    """``(passed, one line)``; ``passed`` is None when only the compile check could run (no GPU)."""
    ex = _exercise(name)
    gpu = torch.cuda.is_available() and kernels.cupy_works() and kernels.gpu_supported(torch.cuda.current_device())
    if not gpu:
        try:
            log = nvcc_check(source)
        except FileNotFoundError:
            return None, (f"· {name}: needs a CUDA GPU of compute capability 8.0 or newer (and CuPy) to run; nvcc "
                          "is not here to compile-check it either")
        if log:
            return False, f"✗ {name}: does not compile: {log}"
        return None, f"· {name}: compiles for sm_90 (nvcc); running it against the reference needs a CUDA GPU"
    try:
        fn = compile_kernel(source, ex.kernel)
    except KernelCompileError as e:
        return False, f"✗ {name}: does not compile: {e}"
    cases = ex.cases()
    for i, case in enumerate(cases, 1):
        want = ex.reference(*case.args, **case.kwargs)
        got, guard = ex.launch(fn, *case.args, **case.kwargs)
        torch.cuda.synchronize()
        problem = _stored_outside(guard) or _never_stored(got, want) or _difference(got, want, exact=ex.exact)
        if problem:
            return False, f"✗ {name}, case {i} of {len(cases)} ({case.what}): {problem}"
    return True, f"✓ {name}: all {len(cases)} cases match the reference on {torch.cuda.get_device_name()}"


def _stored_outside(guard: torch.Tensor) -> str | None:
    """What a store past the end of ``out`` left in the guard after it, in words (``None``: nothing)."""
    hit = ~_marked(guard)
    if not bool(hit.any()):
        return None
    return (f"stored {int(hit.sum())} value(s) past the end of out, the first {int(hit.nonzero()[0]) + 1} float(s) "
            f"past it: check the index against the size before every store")


def _never_stored(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """The elements of ``out`` still marked (:func:`_nan_out`) where the reference has a number."""
    missing = _marked(got) & ~torch.isnan(want)
    if not bool(missing.any()):
        return None
    idx = [int(i) for i in missing.nonzero()[0]]
    return (f"out{idx} was never stored ({int(missing.sum())} of {want.numel()} elements still hold the NaN the "
            f"launch put there): does every element have a thread that writes it?")


def check_kernel(name: str, source: str) -> None:
    """Grade ``source`` against kernel exercise ``name`` and print the verdict: one line."""
    print(grade_kernel(name, source)[1])
