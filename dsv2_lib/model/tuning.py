"""Where the model's ops switch kernel paths: one frozen record per op, gathered in :class:`Tuning`,
which ``LLM(tuning=...)`` takes (through :class:`~dsv2_lib.engine.engine_config.EngineConfig`). The
defaults are the H200's; the benchmark that sets each one is named in its record's docstring."""
from __future__ import annotations

from dataclasses import dataclass, field

from dsv2_lib.ops.attention import AttentionTuning
from dsv2_lib.ops.gemv import GEMV_MAX_TOKENS, SKINNY_MAX_TOKENS
from dsv2_lib.ops.mla_decode import DecodeTuning
from dsv2_lib.ops.moe_experts import MoETuning


@dataclass(frozen=True)
class Tuning:
    """``moe``: the MoE layers' expert paths; ``attention``: prefill attention, our kernel or SDPA and
    which variant; ``decode``: the paged latent decode kernel's schedule; ``gemv_max_tokens``: the most
    tokens a dense projection runs as a GEMV (``benchmarks/bench_gemv.py``), ``skinny_max_tokens`` the most
    it runs as the skinny GEMM beyond those (the same benchmark) before cuBLAS takes it;
    ``q_stream_max_tokens``: the most tokens for which MLA's query projection runs on a side stream
    beside the latent projection (:mod:`~dsv2_lib.core.streams`; chapter 14 measures it)."""

    moe: MoETuning = field(default_factory=MoETuning)
    attention: AttentionTuning = field(default_factory=AttentionTuning)
    decode: DecodeTuning = field(default_factory=DecodeTuning)
    gemv_max_tokens: int = GEMV_MAX_TOKENS
    skinny_max_tokens: int = SKINNY_MAX_TOKENS
    q_stream_max_tokens: int = 16

    def __post_init__(self):
        for name, kind in (("moe", MoETuning), ("attention", AttentionTuning), ("decode", DecodeTuning)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"Tuning.{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__}")
        for name in ("gemv_max_tokens", "skinny_max_tokens", "q_stream_max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"Tuning.{name} must be an int >= 0 (0: never), got {v!r}")
