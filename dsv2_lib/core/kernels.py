"""From ``kernels_cu/*.cu`` to a launch: compile with NVRTC through CuPy, pick the backend, check
tensors, launch on PyTorch's current stream.

Every op module declares its kernels once with :class:`KernelFile`: the file name, the template
instantiations it uses and the constants Python and CUDA share (``defines``, the one source of each:
the compiler gets them as ``-D`` flags, so a ``.cu`` file says ``constexpr int WARPS = DSV2_GEMV_WARPS;``).
Kernels are compiled on first use for the GPU at hand (``sm_XY``) and cached per (file, device).
:meth:`KernelFile.launch` takes the arguments by the names of the kernel's ``__global__`` parameters
(parsed once from the source) and refuses a missing or unknown one. Launches go to
``torch.cuda.current_stream()`` read at each launch, so a whole decode step can be captured in a CUDA
graph. Pointers travel as ``numpy.uint64``, integers as ``numpy.int32``/``int64``, floats as ``numpy.float32``.
A kernel that begins with ``wait_for_prior_grids()`` (``common.cuh``; every engine kernel does) is launched as a
programmatic dependent launch on a Hopper GPU (:mod:`~dsv2_lib.core.dependent_launch`, chapter 14).
"""
from __future__ import annotations

import difflib
import functools
import hashlib
import keyword
import operator
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dsv2_lib.core.dependent_launch import launch_dependent, programmatic_launch_supported

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels_cu"
CUDA_TYPE = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
BACKENDS = ("auto", "cuda", "torch")


@dataclass(frozen=True)
class KernelFile:
    """A ``.cu`` file, the kernel instantiations (C++ name expressions) the engine launches from it, and
    the constants it shares with Python (``defines``: ``(macro name, int)`` pairs, every name ``DSV2_...``)."""

    filename: str
    names: tuple[str, ...]
    defines: tuple[tuple[str, int], ...] = ()

    def flags(self) -> tuple[str, ...]:
        """The ``-D`` flags that carry ``defines`` to the compiler (NVRTC here, nvcc in the compile check).
        CuPy keys its compile cache on the options as well as the source, so a changed constant recompiles."""
        return tuple(f"-D{name}={value}" for name, value in self.defines)

    def function(self, name: str, device: torch.device):
        """The compiled kernel ``name`` (one of ``names``) for ``device``; looked up once, then cached."""
        key = (self.filename, name, _device_index(device))
        fn = _functions.get(key)
        if fn is None:
            self._check_declared(name)
            fn = _functions[key] = _compiled(self, key[2]).get_function(name)
        return fn

    def params(self, name: str) -> tuple[str, ...]:
        """The parameter names of kernel ``name`` (one of ``names``) in the order of its ``__global__``
        signature, in the file or a header it includes; parsed once."""
        params = _params.get((self.filename, name))
        if params is None:
            self._check_declared(name)
            base = name.split("<", 1)[0].strip()
            found = _signatures(KERNEL_DIR / self.filename)
            if base not in found:
                raise KeyError(f"{self.filename}: no __global__ function {base!r} in the file or its headers")
            params = _params[(self.filename, name)] = found[base]
        return params

    def launch(self, name: str, device: torch.device, grid: tuple[int, ...], block: tuple[int, ...], /, *,
               shared_mem: int = 0, **args) -> None:
        """Launch kernel ``name`` on ``device`` with every argument named as its ``__global__`` parameter
        (``out=kernels.ptr(out), n=np.int32(n)``), put in signature order; a missing, unknown or misspelled
        name raises :func:`bind`'s ``TypeError`` (on a first launch, before anything is compiled).

        The first launch on a device checks the names (:func:`bind`) and keeps the function with an ``itemgetter``
        of the parameter order, so a later launch is one dict lookup and one C call. A kernel that :meth:`waits`
        goes to ``launch_dependent`` where the GPU has it (chapter 14), every other to :func:`launch`."""
        key = (self.filename, name, _device_index(device))
        entry = _launchers.get(key)
        if entry is None:
            params = self.params(name)
            bind(params, args, name, self.filename)
            order = operator.itemgetter(*params) if len(params) > 1 else lambda a: tuple(a[p] for p in params)
            dependent = self.waits(name) and programmatic_launch_supported(key[2])
            entry = _launchers[key] = (self.function(name, device), order, len(params), dependent)
        fn, order, n, dependent = entry
        try:
            values = order(args)
        except KeyError:
            values = None
        if values is None or len(args) != n:
            bind(self.params(name), args, name, self.filename)  # raises, naming the parameter
        (launch_dependent if dependent else launch)(fn, grid, block, values, shared_mem)

    def waits(self, name: str) -> bool:
        """Whether kernel ``name`` calls ``wait_for_prior_grids()``: it may start before the one ahead ends."""
        self._check_declared(name)
        return name.split("<", 1)[0].strip() in _waiting_kernels(KERNEL_DIR / self.filename)

    def _check_declared(self, name: str) -> None:
        if name not in self.names:
            raise KeyError(f"{self.filename}: kernel {name!r} is not declared; declared: {', '.join(self.names)}")


