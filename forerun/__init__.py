"""forerun: speculative decoding on PyTorch."""
from .config import CacheConfig, ModelConfig, SpecConfig
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "SpecConfig", "CacheConfig", "ModelConfig"]


def __getattr__(name):  # keep `import forerun` light; LLM pulls in transformers and the model code
    if name == "LLM":
        from .engine.llm import LLM

        return LLM
    raise AttributeError(name)
