"""ModelRunner: turns a list of per-sequence chunks into one flattened forward over the paged KV cache.

Every model call in forerun goes through `ModelRunner.forward`: prefill, plain decode, draft steps and
verification (chains or trees) are all chunks of a ragged batch, so batch 1 is a batch of one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.metadata import AttnMetadata
from ..devices import h2d
from ..config import CacheConfig
from ..kvcache.pool import KVPool
from ..models.llama import ForwardOutput, LlamaForCausalLM
from ..models.ops import LayerOps


@dataclass(frozen=True)
class Chunk:
    """New tokens for one sequence. They go to logical cache positions length .. length+n-1.

    positions: RoPE positions (default: the cache positions); a tree gives prefix + depth.
    tree_mask: [n, n] bool, row i sees new token j iff tree_mask[i, j] (ancestors and itself).
    logits: which of the n rows need logits: "last", "all", "none", or an int m for the last m rows."""

    seq_id: int
    token_ids: list[int]
    positions: list[int] | None = None
    tree_mask: torch.Tensor | None = None
    logits: str | int = "last"

    def logit_count(self) -> int:
        n = len(self.token_ids)
        m = {"last": 1, "all": n, "none": 0}.get(self.logits, self.logits)
        if not isinstance(m, int) or not 0 <= m <= n:
            raise ValueError(f"sequence {self.seq_id}: bad logits selector {self.logits!r}")
        return m


@dataclass(frozen=True)
class PreparedStep:
    """A batch laid into the static buffers: what the model call needs, plus bookkeeping for commit."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttnMetadata
    logits_indices: torch.Tensor  # [R]
    seq_ids: list[int]
    new_lens: list[int]  # per sequence, cache length after this step
    starts: list[int]  # per chunk, index of its first logits row


