"""GraphRunner: replay decode / verify steps of a ModelRunner from CUDA graphs captured per bucket.

A bucket is (number of sequences padded up to one of `batch_sizes`, query tokens per sequence q = 1..max_q_len,
logits rows per sequence, tree mask or not, early-exit depth, hidden layers). The graph is captured over the
runner's static StepBuffers, so a step only has to be laid into those buffers before `replay()`. Sequences
missing from a bucket are padded with dummies: q tokens each, in KV block 0 (the pool never hands block 0 out),
at positions 0..q-1, so they write and read only that block.

A ragged step (prefill chunks beside decode rows, several prompts, a drafter's catch-up) does not fit one bucket.
`forward_pieces` replays it as a few graphs instead of one eager forward (which costs ~20-60 ms of kernel launches
for an 8B model, against ~5 ms of GPU work): short chunks of equal length go to one (batch, q) bucket, a long
chunk is cut into pieces of PIECE_SIZES tokens (1, 2, 4, ..., 512), the last piece overlapping the one before it
so that its length is a bucket size too (the overlapped positions are written twice with the same tokens: the
cache ends as a single forward would leave it, up to float rounding). Long pieces of several sequences share a
replay up to `piece_batch_tokens` tokens (several prompts arriving together, a drafter catching up on them).
Steps that would need more than `max_pieces` replays, trees, or chunks wanting logits for several rows of a long
chunk run eagerly.

Ways in:
  * `execute(step)` / `forward(chunks)`: the ModelRunner's host-side `prepare`, then replay (engine path).
  * `run_uniform(input_ids [B, q], context_lens [B])`: positions, slots and lengths are computed on the device
    inside the graph from the block tables already in the buffers (no host work, no sync: decode loops).
  * `run_uniform_join(...)`: the same uniform rows plus one prompt read in the same forward (a request joining
    an overlapped speculative session: its prompt rides along with the members' verify rows, one weight stream
    for both, instead of a forward of its own between two rounds).
  * `replay_tree(tokens, context_lens, depth, mask)`: a tree verify step laid out from device tensors (EAGLE
    rounds queue the next round's verify from the device verdict: TreeRound._queue_verify), replaying the bucket
    `execute` would.

Outputs of a replay live in the graph's static memory and are overwritten by the next replay of that bucket.
The model's attention backend must declare `supports_cuda_graphs` (TritonPagedAttention does).
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ..attention.metadata import AttnMetadata
from ..devices import h2d, kernels_on
from ..models.layers import RMSNorm, RotaryEmbedding, SwiGLU
from ..models.llama import ForwardOutput
from .runner import Chunk, ModelRunner, PreparedStep


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool) -> Iterator[None]:
    """`torch.cuda.graph(graph, pool)` with Python's garbage collector held off while the stream captures. A
    collection there can free another CUDA graph (one of an engine dropped earlier, kept in a reference cycle),
    whose reset is not permitted during a capture: the capture fails ("operation not permitted when stream is
    capturing"), as GPU tests did when run after other tests' engines (torch.cuda.graph collects once before it
    starts capturing, not during)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class GraphKey:
    num_seqs: int  # bucket size (padded)
    q_len: int  # query tokens per sequence
    logits_per_seq: int  # logits rows per sequence (the last ones)
    tree: bool  # a tree mask among the new tokens
    num_layers: int | None = None  # early exit
    hidden_layers: tuple[int, ...] = ()
    device_prep: bool = False  # positions / slots computed in the graph (run_uniform)
    join_len: int = 0  # run_uniform_join: rows of one joining prompt after the uniform ones (a piece size), else 0


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None: graphs disabled, `body` runs eagerly
    body: Callable[[], ForwardOutput]
    out: ForwardOutput  # static outputs of the last replay
    logits_indices: torch.Tensor  # [B * m], kept alive for the graph


