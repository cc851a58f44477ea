"""Programmatic dependent launch (chapter 14): a kernel may be scheduled while the kernel ahead of it on the
stream is still running, and waits for it in its own first statement (``wait_for_prior_grids()``,
``kernels_cu/common.cuh``). Hopper (compute capability 9.0) and later; :meth:`KernelFile.launch
<dsv2_lib.core.kernels.KernelFile.launch>` sends every kernel that waits here, the others to CuPy's launch.
"""
from __future__ import annotations

import ctypes
import functools
import struct
import threading

import numpy as np
import torch

# cuLaunchKernelEx, which takes launch attributes (CuPy's launch does not), called through ctypes. Its
# config is CUlaunchConfig: grid x/y/z, block x/y/z, dynamic shared bytes, stream, attribute array and
# count; the one attribute is CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (6) = 1 (an id, 4 bytes
# of padding, a 64-byte value union).
_LAUNCH_CONFIG = struct.Struct("=7I4xQQI4x")
_PROGRAMMATIC_ATTRIBUTE = struct.pack("=I4xi60x", 6, 1)
_ARG_CODES = {np.uint64: "Q", np.int64: "q", np.int32: "i", np.float32: "f"}
_launch_lock = threading.Lock()  # the buffers below are shared: one launch fills and submits them at a time


@functools.cache
def programmatic_launch_supported(device_index: int) -> bool:
    """Programmatic dependent launch needs compute capability 9.0 (Hopper) or later."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


@functools.cache
def _driver():
    """``(cuLaunchKernelEx, config buffer, attribute buffer, cuGetErrorName)`` from libcuda. The buffers are
    reused by every launch: the driver reads them before the call returns."""
    lib = ctypes.CDLL("libcuda.so.1")
    launch_ex, error_name = lib.cuLaunchKernelEx, lib.cuGetErrorName
    launch_ex.argtypes, launch_ex.restype = [ctypes.c_void_p] * 4, ctypes.c_int
    error_name.argtypes, error_name.restype = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)], ctypes.c_int
    return (launch_ex, ctypes.create_string_buffer(_LAUNCH_CONFIG.size),
            ctypes.create_string_buffer(_PROGRAMMATIC_ATTRIBUTE, len(_PROGRAMMATIC_ATTRIBUTE)), error_name)


@functools.cache
def _arg_buffer(types: tuple[type, ...]):
    """For kernel arguments of these numpy types: ``(packer, buffer, pointers)``. The packer lays the values
    out at the offsets the kernel's parameter block has (each at a multiple of its size) in ``buffer``;
    ``pointers`` is the array of argument addresses cuLaunchKernelEx reads."""
    fmt, offsets, at = "=", [], 0
    for t in types:
        code = _ARG_CODES.get(t)
        if code is None:
            raise TypeError(f"kernel argument of type {t.__name__}: pass numpy.uint64 (pointers), numpy.int32, "
                            "numpy.int64 or numpy.float32")
        size = struct.calcsize(code)
        pad = -at % size
        fmt, at = fmt + "x" * pad + code, at + pad + size
        offsets.append(at - size)
    packer = struct.Struct(fmt)
    buffer = ctypes.create_string_buffer(max(packer.size, 1))
    pointers = (ctypes.c_void_p * max(len(types), 1))(*(ctypes.addressof(buffer) + o for o in offsets))
    return packer, buffer, pointers


def launch_dependent(kernel, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int = 0) -> None:
    """:func:`~dsv2_lib.core.kernels.launch` as a programmatic dependent launch (Hopper and later): the GPU may
    schedule the kernel's blocks while the kernel ahead of it on the stream is still running, so the tail of
    one and the launch of the next overlap. Only for a kernel that begins with ``wait_for_prior_grids()``,
    which holds each block until the kernel ahead has completed; a CUDA graph captures the overlap as a
    programmatic edge."""
    launch_ex, config, attribute, error_name = _driver()
    packer, buffer, pointers = _arg_buffer(tuple(map(type, args)))
    stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
    g, b = (*grid, 1, 1), (*block, 1, 1)
    with _launch_lock:
        packer.pack_into(buffer, 0, *args)
        _LAUNCH_CONFIG.pack_into(config, 0, g[0], g[1], g[2], b[0], b[1], b[2], shared_mem, stream,
                                 ctypes.addressof(attribute), 1)
        err = launch_ex(config, kernel.kernel.ptr, pointers, None)
    if err:
        name = ctypes.c_char_p()
        error_name(err, ctypes.byref(name))
        raise RuntimeError(f"cuLaunchKernelEx failed: {(name.value or b'?').decode()} (CUDA error {err}), grid {grid}, "
                           f"block {block}, {shared_mem} bytes of shared memory")
