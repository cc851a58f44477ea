"""From ``kernels_cu/*.cu`` to a launch: compile with NVRTC through CuPy, pick the backend, check
tensors, launch on PyTorch's current stream.

Every op module declares its kernels once with :class:`KernelFile` (file name and the template
instantiations it uses). Kernels are compiled on first use for the GPU at hand (``sm_XY``) and
cached per (file, device). Launches go to ``torch.cuda.current_stream()`` read at each launch, so
a whole decode step can be captured in a CUDA graph. Pointers travel as ``numpy.uint64``,
integers as ``numpy.int32``/``int64``, floats as ``numpy.float32``.
"""
from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels_cu"
CUDA_TYPE = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
BACKENDS = ("auto", "cuda", "torch")


@dataclass(frozen=True)
class KernelFile:
    """A ``.cu`` file and the kernel instantiations (C++ name expressions) the engine launches from it."""

    filename: str
    names: tuple[str, ...]

    def function(self, name: str, device: torch.device):
        """The compiled kernel ``name`` (one of ``names``) for ``device``; looked up once, then cached."""
        key = (self.filename, name, _device_index(device))
        fn = _functions.get(key)
        if fn is None:
            if name not in self.names:
                raise KeyError(f"{self.filename}: kernel {name!r} is not declared; declared: {', '.join(self.names)}")
            fn = _functions[key] = _compiled(self, key[2]).get_function(name)
        return fn


_functions: dict[tuple[str, str, int], object] = {}
KERNEL_FILES: dict[str, KernelFile] = {}


def declare(filename: str, names: list[str]) -> KernelFile:
    """Register a kernel file (used by the compile check, which builds exactly these instantiations)."""
    kf = KernelFile(filename, tuple(names))
    KERNEL_FILES[filename] = kf
    return kf


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _source(kf: KernelFile) -> str:
    """The file's text, ending with a comment that names every header's contents: CuPy caches compiled
    modules on disk by their source text, which does not see a change inside an ``#include``d header."""
    headers = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(KERNEL_DIR.rglob("*.cuh")))).hexdigest()
    return (KERNEL_DIR / kf.filename).read_text() + f"\n// headers: sha256 {headers}\n"


@functools.cache
def _compiled(kf: KernelFile, device_index: int):
    import cupy

    major, minor = torch.cuda.get_device_capability(device_index)
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(
            code=_source(kf),
            options=("-std=c++17", f"--gpu-architecture=sm_{major}{minor}", f"-I{KERNEL_DIR}"),
            name_expressions=kf.names,
        )
        module.compile()
    return module


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
        return True
    return x.is_cuda and cupy_works()


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
    """Launch on PyTorch's current stream (read now, so graph capture records the launch).

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
