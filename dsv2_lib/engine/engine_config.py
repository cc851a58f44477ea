"""How an :class:`~dsv2_lib.engine.llm.LLM` runs and serves: every argument of ``LLM(...)`` but the model,
resolved and checked once, here, before any weight is loaded."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from dsv2_lib.core.config import ModelConfig
from dsv2_lib.engine.scheduler import ADMISSIONS, MODES, Scheduler
from dsv2_lib.model.tuning import Tuning


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # True is an int to Python, not a size to us


@dataclass(frozen=True)
class EngineConfig:
    """The serving arguments of :class:`~dsv2_lib.engine.llm.LLM` (which says what each one does).

    Construction resolves ``device`` (``None``: CUDA when available) to a ``torch.device`` and ``dtype``
    (``None``: bfloat16 on CUDA, float32 on the CPU; or a name such as ``"bfloat16"``) to a
    ``torch.dtype``, and refuses any argument that cannot serve with a ``ValueError`` naming it.
    ``max_model_len=None`` means the model's own context: :meth:`for_model` fills it in.
    """

    device: torch.device | str | None = None
    dtype: torch.dtype | str | None = None
    max_model_len: int | None = None
    kv_cache_mib: float | None = None
    block_size: int = 16
    scheduling: str = "continuous"
    admission: str = "reserve"
    prefix_caching: bool = True
    max_num_batched_tokens: int | None = 8192
    gpu_memory_utilization: float | None = None
    cuda_graphs: bool = True
    async_scheduling: bool = True
    tuning: Tuning = field(default_factory=Tuning)  # where the model's ops switch kernel paths
    trace: str | Path | None = None  # a JSON-lines file of scheduler steps

    def __post_init__(self):
        if self.device is not None and not isinstance(self.device, (str, torch.device)):
            raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or None, got {self.device!r}")
        try:
            device = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        except RuntimeError:
            raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or None, got {self.device!r}") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        dtype = self.dtype if self.dtype is not None else torch.bfloat16 if device.type == "cuda" else torch.float32
        dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        object.__setattr__(self, "device", device)  # frozen: the resolved values replace the arguments
        object.__setattr__(self, "dtype", dtype)
        n = self.max_model_len
        if n is not None and (not _is_int(n) or n < 2):
            raise ValueError(f"max_model_len must be an int >= 2 (a prompt token and a generated one), got {n!r}")
        if self.scheduling not in MODES or self.admission not in ADMISSIONS:
            raise ValueError(f"scheduling must be one of {MODES} and admission one of {ADMISSIONS}; "
                             f"got {self.scheduling!r} and {self.admission!r}")
        if not _is_int(self.block_size) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        for name in ("prefix_caching", "cuda_graphs", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        mib = self.kv_cache_mib
        if mib is not None and (isinstance(mib, bool) or not isinstance(mib, (int, float))
                                or not math.isfinite(mib) or mib <= 0):
            raise ValueError(f"kv_cache_mib must be a finite number of MiB > 0 (or None), got {mib!r}")
        if not isinstance(self.tuning, Tuning):
            raise ValueError(f"tuning must be a Tuning (dsv2_lib.model.tuning), got {type(self.tuning).__name__}")
        if self.trace is not None:
            if not isinstance(self.trace, (str, Path)) or not Path(self.trace).parent.is_dir() or Path(self.trace).is_dir():
                raise ValueError(f"trace must be a file path in an existing directory (or None), got {self.trace!r}")
        Scheduler.check_budget(self.max_num_batched_tokens)
        if self.gpu_memory_utilization is not None:
            self._check_memory_utilization()
        if device.type == "cuda" and not torch.cuda.is_available():  # last: the other arguments' errors first
            raise ValueError(f"device {self.device!r}: PyTorch sees no CUDA GPU here (a CPU build of torch, or no driver)")

    def _check_memory_utilization(self) -> None:
        """Refuse a ``gpu_memory_utilization`` that is not a fraction in (0, 1], or that comes with
        ``kv_cache_mib`` (two sizes for one cache), a device other than CUDA (no GPU memory to measure) or
        no per-step token budget (the activation reserve needs a bound on the tokens of a step)."""
        u = self.gpu_memory_utilization
        if not isinstance(u, (int, float)) or isinstance(u, bool) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {u!r}")
        if self.kv_cache_mib is not None:
            raise ValueError(f"give kv_cache_mib ({self.kv_cache_mib}) or gpu_memory_utilization ({u}), not both: "
                             "each sizes the KV cache")
        if self.device.type != "cuda":
            raise ValueError(f"gpu_memory_utilization sizes the KV cache from a GPU's memory, but the device is "
                             f"{self.device.type}; use kv_cache_mib there")
        if self.max_num_batched_tokens is None:
            raise ValueError("gpu_memory_utilization needs max_num_batched_tokens: the memory kept for activations "
                             "follows from the most tokens one step may hold")

    def for_model(self, cfg: ModelConfig) -> EngineConfig:
        """This configuration with ``max_model_len`` known: the one given, else the model's
        ``max_position_embeddings``."""
        if self.max_model_len is not None and self.max_model_len > cfg.max_position_embeddings:
            warnings.warn(f"max_model_len={self.max_model_len} is longer than the model's trained context "
                          f"(max_position_embeddings={cfg.max_position_embeddings}): positions past it were never "
                          "trained, and quality usually falls apart there", stacklevel=3)
        return replace(self, max_model_len=self.max_model_len or cfg.max_position_embeddings)
