"""DeepSeek-V2-Lite from scratch: a small, readable inference engine for DeepSeek-V2 models.

The layers, lowest first (each imports only the ones below it): ``core`` -> ``ops`` -> ``model`` ->
``engine`` -> ``serve`` -> ``lessons`` -> ``tools``. The public names below are loaded on first use, so importing
one low layer (``dsv2_lib.core.config``) does not load the engine.
"""
from __future__ import annotations

import importlib

_PUBLIC = {
    "LLM": "dsv2_lib.engine.llm", "RequestOutput": "dsv2_lib.engine.request_state",
    "SamplingParams": "dsv2_lib.engine.sampling",
    "ModelConfig": "dsv2_lib.core.config", "load_config": "dsv2_lib.core.config",
    "DEEPSEEK_V2_LITE": "dsv2_lib.core.config", "TINY": "dsv2_lib.core.config",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'dsv2_lib' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