_functions: dict[tuple[str, str, int], object] = {}
_params: dict[tuple[str, str], tuple[str, ...]] = {}
_launchers: dict[tuple[str, str, int], tuple] = {}  # (file, kernel, device) -> (function, order, count, dependent)
KERNEL_FILES: dict[str, KernelFile] = {}


def declare(filename: str, names: list[str], defines: dict[str, int] | None = None) -> KernelFile:
    """Register a kernel file (used by the compile check, which builds exactly these instantiations with
    these ``defines``: the constants the file shares with Python, ``DSV2_...`` names and int values)."""
    defines = dict(defines or {})
    for macro, value in defines.items():
        if not re.fullmatch(r"DSV2_[A-Z0-9_]+", macro) or type(value) is not int:
            raise ValueError(f"{filename}: define {macro}={value!r}: want a DSV2_... name and an int")
    kf = KernelFile(filename, tuple(names), tuple(sorted(defines.items())))
    KERNEL_FILES[filename] = kf
    return kf


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _source(kf: KernelFile) -> str:
    """The file's text, ending with a comment that names every header's contents: CuPy caches compiled
    modules on disk by their source text, which does not see a change inside an ``#include``d header."""
    headers = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(KERNEL_DIR.rglob("*.cuh")))).hexdigest()
    return (KERNEL_DIR / kf.filename).read_text() + f"\n// headers: sha256 {headers}\n"


def _options(kf: KernelFile, capability: tuple[int, int]) -> tuple[str, ...]:
    """NVRTC's options for ``kf`` on a GPU of compute ``capability``: C++17, the architecture, the include
    directory and the file's defines."""
    return ("-std=c++17", f"--gpu-architecture=sm_{capability[0]}{capability[1]}", f"-I{KERNEL_DIR}", *kf.flags())


@functools.cache
def _compiled(kf: KernelFile, device_index: int):
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=_source(kf), options=_options(kf, torch.cuda.get_device_capability(device_index)),
                                name_expressions=kf.names)
        module.compile()
    return module


