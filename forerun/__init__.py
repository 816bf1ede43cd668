"""forerun: speculative decoding on PyTorch."""
from .config import CacheConfig, ModelConfig, SpecConfig
from .sampling_params import SamplingParams

__all__ = ["LLM", "Engine", "AsyncEngine", "SamplingParams", "SpecConfig", "CacheConfig", "ModelConfig"]


def __getattr__(name):  # keep `import forerun` light; the engines pull in transformers and the model code
    if name == "LLM":
        from .engine.llm import LLM

        return LLM
    if name == "Engine":
        from .engine.engine import Engine

        return Engine
    if name == "AsyncEngine":
        from .engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
