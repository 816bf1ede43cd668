"""Triton kernels (CUDA). Importing this package needs the `triton` package."""
from .chain_sample import ChainSampleOutput, chain_sample

__all__ = ["ChainSampleOutput", "chain_sample"]