# ---- kernel signatures -----------------------------------------------------------------------------
_GLOBAL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s*)?(\w+)\s*\(")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_QUALIFIERS = {"const", "volatile", "unsigned", "signed", "__restrict__", "void"}


def _texts(path: Path, seen: set[Path] | None = None) -> list[str]:
    """The text of ``path`` and of every local header it includes (``#include "..."``, looked up beside the
    file, then in ``KERNEL_DIR``), each once."""
    seen = set() if seen is None else seen
    path = path.resolve()
    if path in seen:
        return []
    seen.add(path)
    text = path.read_text()
    texts = [text]
    for header in _INCLUDE.findall(text):
        found = next((p for p in (path.parent / header, KERNEL_DIR / header) if p.is_file()), None)
        if found is not None:
            texts += _texts(found, seen)
    return texts


@functools.cache
def _signatures(path: Path) -> dict[str, tuple[str, ...]]:
    """Kernel name -> its parameter names in order, for every ``__global__`` function of ``path`` and of the
    local headers it includes."""
    found: dict[str, tuple[str, ...]] = {}
    for text in _texts(path):
        text = _COMMENT.sub(" ", text)
        for m in _GLOBAL.finditer(text):
            end, depth = m.end(), 1
            while depth:
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                end += 1
            params = _param_names(text[m.end() : end - 1], m[1], path)
            if found.setdefault(m[1], params) != params:
                raise ValueError(f"{path.name}: kernel {m[1]} is defined twice with different parameters")
    return found


_WAIT = re.compile(r"\bwait_for_prior_grids\s*\(\s*\)")


@functools.cache
def _waiting_kernels(path: Path) -> frozenset[str]:
    """The ``__global__`` functions of ``path`` and its local headers whose body calls ``wait_for_prior_grids()``."""
    found = set()
    for text in _texts(path):
        text = _COMMENT.sub(" ", text)
        for m in _GLOBAL.finditer(text):
            start = text.index("{", m.end())
            end, depth = start + 1, 1
            while depth:
                depth += {"{": 1, "}": -1}.get(text[end], 0)
                end += 1
            if _WAIT.search(text, start, end):
                found.add(m[1])
    return frozenset(found)


def _param_names(plist: str, kernel: str, path: Path) -> tuple[str, ...]:
    """The names in a ``__global__`` parameter list (commas inside brackets do not split it)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(plist + ","):
        depth += (ch in "(<[{") - (ch in ")>]}")
        if ch == "," and depth == 0:
            parts.append(plist[start:i].split("=")[0].strip())
            start = i + 1
    names = []
    for part in parts:
        if part in ("", "void"):
            continue
        m = re.search(r"(\w+)\s*(?:\[[^\]]*\]\s*)*$", part)
        if m is None or m[1] in _QUALIFIERS or part == m[1]:
            raise ValueError(f"{path.name}: kernel {kernel}: cannot read a parameter name in {part!r}")
        if keyword.iskeyword(m[1]) or m[1] == "shared_mem":
            raise ValueError(f"{path.name}: kernel {kernel}: parameter {m[1]!r} cannot be a keyword argument of "
                             "KernelFile.launch; rename it")
        names.append(m[1])
    return tuple(names)


def bind(params: tuple[str, ...], args: dict, kernel: str, filename: str) -> tuple:
    """``args`` (parameter name -> value) as the positional tuple a kernel with parameters ``params`` takes.
    Every parameter exactly once: a missing, unknown or misspelled name raises ``TypeError`` naming the
    ``kernel``, its ``filename`` and the parameter."""
    try:
        values = tuple(map(args.__getitem__, params))
    except KeyError:
        values = None
    if values is None or len(args) != len(params):
        unknown = [a for a in args if a not in params]
        missing = [p for p in params if p not in args]
        problems = []
        for a in unknown:
            close = difflib.get_close_matches(a, missing or params, n=1)
            problems.append(f"unknown argument {a!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        if missing:
            problems.append("missing argument" + "s" * (len(missing) > 1) + " " + ", ".join(map(repr, missing)))
        raise TypeError(f"{filename}: {kernel}: {'; '.join(problems)}; its parameters are ({', '.join(params)})")
    return values


# ---- backend choice --------------------------------------------------------------------------------
def backend() -> str:
    """``DSV2_BACKEND``: ``auto`` (default: kernels for CUDA tensors when CuPy works), ``cuda`` or ``torch``."""
    choice = os.environ.get("DSV2_BACKEND", "auto").lower()
    if choice not in BACKENDS:
        raise ValueError(f"DSV2_BACKEND must be one of {', '.join(BACKENDS)}, got {choice!r}")
    return choice


@functools.cache
def cupy_works() -> bool:
    """CuPy imports and sees a GPU (checked once)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "use the reference"
        return False


MIN_CAPABILITY = (8, 0)  # the kernels use bf16 mma.sync and cp.async: Ampere (sm_80) and newer


def gpu_supported(index: int) -> bool:
    """CUDA device ``index`` can run the kernels: compute capability :data:`MIN_CAPABILITY` or newer. An older
    GPU (a T4, a V100) runs the PyTorch references instead."""
    return _capability(index) >= MIN_CAPABILITY


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def use_kernels(x: torch.Tensor) -> bool:
    """Whether an op on ``x`` goes to its CUDA kernel (else to its PyTorch reference)."""
    choice = backend()
    if choice == "torch":
        return False
    if choice == "cuda":
        if not x.is_cuda or not cupy_works():
            raise RuntimeError(
                f"DSV2_BACKEND=cuda but the tensor is on {x.device} or CuPy cannot use a GPU; "
                "unset it (auto) or use DSV2_BACKEND=torch"
            )
        if not gpu_supported(x.device.index):
            major, minor = _capability(x.device.index)
            raise RuntimeError(
                f"DSV2_BACKEND=cuda but {x.device} has compute capability {major}.{minor}; the kernels need "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer: unset it (auto) or use DSV2_BACKEND=torch"
            )
        return True
    return x.is_cuda and cupy_works() and gpu_supported(x.device.index)


# ---- checks and launch -----------------------------------------------------------------------------
def check(t: torch.Tensor, name: str, *, dtype: torch.dtype | None = None, shape: tuple | None = None,
          device: torch.device | None = None, contiguous: bool = True) -> None:
    """Refuse a tensor a kernel cannot safely read: wrong dtype, shape (None = any size), device or layout."""
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name}: dtype {t.dtype}, expected {dtype}")
    if t.dtype not in CUDA_TYPE and dtype is None:
        raise TypeError(f"{name}: dtype {t.dtype} has no kernel; supported: float32, float16, bfloat16")
    if shape is not None and (t.dim() != len(shape) or any(w is not None and w != s for s, w in zip(t.shape, shape))):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"{name}: shape {list(t.shape)}, expected {want}")
    if not t.is_cuda or (device is not None and t.device != device):
        raise ValueError(f"{name}: on {t.device}, expected {device or 'a CUDA device'}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: not contiguous (strides {t.stride()}); call .contiguous() first")


def aligned16(*tensors: torch.Tensor) -> bool:
    """All data pointers on 16-byte boundaries (needed by the vectorised kernel variants)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


class _TorchStream:
    """A raw stream handle in the CUDA stream protocol, so CuPy can launch on PyTorch's stream."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


_streams: dict[int, object] = {}


def launch(kernel, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int = 0) -> None:
    """Launch a compiled kernel on PyTorch's current stream (read now, so graph capture records the launch),
    ``args`` in the order of its parameters, as :meth:`KernelFile.launch` builds them from names (:func:`bind`).

    The handle comes from ``torch._C._cuda_getCurrentRawStream`` (what Triton and PyTorch's own
    generated code call): ``torch.cuda.current_stream()`` builds a Stream object each time, several
    microseconds per launch, and a prefill layer makes dozens of launches."""
    import cupy

    handle = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
    stream = _streams.get(handle)
    if stream is None:
        stream = _streams[handle] = cupy.cuda.Stream.from_external(_TorchStream(handle))
    with stream:
        kernel(grid, block, args, shared_mem=shared_mem)
