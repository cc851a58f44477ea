"""A second CUDA stream for independent work inside a layer.

At a few tokens every kernel of a layer is too small to fill the GPU, so two independent branches
gain from running side by side: the shared experts beside the router and the routed experts (MoE),
the query projection beside the latent projection and its norm (MLA). ``fork`` runs a block of code
on the device's side stream; the result is used on the current stream after waiting for the event it
yields. A CUDA graph captures this as two parallel branches.

Memory: a tensor allocated inside ``fork`` belongs to the side stream's pool; it is freed later on
the current stream. The side stream reuses that memory only for work queued after its next ``fork``,
which starts by waiting for everything already queued on the current stream, the last reads of the
tensor included. So all work on the side stream must go through ``fork``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_SIDE: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of a GPU (one per device, made on first use)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(index)
    return _SIDE[index]


@contextlib.contextmanager
def fork(device: torch.device, enabled: bool = True) -> Iterator[torch.cuda.Event | None]:
    """Run the body on ``device``'s side stream, after the work queued so far on the current stream.
    Yields an event, recorded when the body's work is done: ``join(event)`` before using its results.
    ``enabled=False``: the body runs on the current stream and the event is None (``join`` then does
    nothing), so a caller writes one code path for both."""
    if not enabled:
        yield None
        return
    current, side = torch.cuda.current_stream(device), side_stream(device)
    side.wait_stream(current)
    done = torch.cuda.Event()
    with torch.cuda.stream(side):
        yield done
    done.record(side)


def join(event: torch.cuda.Event | None, device: torch.device) -> None:
    """Make the current stream wait for ``event`` (from :func:`fork`; None: nothing to wait for)."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)
