"""Token embedding: ``out[t] = weight[ids[t]]``, a gather of rows from the ``[vocab, H]`` table.

Ids are ``int64`` on the kernel side (PyTorch's default integer type, and what ``torch.tensor`` of
a list of token ids gives); ``int32`` ids are converted in the wrapper (one small copy).

An id outside ``[0, vocab)`` is an error. The reference checks on the host before the lookup. The
kernel never reads the table at such an id: it writes a row of zeros and records the first bad
position in a 4-byte buffer kept per device; with ``check=True`` the wrapper reads that buffer
back after the launch — a host synchronisation — and raises the same ``ValueError`` as the
reference. ``check=False`` skips the reset and the read (no synchronisation, so a CUDA graph can
capture the call) and leaves the zero rows; callers that validated their ids already (``LLM``
does, for every prompt) lose nothing. The buffer is shared by the streams of a device, so checked
calls must not run on two streams at once.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from dsv2_lib.core import kernels
from dsv2_lib.core.kernels import CUDA_TYPE

MAX_THREADS = 256  # threads per block (one block per token): 256 × 16 bytes = a 4 KiB bf16 row in one pass
NO_BAD_POSITION = 2**31 - 1  # INT_MAX: the value of the error buffer when every id was valid
EMBEDDING_CU = kernels.declare(
    "embedding.cu", [f"embedding<{t}, {v}>" for t in CUDA_TYPE.values() for v in ("true", "false")]
)
_bad_pos: dict[int, torch.Tensor] = {}  # device index -> int32 [1], first out-of-range position


def _out_of_range(ids: torch.Tensor, pos: int, vocab: int) -> ValueError:
    return ValueError(f"token id {int(ids[pos])} at position {pos} is outside the vocabulary [0, {vocab})")


def _check_ids(flat: torch.Tensor, vocab: int) -> None:
    """Raise for the first id of ``flat [T]`` outside ``[0, vocab)`` (on the host: a sync for GPU ids)."""
    bad = ((flat < 0) | (flat >= vocab)).nonzero()
    if len(bad):
        raise _out_of_range(flat, int(bad[0, 0]), vocab)


def embedding_reference(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of ``weight [V, H]`` for ``ids [...]`` (int32/int64) -> ``[..., H]`` (PyTorch).

    Raises ``ValueError`` naming the first id outside ``[0, V)`` and its position in ``ids.flatten()``.
    """
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"embedding ids: dtype {ids.dtype}, expected torch.int64 or torch.int32")
    _check_ids(ids.reshape(-1), weight.shape[0])
    return F.embedding(ids, weight)


def embedding(ids: torch.Tensor, weight: torch.Tensor, check: bool = True) -> torch.Tensor:
    """Rows of ``weight [V, H]`` for ``ids [...]`` -> ``[..., H]``: the CUDA kernel for CUDA tensors, else the reference.

    ``check=True`` (default) raises ``ValueError`` for an id outside ``[0, V)``, after a host sync;
    ``check=False`` (CUDA-graph capture) does not sync and returns zero rows for such ids.
    """
    if not kernels.use_kernels(weight):
        return embedding_reference(ids, weight)
    if ids.dtype == torch.int32:
        ids = ids.long()
    kernels.check(ids, "embedding ids", dtype=torch.int64, device=weight.device, contiguous=False)
    kernels.check(weight, "embedding weight", shape=(None, None), contiguous=False)
    vocab, hidden = weight.shape
    if weight.stride(1) != 1:
        raise ValueError(f"embedding weight: strides {weight.stride()}; rows must be contiguous (stride 1 along H)")
    if check and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("embedding(check=True) reads an error flag back to the host, which a CUDA graph "
                           "capture cannot do; pass check=False inside the graph")
    flat = ids.reshape(-1).contiguous()
    out = torch.empty(flat.shape[0], hidden, dtype=weight.dtype, device=weight.device)
    if out.numel() == 0:  # no tokens, or rows of width 0: nothing to launch, nothing to check
        if check:
            _check_ids(flat, vocab)  # rows of width 0 still need valid ids
        return out.view(*ids.shape, hidden)
    bad_pos = _error_buffer(weight.device)
    if check:
        bad_pos.fill_(NO_BAD_POSITION)  # a tiny memset on the current stream, ordered before the kernel
    n = 16 // weight.element_size()
    vec = hidden % n == 0 and weight.stride(0) % n == 0 and kernels.aligned16(out, weight)
    chunks = hidden // n if vec else hidden
    threads = min(MAX_THREADS, max(32, -(-chunks // 32) * 32))
    EMBEDDING_CU.launch(f"embedding<{CUDA_TYPE[weight.dtype]}, {str(vec).lower()}>", weight.device, (flat.shape[0],),
                        (threads,), out=kernels.ptr(out), ids=kernels.ptr(flat), weight=kernels.ptr(weight),
                        bad_pos=kernels.ptr(bad_pos), hidden=np.int32(hidden), stride=np.int64(weight.stride(0)),
                        vocab=np.int64(vocab))
    if check:
        pos = int(bad_pos.item())  # waits for the kernel
        if pos != NO_BAD_POSITION:
            raise _out_of_range(flat, pos, vocab)
    return out.view(*ids.shape, hidden)


def _error_buffer(device: torch.device) -> torch.Tensor:
    """The device's 4-byte error buffer, allocated on first use (call once before a graph capture)."""
    index = kernels._device_index(device)
    buf = _bad_pos.get(index)
    if buf is None:
        buf = _bad_pos[index] = torch.full((1,), NO_BAD_POSITION, dtype=torch.int32, device=f"cuda:{index}")
    return buf
