"""The attention extension point: a backend computes attention for one layer over the paged KV cache."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .metadata import AttnMetadata
from .reference import paged_attention_reference


def kv_splits(programs: int, device: torch.device, max_splits: int) -> int:
    """How many parts to split each sequence's KV range into (flash-decoding) when `programs` blocks would run
    otherwise: enough for two blocks per SM (16 SMs assumed off CUDA), at most max_splits."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16
    return max(1, min(max_splits, -(-2 * sms // programs)))


class AttentionBackend(ABC):
    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttnMetadata,
        scale: float,
        window: int | None = None,  # sliding window (ModelConfig.sliding_window); None: full attention
    ) -> torch.Tensor:  # [T, Hq, D]
        ...


class ReferenceBackend(AttentionBackend):
    """Gather pages into a padded batch and call SDPA: works everywhere, the oracle for faster backends."""

    def forward(self, q, k_cache, v_cache, meta, scale, window=None):
        return paged_attention_reference(q, k_cache, v_cache, meta, scale, window)
