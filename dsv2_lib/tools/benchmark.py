"""Timing on the GPU, and the roofline numbers chapters compare their kernels with.

``time_cuda`` times with CUDA events around many launches (after a warm-up, so compilation and
caches stay out of the number) and reports the median: for short ops that is the cost of a call
from Python. ``time_cuda_graph`` replays the calls from a CUDA graph: the GPU's own time. Bandwidth counts the fewest bytes an op
must move (each input read once, each output written once) over that time. ``rotated`` makes enough
copies of an input for successive calls to read it from memory, not from L2, as a model's weights are.
"""
from __future__ import annotations

import statistics
from typing import Callable

import torch

from dsv2_lib.tools.roofline import H200_BANDWIDTH


def time_cuda(fn: Callable[[], object], warmup: int = 10, iters: int = 50, inner: int = 10) -> float:
    """Median milliseconds of one ``fn()`` call: ``iters`` samples, each timing ``inner`` back-to-back calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / inner)
    return statistics.median(samples)


def time_cuda_graph(fn: Callable[[], object], calls: int = 20) -> float:
    """GPU milliseconds of one ``fn()``: capture ``calls`` back-to-back calls in a CUDA graph and
    time its replays, which takes the CPU's launch cost out of the measurement."""
    fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_cuda(graph.replay, iters=20, inner=5) / calls


ROTATE_BYTES = 256 * 2**20  # five times the H200's 50 MB L2


def rotated(make: Callable[[], torch.Tensor], nbytes: int) -> list[torch.Tensor]:
    """Copies of a tensor of ``nbytes`` (``make()`` builds one), enough to fill ``ROTATE_BYTES``: calls that
    read copy ``i % len(copies)`` in turn find none of them in L2."""
    return [make() for _ in range(max(1, -(-ROTATE_BYTES // nbytes)))]


def bandwidth_fraction(nbytes: int, ms: float, peak: float = H200_BANDWIDTH) -> float:
    """Achieved bytes/s over ``peak`` (default: the 4.2 TB/s copy bandwidth measured on the H200)."""
    return nbytes / (ms * 1e-3) / peak
