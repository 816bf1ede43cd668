"""The default KV pool, sized from the model, the dtype and the memory that is actually free.

A fixed 2 GiB default took 3.4 GB of memory for the 135M model, whose weights are 0.5 GB: far more
KV than one user's generate can touch, on a machine that has other work. `default_cache_config` asks
for what the engine could ever use (max_num_seqs sequences of max_model_len tokens), then caps it:

- CUDA: CUDA_FRACTION of the device memory free now (weights already loaded), as vLLM does with
  gpu_memory_utilization: the GPU belongs to the engine.
- CPU: the smaller of CPU_FRACTION of the available memory (/proc/meminfo MemAvailable, a cgroup
  limit if lower; os.sysconf elsewhere) and the weights' own size (at least CPU_MIN_BYTES): on a
  shared CPU the cache should not dwarf the model.

and never goes below MIN_TOKENS tokens (or what was wanted, if less), so one ordinary request always
fits. Target and draft pools get the same number of blocks (one block table per request serves both;
a draft pool smaller than the target's ran out first). `describe_pool` is the line printed at load.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..config import CacheConfig, ModelConfig

CUDA_FRACTION = 0.80
CPU_FRACTION = 0.10
CPU_MIN_BYTES = 256 << 20
MIN_TOKENS = 4096


def kv_bytes_per_token(model: ModelConfig, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """Keys + values of one token over every layer (the pool's layout, forerun.kvcache.pool.KVPool)."""
    layers = model.num_layers if num_layers is None else num_layers
    return 2 * layers * model.num_kv_heads * model.head_dim * torch.empty((), dtype=dtype).element_size()


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_memory_bytes(device: torch.device | str = "cpu") -> int:
    """Memory free for the KV pool now. CUDA: torch.cuda.mem_get_info's free bytes. CPU: MemAvailable from
    /proc/meminfo, lowered to the cgroup's limit minus its usage when that is tighter (containers);
    os.sysconf(SC_AVPHYS_PAGES) where /proc is absent."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 8 << 30  # unknown platform: assume a small machine
    for limit_f, usage_f in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                             ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_f), _read_int(usage_f)
        if limit is not None and usage is not None and limit < (1 << 60):
            avail = min(avail, max(0, limit - usage))
    return int(avail)


def default_cache_config(
    model: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    max_num_seqs: int = 64,
    max_model_len: int | None = None,
    draft: ModelConfig | None = None,
    draft_dtype: torch.dtype | None = None,
    draft_layers: int | None = None,
    max_draft_tokens: int = 0,
    weight_bytes: int | None = None,
    block_size: int = 16,
    available_bytes: int | None = None,
) -> CacheConfig:
    """A CacheConfig with an explicit num_blocks, for the target and (same count) the draft pool.

    model / dtype: the target's config and KV dtype. draft / draft_dtype / draft_layers: the draft model's
    pool when it has one (draft_layers: only the first layers, e.g. an early-exit drafter on its own pool).
    max_num_seqs, max_model_len (None = the model's context, capped like the model at 2^17): what could
    ever be used. max_draft_tokens: the extra slots a round writes past a sequence. weight_bytes: the
    loaded weights (CPU cap; None = only the memory fraction). available_bytes: override the probe (tests).
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if max_model_len is not None and max_model_len < 1:
        raise ValueError(f"max_model_len must be positive or None, got {max_model_len}")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    device = torch.device(device)
    ctx = min(max_model_len or model.max_position_embeddings, 1 << 17)
    per_seq = ctx + max_draft_tokens + 1
    want_tokens = max_num_seqs * per_seq
    per_token = kv_bytes_per_token(model, dtype)
    if draft is not None:
        per_token += kv_bytes_per_token(draft, draft_dtype or dtype, draft_layers)
    avail = available_memory_bytes(device) if available_bytes is None else int(available_bytes)
    if device.type == "cuda":
        budget = CUDA_FRACTION * avail
    else:
        budget = CPU_FRACTION * avail
        if weight_bytes is not None:
            budget = min(budget, max(weight_bytes, CPU_MIN_BYTES))
    tokens = min(want_tokens, int(budget) // per_token)
    tokens = max(tokens, min(want_tokens, MIN_TOKENS + max_draft_tokens + 1))
    num_blocks = -(-tokens // block_size) + 1  # + the padding block 0
    return CacheConfig(block_size=block_size, memory_budget_bytes=None, num_blocks=num_blocks)


def describe_pool(cache: CacheConfig, model: ModelConfig, dtype: torch.dtype, *, draft: ModelConfig | None = None,
                  draft_dtype: torch.dtype | None = None, draft_layers: int | None = None,
                  device: torch.device | str = "cpu") -> str:
    """One line for the load message: 'KV pool: 2,049 blocks x 16 = 32,768 tokens, 1.41 GiB (of 15.2 GiB free)'."""
    if cache.num_blocks is None:
        per_block = kv_bytes_per_token(model, dtype) * cache.block_size
        num_blocks = max(2, cache.memory_budget_bytes // per_block)
    else:
        num_blocks = cache.num_blocks
    tokens = (num_blocks - 1) * cache.block_size
    total = kv_bytes_per_token(model, dtype) * num_blocks * cache.block_size
    parts = ""
    if draft is not None:
        d = kv_bytes_per_token(draft, draft_dtype or dtype, draft_layers) * num_blocks * cache.block_size
        parts = f" (target {total / 2**30:.2f} + draft {d / 2**30:.2f})"
        total += d
    free = available_memory_bytes(device)
    return (f"KV pool: {num_blocks:,} blocks x {cache.block_size} = {tokens:,} tokens, "
            f"{total / 2**30:.2f} GiB{parts}; {free / 2**30:.1f} GiB free")
