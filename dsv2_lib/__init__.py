"""DeepSeek-V2-Lite from scratch: a small, readable inference engine for DeepSeek-V2 models."""
from .config import DEEPSEEK_V2_LITE, TINY, ModelConfig, load_config
from .llm import LLM, RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "ModelConfig", "load_config", "DEEPSEEK_V2_LITE", "TINY"]