def compile_elementwise(model: torch.nn.Module) -> None:
    """torch.compile the model's RMSNorm, rotary and SwiGLU modules so inductor fuses their elementwise chains
    (8 kernels per RMSNorm, ~14 per rotary call, 2 per SwiGLU activation otherwise). The matmuls stay cuBLAS.
    Shapes are dynamic after the first recompile; dynamo's recompile limit is raised to hold the variants."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), 64))
    for mod in model.modules():
        if isinstance(mod, (RMSNorm, RotaryEmbedding, SwiGLU)):
            mod.compile()


PIECE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # prefill pieces (tokens per sequence and replay)
# long pieces of several sequences replay together up to this many tokens, in at most PIECE_BATCH sequences. One
# sequence per replay read the weights once per prompt: on the H200 (8B shape) four 128-token prompts took four
# ~5.5 ms replays where one forward over all four is compute-bound at about half that; the draft's catch-up on
# them likewise (issue 9: prefill rounds and catch-ups were 1/4 of a speculative run at 16 requests)
PIECE_BATCH_TOKENS = 1024
# the prompt rows of run_uniform_join graphs: a joining prompt is padded to the first that holds it (at most 2x its
# rows past 64; each size is one graph per batch bucket and verify length, and each graph keeps its own logits)
JOIN_SIZES = (64, 128, 256, 512)
PIECE_BATCH = 8


def split_pieces(n: int, sizes: tuple[int, ...] = PIECE_SIZES) -> list[tuple[int, int]]:
    """Cut n tokens into (start, length) pieces whose lengths are all in `sizes`, in order, covering 0..n-1:
    full pieces of the largest size, then the fewest more; the last piece may start before the previous one
    ends (it overlaps already-fed tokens) so that its length is a size too. E.g. 130 -> (0,128),(128,2);
    200 -> (0,128),(72,128); 20 -> (0,16),(16,4)."""
    if n <= 0:
        return []
    top = max(sizes)
    out, at = [], 0
    while n - at >= top:
        out.append((at, top))
        at += top
    while at < n:
        rest = n - at
        up = min(s for s in sizes if s >= rest)
        if up <= n:  # one piece ending at n, overlapping what is already fed
            out.append((n - up, up))
            break
        down = max(s for s in sizes if s <= rest)
        out.append((at, down))
        at += down
    return out


class GraphRunner:
    def __init__(self, runner: ModelRunner, batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
                 max_q_len: int = 16, capture_on_demand: bool = True, use_graphs: bool = True,
                 max_pieces: int = 8, piece_batch_tokens: int = PIECE_BATCH_TOKENS) -> None:
        buf = runner.buffers
        self.runner = runner
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.max_q_len = max_q_len
        self.capture_on_demand = capture_on_demand
        self.use_graphs = use_graphs and runner.device.type == "cuda"
        if self.use_graphs and not getattr(runner.model.backend, "supports_cuda_graphs", False):
            raise ValueError(f"{type(runner.model.backend).__name__} cannot be captured in CUDA graphs "
                             "(its launch shapes depend on host-side lengths); use TritonPagedAttention")
        max_seqs = self.batch_sizes[-1]
        if max_seqs > buf.max_seqs or max_seqs * max_q_len > buf.max_tokens:
            raise ValueError(f"the runner's buffers ({buf.max_seqs} seqs, {buf.max_tokens} tokens) are smaller "
                             f"than the largest bucket ({max_seqs} x {max_q_len})")
        dev = runner.device
        self.block_size = runner.kv.block_size
        # single-sequence pieces longer than a verify step (prefill); <= max_q_len pieces are ordinary buckets
        self.piece_sizes = tuple(s for s in PIECE_SIZES if s <= buf.max_tokens)
        self.max_pieces = max_pieces  # a ragged step needing more replays than this runs eagerly
        self.piece_batch_tokens = min(piece_batch_tokens, buf.max_tokens)
        self.pieces_steps = 0  # ragged steps replayed as pieces
        rows = max(max_seqs * max_q_len, max(self.piece_sizes), self.piece_batch_tokens)
        self._ar = torch.arange(rows + 1, dtype=torch.int64, device=dev)
        self._tree = torch.zeros(rows, max_q_len, dtype=torch.bool, device=dev)
        self._uids = torch.zeros(max_seqs * max_q_len, dtype=torch.int64, device=dev)  # run_uniform inputs
        self._uctx = torch.zeros(max_seqs, dtype=torch.int64, device=dev)
        # run_uniform_join inputs: the joining prompt's tokens, [cached length, tokens], its last row
        self._jids = torch.zeros(max(self.piece_sizes), dtype=torch.int64, device=dev)
        self._jmeta = torch.zeros(2, dtype=torch.int64, device=dev)
        self._jrow = torch.zeros(1, dtype=torch.int64, device=dev)
        self.join_replays = 0
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.graphs: dict[GraphKey, _Captured] = {}
        self.replays = 0
        self.eager_steps = 0

    # -- buckets ---------------------------------------------------------------------------------------
    def bucket(self, num_seqs: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= num_seqs), None)

    def key_for(self, step: PreparedStep, num_layers: int | None = None, hidden_layers=()) -> GraphKey | None:
        """The bucket a host-prepared step fits, or None (ragged query lengths or logits, too big)."""
        b, t, q = len(step.seq_ids), step.meta.num_tokens, step.meta.max_query_len
        bucket = self.bucket(b)
        if bucket is None or not self._fits(bucket, q) or t != b * q:
            return None
        r = step.logits_indices.shape[0]
        m = r // b
        if r != b * m or step.starts != [i * m for i in range(b)]:
            return None
        return GraphKey(bucket, q, m, step.meta.tree_mask is not None, num_layers, tuple(hidden_layers))

    def _fits(self, bucket: int, q: int) -> bool:
        """q tokens per sequence: a decode / verify length, or a prefill piece (of one sequence, or of several up
        to piece_batch_tokens in all)."""
        return q <= self.max_q_len or (q in self.piece_sizes and bucket <= self.piece_batch(q))

    def piece_batch(self, q: int) -> int:
        """Sequences whose q-token pieces (q > max_q_len) share one replay: the largest bucket within
        piece_batch_tokens tokens and PIECE_BATCH sequences (at least 1)."""
        fit = [b for b in self.batch_sizes if b * q <= self.piece_batch_tokens and b <= PIECE_BATCH]
        return max(fit, default=1)

    # -- capture ---------------------------------------------------------------------------------------
    def capture(self, num_seqs: int, q_len: int, logits_per_seq: int = 1, tree: bool = False,
                num_layers: int | None = None, hidden_layers: tuple[int, ...] = (), device_prep: bool = False,
                join_len: int = 0) -> GraphKey:
        bucket = self.bucket(num_seqs)
        if bucket is None or q_len < 1 or not self._fits(bucket, q_len) or not 0 <= logits_per_seq <= q_len:
            raise ValueError(f"no bucket for {num_seqs} sequences x {q_len} tokens ({logits_per_seq} logits each)")
        if join_len and (not device_prep or tree or join_len != self.join_len(num_seqs, join_len)):
            raise ValueError(f"no join graph of {join_len} prompt rows beside {num_seqs} sequences x {q_len} tokens")
        key = GraphKey(bucket, q_len, logits_per_seq, tree, num_layers, tuple(hidden_layers), device_prep, join_len)
        self._get(key, create=True)
        return key

    def _get(self, key: GraphKey, create: bool) -> _Captured | None:
        cap = self.graphs.get(key)
        if cap is None and (create or self.capture_on_demand):
            cap = self.graphs[key] = self._capture(key)
        return cap

    def _capture(self, key: GraphKey) -> _Captured:
        b, q, m, j = key.num_seqs, key.q_len, key.logits_per_seq, key.join_len
        seqs = b + 2 if j else b  # (a join: the joining prompt is sequence b, the padding after it sequence b + 1)
        t = b * q + j
        buf = self.runner.buffers
        model, kv = self.runner.model, self.runner.kv
        meta = AttnMetadata(
            query_start_loc=buf.query_start_loc[: seqs + 1], seq_lens=buf.seq_lens[:seqs],
            block_tables=buf.block_tables[:seqs], slot_mapping=buf.slot_mapping[:t], max_query_len=max(q, j),
            max_seq_len=buf.max_blocks * self.block_size, tree_mask=self._tree[:t, :q] if key.tree else None,
        )
        rows = (self._ar[:b, None] * q + (q - m) + self._ar[None, :m]).reshape(-1)  # [b * m]
        prep = self._device_prep(b, q) if key.device_prep else None
        jprep = self._join_prep(b, q, j) if j else None

        def body() -> ForwardOutput:
            if prep is not None:
                prep()
            idx = rows
            if jprep is not None:
                jprep()
                idx = torch.cat([rows, self._jrow])  # + the joining prompt's last row
            return model(buf.input_ids[:t], buf.positions[:t], meta, kv, logits_indices=idx,
                         num_layers=key.num_layers, hidden_layers=key.hidden_layers)

        # Warm-up and capture run on an all-dummy batch (block 0 only); the inputs of a step that is waiting
        # for this capture are saved and put back afterwards.
        inputs = [buf.input_ids[:t], buf.positions[:t], buf.slot_mapping[:t], buf.query_start_loc[: seqs + 1],
                  buf.seq_lens[:seqs], buf.block_tables[:seqs], self._tree[:t], self._uids[: b * q], self._uctx[:b],
                  self._jids, self._jmeta]
        saved = [x.clone() for x in inputs]
        with torch.inference_mode():
            self._fill_padding(0, 0, b, q)
            self._uctx[:b].zero_()
            self._uids[: b * q].zero_()
            if j:  # a dummy joiner: j tokens at positions 0.. of block 0
                buf.block_tables[b: b + 2].zero_()
                self._jids.zero_()
                self._jmeta.copy_(torch.tensor([0, j]))
            if not self.use_graphs:
                cap = _Captured(None, body, body(), rows)
            else:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):  # compiles Triton / inductor kernels, sets up cuBLAS
                        body()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with capturing(graph, self._pool):
                    out = body()
                cap = _Captured(graph, body, out, rows)
            for x, y in zip(inputs, saved):
                x.copy_(y)
        return cap

    def _device_prep(self, b: int, q: int) -> Callable[[], None]:
        """Buffers from (_uids, _uctx, block tables) on the device: the run_uniform part of the graph."""
        buf, bs = self.runner.buffers, self.block_size
        t = b * q

        def prep() -> None:
            pos = self._uctx[:b, None] + self._ar[None, :q]  # [b, q]
            buf.input_ids[:t].copy_(self._uids[:t])
            buf.positions[:t].copy_(pos.reshape(-1))
            pages = torch.gather(buf.block_tables[:b], 1, pos // bs)
            buf.slot_mapping[:t].copy_((pages * bs + pos % bs).reshape(-1))
            buf.seq_lens[:b].copy_(self._uctx[:b] + q)
            buf.query_start_loc[: b + 1].copy_(self._ar[: b + 1] * q)

        return prep

    def _join_prep(self, b: int, q: int, j: int) -> Callable[[], None]:
        """The joining prompt's part of a join graph, after `_device_prep`'s uniform rows: its n = _jmeta[1] tokens
        (_jids) at positions _jmeta[0].. of sequence b (block-table row b), then j - n padding rows as sequence
        b + 1 in block 0 (as `_fill_padding`'s dummies). Its logits row: the prompt's last (_jrow)."""
        buf, bs = self.runner.buffers, self.block_size
        t0 = b * q

        def prep() -> None:
            ctx, n = self._jmeta[0], self._jmeta[1]
            ar = self._ar[:j]
            real = ar < n
            pos = torch.where(real, ctx + ar, ar - n)  # [j]: the prompt's positions, then the padding's 0..
            page = torch.gather(buf.block_tables[b], 0, torch.where(real, pos // bs, 0))
            buf.input_ids[t0: t0 + j].copy_(self._jids[:j])
            buf.positions[t0: t0 + j].copy_(pos)
            buf.slot_mapping[t0: t0 + j].copy_(torch.where(real, page * bs + pos % bs, pos % bs))
            buf.seq_lens[b].copy_(ctx + n)
            buf.seq_lens[b + 1].copy_(j - n)
            buf.query_start_loc[b + 1].copy_(t0 + n)
            buf.query_start_loc[b + 2].fill_(t0 + j)
            self._jrow.copy_((t0 + n - 1).view(1))

        return prep

    def _fill_padding(self, b: int, t: int, bucket: int, q: int) -> None:
        """Dummy sequences b..bucket-1 (q tokens each, in block 0) after b real ones holding t tokens."""
        if b == bucket:
            return
        buf, n = self.runner.buffers, (bucket - b) * q
        local = self._ar[:n] % q
        buf.input_ids[t : t + n].zero_()
        buf.positions[t : t + n].copy_(local)
        buf.slot_mapping[t : t + n].copy_(local % self.block_size)
        buf.query_start_loc[b + 1 : bucket + 1].copy_(t + q * self._ar[1 : bucket - b + 1])
        buf.seq_lens[b:bucket].fill_(q)
        buf.block_tables[b:bucket].zero_()
        if q <= self.max_q_len:  # (tree buckets; prefill pieces have no tree)
            self._tree[t : t + n, :q].copy_(self._ar[None, :q] <= local[:, None])

    # -- replay ----------------------------------------------------------------------------------------
    def _replay(self, cap: _Captured) -> ForwardOutput:
        self.replays += 1
        if cap.graph is None:
            with torch.inference_mode():
                return cap.body()
        cap.graph.replay()
        return cap.out

    def execute(self, step: PreparedStep, num_layers: int | None = None, hidden_layers=()) -> ForwardOutput:
        """Like ModelRunner.execute: replay the step's bucket if it has one, else run eagerly; commit lengths."""
        key = self.key_for(step, num_layers, hidden_layers)
        cap = self._get(key, create=False) if key is not None else None
        if cap is None:
            self.eager_steps += 1
            return self.runner.execute(step, num_layers, hidden_layers)
        b, t = len(step.seq_ids), step.meta.num_tokens
        self._fill_padding(b, t, key.num_seqs, key.q_len)
        if key.tree:
            self._tree[:t, : key.q_len].copy_(step.meta.tree_mask[:, : key.q_len])
        out = self._replay(cap)
        for seq_id, n_len in zip(step.seq_ids, step.new_lens):
            self.runner.kv.set_length(seq_id, n_len)
        logits = out.logits[: b * key.logits_per_seq]
        return ForwardOutput(logits, {i: h[:t] for i, h in out.hidden_states.items()})

    def forward(self, chunks: list[Chunk], num_layers: int | None = None, hidden_layers=()) -> tuple[ForwardOutput, list[int]]:
        """Drop-in for ModelRunner.forward."""
        step = self.runner.prepare(chunks)
        return self.execute(step, num_layers, hidden_layers), step.starts

    # -- ragged steps as a few replays ------------------------------------------------------------------
    def plan_pieces(self, chunks: list[Chunk]) -> list[tuple[list[int], int, int, list[tuple[int, int]]]] | None:
        """How `forward_pieces` would replay these chunks: a list of (chunk indices, q, logits per sequence,
        per chunk its (start, length) window), one entry per replay, in order; None when the chunks fit one
        bucket as they are, or cannot be replayed (trees, explicit positions, several logits rows of a chunk
        longer than max_q_len, more than max_pieces replays).

        Each chunk is cut with `split_pieces` (a short chunk wanting logits for several rows, a verify-like
        row, stays whole). Replay r holds the r-th pieces of the chunks, grouped by (length, logits): pieces of
        up to max_q_len tokens of several sequences share one (batch, q) bucket, so a catch-up of many requests
        missing a few tokens each is a few replays of the power-of-two buckets Engine.warmup captures; longer
        pieces of up to `piece_batch(q)` sequences share one too (several prompts read in one round)."""
        if not chunks:
            return None
        ms = [c.logit_count() for c in chunks]
        ns = [len(c.token_ids) for c in chunks]
        if any(c.tree_mask is not None or c.positions is not None for c in chunks):
            return None
        if len(set(ns)) == 1 and len(set(ms)) == 1 and ns[0] <= self.max_q_len and self.bucket(len(chunks)):
            return None  # one bucket already: the ordinary replay
        cuts: list[list[tuple[int, int, int]]] = []  # per chunk: (start, length, logits) of its pieces
        for n, m in zip(ns, ms):
            if m > 1 and n <= self.max_q_len:
                cuts.append([(0, n, m)])
            elif m <= 1:
                cut = split_pieces(n, self.piece_sizes)
                cuts.append([(a, q, m if j == len(cut) - 1 else 0) for j, (a, q) in enumerate(cut)])
            else:
                return None
        plan, top = [], self.batch_sizes[-1]
        for r in range(max(map(len, cuts))):
            groups: dict[tuple[int, int], list[int]] = {}
            for i, cut in enumerate(cuts):
                if r < len(cut):
                    groups.setdefault(cut[r][1:], []).append(i)
            for (q, m), idx in groups.items():
                step = top if q <= self.max_q_len else self.piece_batch(q)
                sizes = []
                for at in range(0, len(idx), step):
                    n = min(step, len(idx) - at)
                    sizes += [n] if q <= self.max_q_len else self._long_piece_split(n)
                at = 0
                for n in sizes:
                    part = idx[at: at + n]
                    at += n
                    plan.append((part, q, m, [cuts[i][r][:2] for i in part]))
                    if len(plan) > self.max_pieces:
                        return None
        return plan

    def _long_piece_split(self, n: int) -> list[int]:
        """How n sequences' long pieces (q > max_q_len, compute-bound) share replays: one replay padded to the
        bucket, or one per power of two in n (5 = 4 + 1: padding 5 prompts to 8 computes 3 more than there are,
        a second replay costs about one prompt's weight read). Padding wins when it wastes no more sequences than
        the split adds replays (3 -> 4, 7 -> 8)."""
        bucket = self.bucket(n) or n
        parts = [1 << i for i in range(n.bit_length() - 1, -1, -1) if n >> i & 1]
        return [n] if bucket - n <= len(parts) - 1 else parts

    def forward_pieces(self, chunks: list[Chunk], num_layers: int | None = None,
                       hidden_layers=()) -> tuple[ForwardOutput, list[int]] | None:
        """A ragged step as a few bucket replays (see the module docstring); None: not applicable (the caller
        runs it as one forward). Same result as ModelRunner.forward: logits rows in chunk order, per chunk its
        first logits row, hidden states of every fed token in flat chunk order; lengths committed."""
        plan = self.plan_pieces(chunks)
        if plan is None:
            return None
        self.pieces_steps += 1
        kv = self.runner.kv
        base = {c.seq_id: kv.length(c.seq_id) for c in chunks}
        logits: list[torch.Tensor | None] = [None] * len(chunks)
        hidden: list[dict[int, list[torch.Tensor]]] = [{layer: [] for layer in hidden_layers} for _ in chunks]
        fed_to = [0] * len(chunks)  # tokens of each chunk already in the cache
        for idx, q, m, windows in plan:
            sub = []
            for i, (a, n) in zip(idx, windows):
                c = chunks[i]
                if a < fed_to[i]:  # an overlapping last piece: rewrite the overlapped positions
                    kv.truncate(c.seq_id, base[c.seq_id] + a)
                sub.append(Chunk(c.seq_id, c.token_ids[a: a + n], logits=m))
            out, _ = self.forward(sub, num_layers, hidden_layers)
            for j, (i, (a, n)) in enumerate(zip(idx, windows)):
                new = a + n - fed_to[i]  # rows not fed before (the overlap's first rows were)
                if m:
                    logits[i] = out.logits[j * m: (j + 1) * m].clone()
                for layer, h in out.hidden_states.items():
                    hidden[i][layer].append(h[j * n + n - new: (j + 1) * n].clone())
                fed_to[i] = a + n
        dev = self.runner.device
        vocab = self.runner.model.config.vocab_size
        rows = [x for x in logits if x is not None]
        starts, at = [], 0
        for x in logits:
            starts.append(at)
            at += 0 if x is None else x.shape[0]
        out_logits = torch.cat(rows) if rows else torch.empty(0, vocab, dtype=torch.float32, device=dev)
        hs = {layer: torch.cat([h for per in hidden for h in per[layer]]) for layer in hidden_layers}
        return ForwardOutput(out_logits, hs), starts

    def run_uniform(self, input_ids: torch.Tensor, context_lens: torch.Tensor, logits_per_seq: int = 1,
                    num_layers: int | None = None) -> torch.Tensor:
        """One step of q new tokens for each of B sequences, prepared on the device.

        input_ids: [B, q] int64; context_lens: [B] int64, cached tokens before the step. Sequence b is row b of
        the runner's block tables (the caller fills them and reserves the blocks; nothing is committed in the
        KVPool's host bookkeeping). Returns logits [B * logits_per_seq, V] (static memory)."""
        b, q = input_ids.shape
        key = GraphKey(self.bucket(b) or 0, q, logits_per_seq, False, num_layers, (), True)
        if key.num_seqs == 0 or q > self.max_q_len:
            raise ValueError(f"run_uniform: no bucket for {b} sequences x {q} tokens")
        cap = self._get(key, create=True)
        self._uids[: b * q].copy_(input_ids.reshape(-1))
        self._uctx[:b].copy_(context_lens)
        if b < key.num_seqs:
            self._uctx[b : key.num_seqs].zero_()
            self._uids[b * q : key.num_seqs * q].zero_()
            self.runner.buffers.block_tables[b : key.num_seqs].zero_()
        return self._replay(cap).logits[: b * logits_per_seq]


    def replay_tree(self, out_tokens: torch.Tensor, num_accepted: torch.Tensor, roots: list[int], seq_ids: list[int],
                    tree_tokens: torch.Tensor, depth: torch.Tensor, mask: torch.Tensor,
                    hidden_layers=()) -> tuple[ForwardOutput, torch.Tensor]:
        """The next round's tree verify step laid out on the device from this round's verdict and the tree drafted
        from it (TreeRound._queue_verify): B sequences of n nodes each, sequence i = seq_ids[i].

        out_tokens [B, >= a + 1] and num_accepted [B]: the verdict (accepted drafts then the bonus token, which is
        node 0 of the step); roots: each request's root position in this round (the next root sits at roots[i] +
        a_i + 1; node j's key goes to cache position next root + j, its RoPE position is next root + depth[i, j]);
        tree_tokens [B, >= n] (column 0 unread), depth [B, n], mask [B, n, n] bool (ancestor-or-self). The caller
        reserved the blocks; the KVPool's host lengths are the caller's to set. Inputs, block tables and the tree
        mask go into the static buffers in one launch on CUDA (forerun/kernels/round_prep.py). Replays the same
        bucket as `execute` of the host-prepared step (one graph for both). Returns (output: logits [B * n, V] and
        hidden states [B * n, H], static memory; the step's cache slots [B * n])."""
        b, n = depth.shape
        key = GraphKey(self.bucket(b) or 0, n, n, True, None, tuple(hidden_layers))
        if key.num_seqs == 0 or n > self.max_q_len:
            raise ValueError(f"replay_tree: no bucket for {b} sequences x {n} nodes")
        cap = self._get(key, create=True)
        buf, dev = self.runner.buffers, self.runner.device
        table = self.runner.kv.block_table(seq_ids)  # [B, W]
        stage = h2d(torch.cat([torch.tensor(roots, dtype=torch.int64), table.reshape(-1)]), dev)  # one copy
        if kernels_on("FORERUN_PREP_KERNELS", dev):
            from ..kernels.round_prep import verify_inputs as prep
        else:
            from ..kernels.round_prep import verify_inputs_torch as prep
        slots = prep(out_tokens, num_accepted, stage, tree_tokens, depth, mask, self.block_size, buf.input_ids,
                     buf.positions, buf.slot_mapping, buf.seq_lens, buf.query_start_loc, buf.block_tables, self._tree)
        t = b * n
        self._fill_padding(b, t, key.num_seqs, n)
        out = self._replay(cap)
        return ForwardOutput(out.logits[:t], {i: h[:t] for i, h in out.hidden_states.items()}), slots

    def join_len(self, num_seqs: int, prompt_tokens: int) -> int | None:
        """The join graph's prompt rows for a prompt of this many tokens joining num_seqs uniform sequences: the
        smallest of JOIN_SIZES that holds it (the rest is padding), or None (too long, or no room in the buffers for
        the largest verify step beside it)."""
        bucket, buf = self.bucket(num_seqs), self.runner.buffers
        j = next((s for s in JOIN_SIZES if s >= max(prompt_tokens, 1) and s in self.piece_sizes), None)
        if bucket is None or j is None or bucket + 2 > buf.max_seqs or bucket * self.max_q_len + j > buf.max_tokens:
            return None
        return j

    def run_uniform_join(self, input_ids: torch.Tensor, context_lens: torch.Tensor, logits_per_seq: int,
                         join_seq: int, join_tokens: list[int], join_ctx: int, num_layers: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """`run_uniform` plus the prompt of one more sequence (join_seq) in the same forward: join_tokens (its
        prompt from cached position join_ctx on) are written to its cache, and its last row gives logits. The
        caller has reserved its blocks; nothing is committed in the KVPool's host bookkeeping. Returns (the
        uniform rows' logits [B * logits_per_seq, V], the joining prompt's last row [1, V]) in static memory."""
        b, q = input_ids.shape
        n = len(join_tokens)
        j = self.join_len(b, n)
        key = GraphKey(self.bucket(b) or 0, q, logits_per_seq, False, num_layers, (), True, j or 0)
        if key.num_seqs == 0 or q > self.max_q_len or j is None:
            raise ValueError(f"run_uniform_join: no bucket for {b} sequences x {q} tokens + {n} prompt tokens")
        cap = self._get(key, create=True)
        bk = key.num_seqs
        self._uids[: b * q].copy_(input_ids.reshape(-1))
        self._uctx[:b].copy_(context_lens)
        bt = self.runner.buffers.block_tables
        if b < bk:
            self._uctx[b:bk].zero_()
            self._uids[b * q: bk * q].zero_()
            bt[b:bk].zero_()
        table = self.runner.kv.block_table([join_seq])  # [1, blocks]
        bt[bk: bk + 2].zero_()
        bt[bk, : table.shape[1]].copy_(h2d(table[0], self.runner.device))
        self._jids[:j].copy_(h2d(join_tokens + [0] * (j - n), self.runner.device, torch.int64))
        self._jmeta.copy_(h2d([join_ctx, n], self.runner.device, torch.int64))
        self.join_replays += 1
        logits = self._replay(cap).logits
        return logits[: b * logits_per_seq], logits[bk * logits_per_seq: bk * logits_per_seq + 1]


def enable_cuda_graphs(runner: ModelRunner, max_q_len: int, batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
                       fused: bool = True, max_seqs: int | None = None) -> None:
    """Install Triton paged attention + CUDA-graph replay of uniform decode/verify steps (captured on first use).
    fused: the layer kernels (forerun.models.fused_ops.FusedLayerOps); otherwise the torch ops, with the norm /
    rotary / MLP modules torch.compiled (the baseline the fused kernels are measured against)."""
    from ..attention.triton_backend import TritonPagedAttention

    runner.model.backend = TritonPagedAttention()
    if fused:
        from ..models.fused_ops import FusedLayerOps

        # quantized products (CudaQ4Linear, CudaQ8Linear) fetch weights before waiting on the norm before them: the
        # norm waits too
        runner.model.ops = FusedLayerOps(pdl_norms=True if any(hasattr(m, "qw32") or hasattr(m, "qw8")
                                                               for m in runner.model.modules()) else None)
    else:
        compile_elementwise(runner.model)
    # max_seqs: the engine's batch limit (its target buffers hold two sequences more, for run_uniform_join: the
    # buckets must not follow them, or the target would have a bucket its draft model lacks)
    limit = min(runner.buffers.max_seqs, max_seqs or runner.buffers.max_seqs)
    sizes = tuple(b for b in batch_sizes if b <= limit and b * max_q_len <= runner.buffers.max_tokens)
    runner.graphs = GraphRunner(runner, batch_sizes=sizes, max_q_len=max_q_len)