class StepBuffers:
    """Preallocated input tensors (static addresses, so a captured CUDA graph can replay over them)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device) -> None:
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_tokens, **i64)
        self.positions = torch.zeros(max_tokens, **i64)
        self.slot_mapping = torch.zeros(max_tokens, **i64)
        self.query_start_loc = torch.zeros(max_seqs + 1, **i64)
        self.seq_lens = torch.zeros(max_seqs, **i64)
        self.block_tables = torch.zeros(max_seqs, max_blocks, **i64)
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: CacheConfig, device: torch.device | str,
                 dtype: torch.dtype, max_batch_tokens: int = 8192, max_seqs: int = 256) -> None:
        self.model, self.device, self.dtype = model, torch.device(device), dtype
        self.kv = KVPool(model.config, cache, dtype, self.device)
        max_blocks = -(-model.max_positions // cache.block_size) + 1
        self.buffers = StepBuffers(max_batch_tokens, max_seqs, max_blocks, self.device)
        self.graphs = None  # a cuda_graph.GraphRunner over this runner, when CUDA graphs are on
        if self.device.type == "cpu" and dtype == torch.float32 and type(getattr(model, "ops", None)) is LayerOps:
            from ..kernels.cpu_layer import available
            from ..models.cpu_ops import CpuLayerOps

            if available():  # norms, RoPE and the cache write in C (kernels/cpu_layer.c); attention too
                model.ops = CpuLayerOps()

    @property
    def config(self):
        return self.model.config

    def prepare(self, chunks: list[Chunk]) -> PreparedStep:
        """Reserve cache slots for every chunk and lay the flattened batch into the static buffers."""
        kv, bs = self.kv, self.kv.block_size
        ids, pos, slots, qsl, lens, logit_rows, starts, masks = [], [], [], [0], [], [], [], []
        tables = []
        for c in chunks:
            n = len(c.token_ids)
            if n == 0:
                raise ValueError(f"sequence {c.seq_id}: empty chunk")
            base = kv.length(c.seq_id)
            if base + n > self.model.max_positions:
                raise ValueError(f"sequence {c.seq_id}: {base + n} tokens exceed the context of {self.model.max_positions}")
            kv.reserve(c.seq_id, base + n)
            blocks = kv.blocks(c.seq_id)
            ids.extend(c.token_ids)
            pos.extend(c.positions if c.positions is not None else range(base, base + n))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(base, base + n))
            row0 = qsl[-1]
            starts.append(len(logit_rows))
            logit_rows.extend(range(row0 + n - c.logit_count(), row0 + n))
            qsl.append(row0 + n)
            lens.append(base + n)
            masks.append(c.tree_mask)
            tables.append(blocks)
        t, b = qsl[-1], len(chunks)
        if t > self.buffers.max_tokens or b > self.buffers.max_seqs:
            raise ValueError(f"batch of {t} tokens / {b} sequences exceeds the runner's buffers")
        buf = self.buffers
        width = max(map(len, tables))
        table = [x for blocks in tables for x in blocks + [0] * (width - len(blocks))]
        # one host -> device transfer for the whole step, then device-side copies into the static buffers
        host = torch.tensor(ids + pos + slots + qsl + lens + logit_rows + table, dtype=torch.int64)
        dev = host.to(self.device, non_blocking=True) if self.device.type == "cuda" else host
        parts = dev.split([t, t, t, b + 1, b, len(logit_rows), b * width])
        buf.input_ids[:t].copy_(parts[0])
        buf.positions[:t].copy_(parts[1])
        buf.slot_mapping[:t].copy_(parts[2])
        buf.query_start_loc[: b + 1].copy_(parts[3])
        buf.seq_lens[:b].copy_(parts[4])
        rows = parts[5]
        buf.block_tables[:b, :width].copy_(parts[6].view(b, width))
        max_q = max(qsl[i + 1] - qsl[i] for i in range(b))
        tree = None
        if any(m is not None for m in masks):
            tree = torch.zeros(t, max_q, dtype=torch.bool)
            for c, m, r0 in zip(chunks, masks, qsl):
                n = len(c.token_ids)
                tree[r0 : r0 + n, :n] = m if m is not None else torch.ones(n, n, dtype=torch.bool).tril()
            tree = tree.to(self.device)
        meta = AttnMetadata(
            query_start_loc=buf.query_start_loc[: b + 1], seq_lens=buf.seq_lens[:b],
            block_tables=buf.block_tables[:b, :width], slot_mapping=buf.slot_mapping[:t],
            max_query_len=max_q, max_seq_len=max(lens), tree_mask=tree,
        )
        return PreparedStep(buf.input_ids[:t], buf.positions[:t], meta, rows, [c.seq_id for c in chunks], lens, starts)

    def load_block_tables(self, seq_ids: list[int]) -> None:
        """Rows 0..B-1 of the static block tables = these sequences' blocks (padded with block 0), queued without
        waiting for the device: the layout `GraphRunner.run_uniform` reads."""
        table = self.kv.block_table(seq_ids)
        bt = self.buffers.block_tables
        bt[: len(seq_ids)].zero_()
        bt[: len(seq_ids), : table.shape[1]].copy_(h2d(table, self.device))

    def execute(self, step: PreparedStep, num_layers: int | None = None, hidden_layers=()) -> ForwardOutput:
        """Run the model over a prepared step and commit its tokens to the cache."""
        with torch.inference_mode():
            out = self.model(step.input_ids, step.positions, step.meta, self.kv, logits_indices=step.logits_indices,
                             num_layers=num_layers, hidden_layers=hidden_layers)
        for seq_id, n_len in zip(step.seq_ids, step.new_lens):
            self.kv.set_length(seq_id, n_len)
        return out

    def forward(self, chunks: list[Chunk], num_layers: int | None = None, hidden_layers=(),
                device_tokens: tuple[torch.Tensor | None, torch.Tensor] | None = None) -> tuple[ForwardOutput, list[int]]:
        """Run all chunks in one forward; commit their tokens to the cache (the caller truncates rejects).

        device_tokens: (rows [N] or None, ids [N]), int64 on the device: token ids still on the device (drafts)
        that replace the chunks' placeholder ids at these flat rows (None: all rows, N = the step's tokens).
        So a draft step or a verify step is launched without a host round trip for its tokens.
        Returns the output (logits rows in chunk order) and, per chunk, the index of its first logits row."""
        if self.graphs is not None and device_tokens is None:  # a ragged step as a few graph replays
            done = self.graphs.forward_pieces(chunks, num_layers, hidden_layers)
            if done is not None:
                return done
        step = self.prepare(chunks)
        if device_tokens is not None:
            rows, ids = device_tokens
            if rows is None:
                step.input_ids.copy_(ids)
            else:
                step.input_ids.index_copy_(0, rows, ids)
        executor = self.graphs if self.graphs is not None else self  # graph replay falls back to execute
        return executor.execute(step, num_layers, hidden_layers), step.starts
