#!/usr/bin/env python
"""EAGLE on one CUDA GPU (written for an H200): the head's step cost against the target's decode step, and
dynamic-tree drafting throughput against its ideal, with random weights and synthetic acceptance.

    python benchmarks/eagle_gpu.py          # from the repo root; ~3-5 minutes on an H200
    python benchmarks/eagle_gpu.py --quick  # batches 1 and 16, one tree, fewer rounds: ~1-2 minutes
    python benchmarks/eagle_gpu.py --draft-only   # only the drafting phase (graph vs eager) per batch and tree
    python benchmarks/eagle_gpu.py --tiny   # tiny shapes (runs on the CPU too): checks every code path

Target: random bf16 weights at Qwen3-8B shape (36 layers, hidden 4096), built on the GPU, with forerun's
CUDA graphs (Triton paged attention, fused layer ops) for its decode / verify steps, as the engine runs it.
Head: a random EAGLE-3 head (one decoder layer, fc over three target layers, a 32k draft vocabulary) run by
`EagleDrafter` exactly as in serving (draft extend, dynamic tree, rollback).

Synthetic acceptance (the head is random, so its drafts never match): at every node the target's next token
is the node's child of top-k rank r with probability q_r (q_0 = a; rank r catches a share a * rho^r of what
the ranks before it missed), mutually exclusive, else none. A round draws the accepted path from the tree the
drafter really built (the real target forward and the real tree verification kernel run; their verdict is
replaced by the drawn path), so tok/s measures the machinery at a known acceptance, not a head's quality.

Ideal (what "dynamic trees >= 95% of their ideal" is measured against): B requests x expected tokens per round
of the trees drafted (1 + sum over nodes of the product of q along their path: exact under the synthetic
model) / the round's device cost = the target forward over the B x nodes verify rows (graph replay, timed
alone) + the head's draft extend + its (steps - 1) tree steps (each timed alone at its row count). So the
ideal is the kernels with no host work between them; measured / ideal = how much of a round the host part
(tree building, masks, verification, bookkeeping) costs. `fraction_realized` uses the tokens per round the
run actually drew instead of the expectation (the same at many rounds; less noisy at few).

The random head's logits are replaced by ones whose top-k probabilities are q (`calibrate_head`), so the
dynamic tree keeps what a head as confident as it is right would keep; the head's forward still runs in full.

Drafting modes: `graph` (the default on CUDA: the draft extend and the whole dynamic tree each replay one CUDA
graph, the tree built on the device, one host read at the end; the next round's drafting queued from the device
verdict before the host reads it, `EagleDrafter.prelaunch`, and the next round's verify step too,
`TreeRound._queue_verify`, session 27, where the engine's gate queues it: from 2 requests), `forced` (the same with
the verify step queued at every batch size, `TreeRound.preverify = True`), `prelaunch` (the drafting queued ahead, the verify step prepared by the host
after the read: session 26's rounds, `TreeRound.preverify = False`), `serial` (the same graphs, the drafting
launched after the host read, as before session 26: `overlap_trees=False`) and `eager` (the same device code launched op by
op: `EagleDrafter(cuda_graphs=False)`); each tree row is measured in each mode asked for. The drafting phase alone
(`propose_tree` back to back, its wall time including the final read) is reported against its ideal (the head's
extend + tree steps, each timed alone).

Also: the head step cost per batch size vs the target decode step, and the draft budget
(forerun/drafters/eagle_budget.py) that the measured costs give per batch size.

Writes benchmarks/results/eagle_h200.json (or --out) and prints a table last.
"""
from __future__ import annotations

import argparse
import datetime
import gc
from dataclasses import replace
from types import SimpleNamespace
import json
import math
import os
import sys
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from forerun.config import CacheConfig, ModelConfig  # noqa: E402
from forerun.drafters.eagle import EagleDrafter  # noqa: E402
from forerun.drafters.eagle_budget import TreeBudget, TreeBudgetPolicy  # noqa: E402
from forerun.models.eagle_head import EagleConfig, EagleHead  # noqa: E402
from forerun.models.layers import RotaryEmbedding  # noqa: E402
from forerun.models.llama import LlamaForCausalLM  # noqa: E402
from forerun.request import Request  # noqa: E402
from forerun.runtime.runner import Chunk, ModelRunner  # noqa: E402
from forerun.sampling_params import SamplingParams  # noqa: E402
from forerun.drafters.base import TreeProposal  # noqa: E402
from forerun.engine.round import RoundItem, TreeRound  # noqa: E402
from forerun.devices import to_host_async  # noqa: E402
from forerun.verify.tree import GreedyTreeVerdict, deepest_picked_path  # noqa: E402
from forerun.engine.sampler import RoundSampler, Verdict  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from gpu_gaps import print_gaps, traced_gaps  # noqa: E402

QWEN3_8B = dict(arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True, rope_theta=1e6,
                max_position_embeddings=40960, tie_word_embeddings=False)
TINY = dict(arch="qwen3", vocab_size=2048, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
            num_kv_heads=2, head_dim=32, qk_norm=True, rope_theta=1e6, max_position_embeddings=4096,
            tie_word_embeddings=False)
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# -- models ----------------------------------------------------------------------------------------------
def build_target(shape: dict, device: torch.device, dtype: torch.dtype, seed: int) -> LlamaForCausalLM:
    """Random weights made on the device (std 0.02, norms ~1), rotary tables rebuilt there."""
    cfg = ModelConfig(**shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype).to_empty(device=device).eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.05, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    if hasattr(model, "reset_rope"):
        model.reset_rope(device)
    else:
        model.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict, model.max_positions).to(device)
    return model


def build_head(target: LlamaForCausalLM, draft_vocab: int, device: torch.device, dtype: torch.dtype,
               seed: int) -> EagleHead:
    """A random one-layer EAGLE-3 head over a random draft vocabulary of `draft_vocab` target tokens."""
    cfg = EagleConfig.for_target(target.config, version=3, draft_vocab_size=draft_vocab)
    with torch.device(device):
        head = EagleHead(cfg, target)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    ids = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
    head.set_draft_vocab(ids.sort().values - torch.arange(draft_vocab))
    return head.to(device=device, dtype=dtype).eval()


def calibrate_head(head: EagleHead, q: list[float], seed: int) -> None:
    """Make the random head's confidence its synthetic acceptance: every row's draft distribution puts q_r on
    k pseudo-random tokens (ranks 0..k-1; a hash of the row's token and position, so no RNG and capturable in a
    CUDA graph) and spreads the rest thinly, so the dynamic tree keeps the nodes a head calibrated like the
    synthetic target would keep (with a raw random head every child is ~1/Vd, and the trees come out shallow and
    wide). The head's own forward still runs in full; only its logits are replaced."""
    forward = head.forward
    k = len(q)
    dev = head.fc.weight.device
    logq = torch.tensor([math.log(max(x, 1e-12)) for x in q], device=dev)  # made outside any capture
    spread = torch.arange(k, device=dev) * 1009 + seed

    def calibrated(input_ids, feats, positions, meta, kv, from_target, rows=None):
        out, logits = forward(input_ids, feats, positions, meta, kv, from_target, rows=rows)
        n, vd = logits.shape
        ids, pos = (input_ids, positions) if rows is None else (input_ids[rows], positions[rows])
        h = (ids * 7919 + pos * 104729) % vd
        rest = max(1.0 - sum(q), 1e-6) / max(vd - k, 1)
        fake = torch.full((n, vd), math.log(rest), device=logits.device, dtype=torch.float32)
        fake.scatter_(1, (h[:, None] + spread[None, :]) % vd, logq.expand(n, k))
        return out, fake.to(logits.dtype)

    head.forward = calibrated


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def device_ms(fn, device: torch.device, inner: int, outer: int = 5, warmup: int = 2, after=None) -> float:
    """Median over `outer` timings of `inner` back-to-back calls, per call (ms): CUDA events on a GPU, the wall
    clock on the CPU. after(): host bookkeeping between calls (not timed on the CPU; cheap on the GPU)."""
    for _ in range(warmup):
        fn()
        if after:
            after()
    times = []
    for _ in range(outer):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
                if after:
                    after()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / inner)
        else:
            total = 0.0
            for _ in range(inner):
                t = time.perf_counter()
                fn()
                total += time.perf_counter() - t
                if after:
                    after()
            times.append(1e3 * total / inner)
    return float(np.median(times))


# -- synthetic acceptance ----------------------------------------------------------------------------------
def rank_probs(a: float, rho: float, k: int) -> list[float]:
    """q_r: probability that the target's token is a node's child of top-k rank r (exclusive)."""
    q, left = [], 1.0
    for r in range(k):
        p = left * a * rho ** r
        q.append(p)
        left -= p
    return q


def children_of(parents: list[int]) -> dict[int, list[int]]:
    ch: dict[int, list[int]] = {}
    for j, p in enumerate(parents):
        if p >= 0:
            ch.setdefault(p, []).append(j)  # breadth-first, parents first: siblings in top-k rank order
    return ch


def expected_tokens(parents: list[int], q: list[float]) -> float:
    """1 + sum over non-root nodes of the probability that the whole path to the node is accepted."""
    ch = children_of(parents)
    reach = {0: 1.0}
    total = 1.0
    for j in range(len(parents)):
        for r, c in enumerate(ch.get(j, ())):
            reach[c] = reach[j] * (q[r] if r < len(q) else 0.0)
            total += reach[c]
    return total


def draw_path(parents: list[int], q: list[float], rng: np.random.Generator) -> list[int]:
    ch = children_of(parents)
    path, node = [0], 0
    while True:
        kids = ch.get(node, [])
        u, acc, nxt = rng.random(), 0.0, None
        for r, c in enumerate(kids):
            acc += q[r] if r < len(q) else 0.0
            if u < acc:
                nxt = c
                break
        if nxt is None:
            return path
        path.append(nxt)
        node = nxt


# -- requests and rounds -------------------------------------------------------------------------------
def make_requests(n: int, context: int, vocab: int, seed: int, first_id: int) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(0, vocab, (context,), generator=g).tolist()
        out.append(Request(first_id + i, None, prompt, SamplingParams(temperature=0, max_tokens=1 << 20),
                           torch.Generator().manual_seed(i), frozenset()))
    return out


def prefill(runner: ModelRunner, drafter: EagleDrafter | None, reqs: list[Request], max_tokens: int) -> None:
    """Prompts into the target's cache (and the head's: its features), then one token each, greedy."""
    layers = drafter.target_hidden_layers if drafter is not None else ()
    for r in reqs:
        runner.kv.add_sequence(r.req_id)
    group: list[Request] = []

    def flush():
        if not group:
            return
        chunks = [Chunk(r.req_id, r.all_tokens, logits=1) for r in group]
        out, starts = runner.forward(chunks, hidden_layers=layers)
        nxt = out.logits.argmax(-1).tolist()
        states, at = [], 0
        for r, s in zip(group, starts):
            n = r.num_tokens
            states.append({l: h[at: at + n] for l, h in out.hidden_states.items()} if layers else None)
            at += n
        toks = [nxt[s] for s in starts]
        if drafter is not None:
            drafter.observe_target(group, states, [0] * len(group))
        for r, t in zip(group, toks):
            r.output_token_ids.append(t)
        group.clear()

    for r in reqs:
        if group and (len(group) + 1) * r.num_tokens > max_tokens:
            flush()
        group.append(r)
    flush()


def sibling_rank(par: torch.Tensor) -> torch.Tensor:
    """par [b, n] -> each node's rank among its siblings (earlier siblings with the same parent)."""
    j = torch.arange(par.shape[1], device=par.device)
    return ((par[:, :, None] == par[:, None, :]) & (j[None, None, :] < j[None, :, None])).sum(-1)


def drawn_path(want: torch.Tensor, par: torch.Tensor, mask: torch.Tensor, depth: torch.Tensor):
    """The synthetic path in torch ops: the deepest node whose every ancestor-or-self has its depth's caught rank
    (want [b, levels + 1]); (drafts accepted [b], path nodes by depth [b, n]). The kernel path:
    forerun/kernels/tree_verdict.py `drawn_tree_verdict_packed` (the same path)."""
    levels = want.shape[1] - 1
    j = torch.arange(par.shape[1], device=par.device)
    caught = (sibling_rank(par) == want.gather(1, depth.clamp(max=levels))) & (depth <= levels) | (j == 0)
    return deepest_picked_path(caught, mask, depth)


class DrawnVerdict(GreedyTreeVerdict):
    """A synthetic verdict drawn on the device by the path kernel (`tree_finish` keeps it: the round moved the
    accepted keys and queued the next steps from it)."""


class SyntheticTreeSampler(RoundSampler):
    """The engine's verifier (the real tree verification runs), whose verdict is then replaced by a path drawn from
    the synthetic acceptance model over the tree really drafted: on the device for a batch of equal trees (before
    the round moves the accepted path's keys and gathers its states, so those follow the drawn path), else on the
    host. The final token is the real verdict's first output token."""

    def __init__(self, q: list[float], device: torch.device, max_depth: int, seed: int = 0) -> None:
        super().__init__("auto")
        self.q, self.max_depth = q, max_depth
        self.rng = np.random.default_rng(seed)
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.cumq = torch.tensor(np.cumsum(q).tolist(), dtype=torch.float64, device=device)
        self.trees: list[list[list[int]]] = []  # parents of every tree verified since the last reset
        self.kernel = False  # draw with forerun/kernels/tree_verdict.py off CUDA too (Triton's interpreter: tests)
        # the caught ranks of POOL rounds drawn at once (a round takes a slice: no kernels of its own), so the stand-in
        # for the target's verdict adds one path kernel and one host copy to a round, as the real greedy verdict does
        # (until session 48 it drew per round and copied the real verdict too: ~4 more small device ops a round)
        self._pool: torch.Tensor | None = None
        self._at = 0

    POOL = 256

    def _want(self, b: int, levels: int, dev: torch.device) -> torch.Tensor:
        """[b, levels + 1] the sibling rank caught at each depth (len(q): none; column 0, the root's, unread)."""
        if self._pool is None or self._pool.shape[1:] != (b, levels + 1) or self._at == self._pool.shape[0]:
            u = torch.rand(self.POOL, b, levels + 1, generator=self.gen, device=dev, dtype=torch.float64)
            self._pool, self._at = torch.searchsorted(self.cumq, u, right=True), 0
        self._at += 1
        return self._pool[self._at - 1]

    def packed_to_host(self, packed):
        return None, None  # (the real greedy verdict is not read: the drawn one replaces it in tree_launch)

    @property
    def expect(self) -> float:
        """Expected tokens of the trees verified since the last reset (exact under the synthetic model)."""
        return sum(expected_tokens(par, self.q) for pars in self.trees for par in pars)

    def tree_launch(self, logits, requests, rows, starts, tokens, parents, draft_probs, depths, layout=None):
        pending = super().tree_launch(logits, requests, rows, starts, tokens, parents, draft_probs, depths, layout)
        b, n = len(rows), max(rows)
        if any(x != n for x in rows) or tokens.shape[0] != b * n:
            return pending  # drawn on the host in tree_finish
        dev = tokens.device
        par, tok = parents.view(b, n), tokens.view(b, n)
        if layout is not None:  # all levels at once: the path = the nodes whose every ancestor has its level's rank
            mask, depth = layout
            levels = min(n - 1, self.max_depth)
            want = self._want(b, levels, dev)
            if isinstance(pending.res, GreedyTreeVerdict) and (dev.type == "cuda" or self.kernel):
                from forerun.kernels.tree_verdict import drawn_tree_verdict_packed
                packed = drawn_tree_verdict_packed(pending.res.packed, want, tok, par, mask, depth)
                host, event = to_host_async(packed)  # (the flag column: the real verdict's)
                return replace(pending, res=DrawnVerdict(packed), host=host, event=event)
            acc, nodes = drawn_path(want, par, mask, depth)
        else:  # level by level from the root
            j = torch.arange(n, device=dev)
            rank = sibling_rank(par)
            nodes = torch.full((b, n), -1, dtype=torch.long, device=dev)
            nodes[:, 0] = 0
            cur = torch.zeros(b, dtype=torch.long, device=dev)
            alive = torch.ones(b, dtype=torch.bool, device=dev)
            for d in range(1, min(n, self.max_depth + 1)):
                u = torch.rand(b, 1, generator=self.gen, device=dev, dtype=torch.float64)
                r = torch.searchsorted(self.cumq, u, right=True)  # [b, 1]: the rank caught (len(q): none)
                hit = (par == cur[:, None]) & (rank == r) & (j > 0)
                alive = alive & hit.any(-1)
                cur = torch.where(alive, hit.long().argmax(-1), cur)
                nodes[:, d] = torch.where(alive, cur, -1)
            acc = (nodes >= 0).sum(-1) - 1
        out = torch.where(nodes[:, 1:] >= 0, tok.gather(1, nodes[:, 1:].clamp(min=0)), -1)
        out = torch.cat([out, torch.full_like(out[:, :1], -1)], 1)
        out.scatter_(1, acc[:, None], pending.res.output_token_ids[:, :1].clamp(min=0))
        res = SimpleNamespace(num_accepted=acc, accepted_nodes=nodes, output_token_ids=out)
        host, event = self.verdict_to_host(res, pending.bad)
        return replace(pending, res=res, host=host, event=event)

    def tree_finish(self, pending, prop: TreeProposal):
        verdict, paths = super().tree_finish(pending, prop)
        self.trees.append(prop.parents)  # (their expected tokens are summed after the timing: `expect`)
        if isinstance(pending.res, (SimpleNamespace, DrawnVerdict)):  # drawn on the device: the verdict read back
            return Verdict(verdict.num_accepted, verdict.emitted, [None] * len(paths)), paths
        emitted, acc, paths = [], [], []  # ragged trees: the drawn path on the host
        for toks, par, e in zip(prop.tokens, prop.parents, verdict.emitted):
            path = draw_path(par, self.q, self.rng)
            paths.append(path)
            acc.append(len(path) - 1)
            emitted.append([toks[j] for j in path[1:]] + [max(e[0], 0)])
        return Verdict(acc, emitted, [None] * len(emitted)), paths


def tree_round(tr: TreeRound, reqs: list[Request], nodes: int) -> tuple[int, float]:
    """One round of the engine's TreeRound (propose_tree -> one target forward with the tree masks and the head's
    feature layers -> tree verification -> move / truncate -> target states to the drafter), the verdict replaced
    by the drawn path (SyntheticTreeSampler); the emitted tokens committed as the engine commits them. Each request
    may draft `nodes` - 1 nodes beyond the root (RoundItem.k: with k = 1, as until session 25, every tree was cut to
    one draft). Returns (tokens committed, seconds of the drafting phase as the round measured it)."""
    res = tr.run([RoundItem(r, 1, True, nodes - 1) for r in reqs])
    committed = 0
    for r, e in zip(reqs, res.emitted):
        r.output_token_ids.extend(e)
        committed += len(e)
    return committed, res.draft_seconds


class GcClock:
    """Time spent in Python's garbage collections while the block runs (gc.callbacks), and how many ran."""

    def __init__(self) -> None:
        self.seconds, self.count, self._t = 0.0, 0, None

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.seconds += time.perf_counter() - self._t
            self.count += 1
            self._t = None

    def __enter__(self) -> "GcClock":
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._cb)


def count_syncs(fn, device: torch.device) -> int | None:
    """Synchronising CUDA calls (a blocking copy, .item(), .tolist() of a device tensor, ...) that torch's sync debug
    mode flags while fn runs (the round's deliberate waits on CUDA events are not flagged); None on the CPU.
    `count_syncs.where`: per flagged call of the last run, the innermost repository frames of the Python stack that
    made it (the warning's own file and line are torch's)."""
    if device.type != "cuda":
        return None
    import traceback
    import warnings

    found: list[str] = []

    def hook(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message).lower():
            return
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(REPO)]
        found.append(" < ".join(f"{os.path.relpath(f.filename, REPO)}:{f.lineno} {f.name}"
                                for f in reversed(frames[-3:])) or f"{filename}:{lineno}")

    sync(device)
    # (switched on outside the capture: the first switch in a process warns once by itself, which until session 48
    # counted as a synchronising call of the first row measured: "1 flagged" in every run's first row)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = hook
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    count_syncs.where = found
    return len(found)


def host_profile(fn, device: torch.device, calls: int = 30, top: int = 25) -> dict:
    """Where the host's time goes in `calls` rounds: wall time, the part spent waiting in CUDA event / stream
    synchronisation (the rest is host work: when it nearly equals the wall time the round is host-bound, and
    queuing more work ahead cannot help), and cProfile's top functions by own time (cProfile slows Python code, so
    its shares are indicative; the wall / wait split is measured without it)."""
    import cProfile
    import pstats

    waited = [0.0]
    ev_sync, st_sync = torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize

    def timed(orig):
        def f(self):
            t = time.perf_counter()
            try:
                return orig(self)
            finally:
                waited[0] += time.perf_counter() - t
        return f

    sync(device)
    torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize = timed(ev_sync), timed(st_sync)
    try:
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        wall, first = time.perf_counter() - t, waited[0]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        sync(device)
        prof.disable()
    finally:
        torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize = ev_sync, st_sync
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]  # by own time
    funcs = [dict(where=f"{os.path.relpath(k[0], REPO) if k[0].startswith(REPO) else os.path.basename(k[0])}:{k[1]}"
                        f" {k[2]}", own_us=1e6 * v[2] / calls, cum_us=1e6 * v[3] / calls, calls=v[0] / calls)
             for k, v in rows]
    # (the waits of the plain pass; until session 27's last commit the mean of both passes was reported, the
    # cProfiled one waiting less: its host work read somewhat high)
    return dict(calls=calls, wall_ms=1e3 * wall / calls, waiting_ms=1e3 * first / calls,
                host_ms=1e3 * (wall - first) / calls, profiled_functions=funcs)


def plain_round(runner: ModelRunner, reqs: list[Request]) -> int:
    out, starts = runner.forward([Chunk(r.req_id, [r.all_tokens[-1]], logits=1) for r in reqs])
    for r, t in zip(reqs, out.logits.argmax(-1).tolist()):
        r.output_token_ids.append(t)
    return len(reqs)


def release(runner: ModelRunner, drafter: EagleDrafter | None, reqs: list[Request]) -> None:
    for r in reqs:
        if drafter is not None:
            drafter.release(r)
        runner.kv.free(r.req_id)


# -- isolated device costs ---------------------------------------------------------------------------------
def target_verify_ms(runner: ModelRunner, reqs: list[Request], nodes: int, layers, inner: int) -> float:
    """The target forward over `nodes` rows per request (a chain-shaped tree mask when nodes > 1), timed alone:
    prepared once, replayed (graphs on CUDA), the cache lengths put back between calls."""
    kv = runner.kv
    chunks = []
    for r in reqs:
        n0 = kv.length(r.req_id)
        mask = torch.ones(nodes, nodes, dtype=torch.bool).tril() if nodes > 1 else None
        chunks.append(Chunk(r.req_id, [r.all_tokens[-1]] * nodes, positions=list(range(n0, n0 + nodes)),
                            tree_mask=mask, logits=nodes))
    lens = {r.req_id: kv.length(r.req_id) for r in reqs}
    step = runner.prepare(chunks)
    executor = runner.graphs if runner.graphs is not None else runner

    def put_back():
        for sid, n in lens.items():
            kv.set_length(sid, n)

    ms = device_ms(lambda: executor.execute(step, None, layers), runner.device, inner, after=put_back)
    for sid, n in lens.items():
        kv.truncate(sid, n)
    return ms


def head_step_ms(drafter: EagleDrafter, reqs: list[Request], rows: int, inner: int, from_target: bool = False,
                 want: int | None = None, graph: bool = False) -> float:
    """One head forward over `rows` rows per request (tree step: the head's own outputs as features; the draft
    extend: from_target), timed alone: eagerly (launches included), or with graph=True (CUDA) captured in a CUDA
    graph and replayed (its kernels alone). want: output rows per request (MLP + lm_head; default all rows; a
    tree step wants topk, the extend 1)."""
    cache = drafter.cache
    kv = cache.kv
    lens = {}
    chunks = []
    for r in reqs:
        if not kv.has(r.req_id):
            kv.add_sequence(r.req_id)
        lens[r.req_id] = kv.length(r.req_id)
        n0 = lens[r.req_id]
        mask = torch.ones(rows, rows, dtype=torch.bool).tril() if rows > 1 else None
        chunks.append(Chunk(r.req_id, [r.all_tokens[-1]] * rows, positions=list(range(n0, n0 + rows)),
                            tree_mask=mask, logits=want or rows))
    step = cache.prepare(chunks)
    head = drafter.head
    width = head.eagle.feature_size if from_target else head.config.hidden_size
    feats = torch.randn(step.input_ids.shape[0], width, device=cache.device, dtype=drafter.head_dtype) * 0.1

    def call():
        with torch.inference_mode():
            head(step.input_ids, feats, step.positions, step.meta, kv, from_target, rows=step.logits_indices)

    if graph and cache.device.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                call()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call()
        ms = device_ms(g.replay, cache.device, inner)
        del g
    else:
        ms = device_ms(call, cache.device, inner)
    for sid, n in lens.items():
        kv.truncate(sid, n)
    return ms


def draft_phase_ms(drafter: EagleDrafter, reqs: list[Request], inner: int, outer: int = 5) -> float:
    """The drafting phase alone: propose_tree back to back (each call re-feeds the root row, drafts the whole tree
    and ends with its one host read), wall time per call (ms), median of `outer` runs after a warm-up (which
    also captures the graphs)."""
    for _ in range(3):
        drafter.propose_tree(reqs)
    times = []
    for _ in range(outer):
        t = time.perf_counter()
        for _ in range(inner):
            drafter.propose_tree(reqs)
        times.append(1e3 * (time.perf_counter() - t) / inner)
    return float(np.median(times))


def profile_calls(fn, device: torch.device, calls: int = 6, top: int = 30) -> dict:
    """Where a call's time goes (for --profile): `calls` calls of fn under torch.profiler. Per call: wall time,
    the GPU's busy time (union of kernel and copy intervals), the idle rest, the kernels launched; the kernels
    grouped by name (device us per call, count per call) and the widest idle gaps with the kernels on both sides
    (a gap = the host had not queued the next kernel yet)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(calls):
            with record_function("profiled_call"):
                fn()
        sync(device)
        wall = (time.perf_counter() - t) * 1e6 / calls
    ev = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA and e.name != "profiled_call"),
                key=lambda e: e.time_range.start)
    by_name: dict[str, list[float]] = {}
    busy, gaps, end, prev = 0.0, [], None, None
    for e in ev:
        s0, s1 = e.time_range.start, e.time_range.end
        by_name.setdefault(e.name[:90], []).append(s1 - s0)
        if end is None or s0 > end:
            if end is not None:
                gaps.append((s0 - end, prev, e.name[:60]))
            busy += s1 - s0
            end = s1
        elif s1 > end:
            busy += s1 - end
            end = s1
        prev = e.name[:60]
    span = (ev[-1].time_range.end - ev[0].time_range.start) if ev else 0.0
    kernels = sorted(((k, sum(v) / calls, len(v) / calls) for k, v in by_name.items()), key=lambda x: -x[1])
    gaps.sort(key=lambda g: -g[0])
    host = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:15]
    # the last call's timeline (us from its start): GPU intervals and the host's CUDA runtime calls, to see what the
    # GPU waited for
    marks = sorted((e for e in prof.events() if e.name == "profiled_call" and e.device_type == DeviceType.CPU),
                   key=lambda e: e.time_range.start)
    timeline = None
    if marks:
        t0 = marks[-1].time_range.start
        gpu = [[round(e.time_range.start - t0, 1), round(e.time_range.end - t0, 1), e.name[:48]]
               for e in ev if e.time_range.end >= t0]
        cpu = [[round(e.time_range.start - t0, 1), round(e.time_range.end - t0, 1), e.name[:48]]
               for e in prof.events() if e.device_type == DeviceType.CPU and e.time_range.start >= t0
               and (e.name.startswith("cuda") or e.name.startswith("forerun"))]
        timeline = dict(gpu=gpu, host=sorted(cpu))
    return dict(host_ops=[dict(name=a.key[:80], self_us=round(a.self_cpu_time_total / calls, 1),
                               count=round(a.count / calls, 2)) for a in host],
                calls=calls, wall_us=wall, gpu_busy_us=busy / calls, gpu_span_us=span / calls,
                gpu_idle_us=wall - busy / calls, kernels_per_call=len(ev) / calls,
                kernels=[dict(name=k, us=round(us, 2), count=round(c, 2)) for k, us, c in kernels[:top]],
                widest_gaps=[dict(us=round(g, 1), after=a, before=b) for g, a, b in gaps[:12]], timeline=timeline)


def print_profile(label: str, p: dict) -> None:
    print(f"\nprofile {label}: wall {p['wall_us']:.0f} us/call, GPU busy {p['gpu_busy_us']:.0f} us, idle "
          f"{p['gpu_idle_us']:.0f} us, {p['kernels_per_call']:.0f} kernels/call")
    for k in p["kernels"]:
        print(f"  {k['us']:9.1f} us  x{k['count']:<6.1f} {k['name']}")
    for h in p.get("host_ops", [])[:10]:
        print(f"  host {h['self_us']:9.1f} us  x{h['count']:<6.1f} {h['name']}")
    for g in p["widest_gaps"][:6]:
        print(f"  gap {g['us']:8.1f} us after {g['after']} before {g['before']}")


# -- main ----------------------------------------------------------------------------------------------------
def parse_trees(text: str) -> list[TreeBudget]:
    return [TreeBudget(*map(int, t.split(","))) for t in text.split(";") if t.strip()]


# drafting replayed from CUDA graphs; "forced": graph with the next verify step queued whatever the batch size
# (TreeRound.preverify = True; "graph" queues it where the engine's gate does)
GRAPH_MODES = ("graph", "forced", "prelaunch", "serial")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and few rounds (any device): a smoke run")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "eagle_h200.json"))
    ap.add_argument("--batches", default=None, help="comma list (default 1,4,16,64; --tiny 1,3)")
    ap.add_argument("--trees", default=None,
                    help="';'-separated TOPK,STEPS,NODES (default 4,4,16;4,3,8;1,4,5; the last is a chain)")
    ap.add_argument("--accept", type=float, default=0.8, help="synthetic top-1 acceptance a")
    ap.add_argument("--rho", type=float, default=0.5, help="rank r catches a * rho^r of what ranks < r missed")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per configuration (default 60)")
    ap.add_argument("--context", type=int, default=None, help="prompt tokens per request (default 256)")
    ap.add_argument("--draft-vocab", type=int, default=None, help="head draft vocabulary (default 32000)")
    ap.add_argument("--no-graphs", action="store_true", help="the target eager (no CUDA graphs; drafting eager too)")
    ap.add_argument("--host-profile", action="store_true",
                    help="per tree row and mode: the round's host work vs its waits, and cProfile's top functions")
    ap.add_argument("--quick", action="store_true", help="batches 1,16, tree 4,4,16, 20 rounds, context 128")
    ap.add_argument("--draft-only", action="store_true",
                    help="time only the drafting phase (graph vs eager) per batch and tree; no rounds")
    ap.add_argument("--replot", metavar="JSON", help="only draw the PNG of an earlier run's JSON")
    ap.add_argument("--int4", action="store_true",
                    help="the target's linears (head included) in int4 as the engine keeps GGUF Q4 weights on CUDA "
                         "(CudaQ4Linear); the EAGLE head stays in bf16")
    ap.add_argument("--profile", action="store_true",
                    help="also profile a few rounds and drafting calls (the first drafting mode) with torch.profiler: "
                         "kernels by name, GPU busy / idle time, widest idle gaps (JSON key `profiles`)")
    ap.add_argument("--gaps", action="store_true",
                    help="also trace 24 rounds per tree row (the first drafting mode; 4 left out) under torch.profiler "
                         "with Python stacks: the GPU's idle gaps named by the code whose launch ended them "
                         "(benchmarks/gpu_gaps.py; JSON key `gaps`)")
    ap.add_argument("--modes", default=None,
                    help="drafting modes, comma list of graph,forced,prelaunch,serial,eager (default graph,eager on CUDA)")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), os.path.splitext(args.replot)[0] + ".png")
        return
    tiny = args.tiny
    if args.quick:
        args.batches = args.batches or "1,16"
        args.trees = args.trees or "4,4,16"
        args.rounds = args.rounds or 20
        args.context = args.context or 128
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda and not tiny:
        raise SystemExit("eagle_gpu.py needs a CUDA GPU (or --tiny for a smoke run on the CPU)")
    batches = [int(x) for x in (args.batches or ("1,3" if tiny else "1,4,16,64")).split(",")]
    trees = parse_trees(args.trees or ("3,3,8;1,3,4" if tiny else "4,4,16;4,3,8;1,4,5"))
    rounds = args.rounds or (4 if tiny else 60)
    warm = 2 if tiny else 5
    context = args.context or (48 if tiny else 256)
    draft_vocab = args.draft_vocab or (512 if tiny else 32000)
    inner = 3 if tiny else 20
    modes = (args.modes or ("graph,eager" if cuda and not args.no_graphs else "eager")).split(",")
    q = rank_probs(args.accept, args.rho, max(t.topk for t in trees))
    torch.manual_seed(0)
    res: dict = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), torch=torch.__version__,
                     device=torch.cuda.get_device_name(0) if cuda else "cpu", tiny=tiny, context=context,
                     accept=args.accept, rho=args.rho, rank_probs=[round(x, 4) for x in q], rounds=rounds,
                     batches=batches, draft_vocab=draft_vocab, modes=modes, quick=args.quick,
                     target_weights="int4" if args.int4 else str(dtype).replace("torch.", ""))
    log(f"{res['device']}  torch {torch.__version__}  synthetic q_r = {[round(x, 3) for x in q]}")

    shape = TINY if tiny else QWEN3_8B
    target = build_target(shape, device, dtype, seed=1)
    head = build_head(target, draft_vocab, device, dtype, seed=2)
    calibrate_head(head, q, seed=3)
    if args.int4:  # (after the head: it takes nothing from the target's linears; on the CPU (--tiny) the int4
        from forerun.models.quant_cuda import quantize_model_cuda  # linears multiply their dequantized matrix)
        res["int4_linears"] = quantize_model_cuda(target)
        if cuda:
            torch.cuda.empty_cache()
    max_b, max_nodes = max(batches), max(t.nodes for t in trees)
    # every tree runs on the same requests, one after the other: room for all of their rounds
    # (each tree x drafting mode runs warm + timed rounds of up to steps + 1 tokens, plus the drafting-alone
    # calls, which commit nothing; the run died at b=64, tree 1,4,5 [eager] when modes were not counted)
    extra = 60 if args.host_profile else 0  # (host_profile's rounds)
    per_seq = context + len(trees) * len(modes) * (rounds + warm + 4 + extra) * (max(t.steps for t in trees) + 1) \
        + 2 * max_nodes + 64
    max_tokens = max(4096 if not tiny else 512, max_b * max_nodes, max_b * 8)
    runner = ModelRunner(target, CacheConfig(block_size=16, num_blocks=max_b * (-(-per_seq // 16) + 2) + 64), device,
                         dtype, max_batch_tokens=max_tokens, max_seqs=max_b)
    if cuda and not args.no_graphs:
        from forerun.runtime.cuda_graph import enable_cuda_graphs

        enable_cuda_graphs(runner, max_q_len=max_nodes, batch_sizes=tuple(sorted(set(batches))))
    drafter = EagleDrafter(runner, head, cache=CacheConfig(block_size=16, num_blocks=max_b * (-(-per_seq // 16) + 2) + 64),
                           max_seqs=max_b, max_batch_tokens=max_tokens)
    layers = drafter.target_hidden_layers
    res["target"] = dict(layers=target.config.num_layers, hidden=target.config.hidden_size,
                         params_B=round(sum(p.numel() for p in target.parameters()) / 1e9, 3))
    res["head"] = dict(params_M=round(sum(p.numel() for p in head.parameters()) / 1e6, 1), aux_layers=list(layers),
                       draft_vocab=draft_vocab)
    log(f"target {res['target']}, head {res['head']}, graphs {runner.graphs is not None}")

    next_id = 0
    rows_out, costs, head_costs, drafts, profiles, host_profiles, gaps = [], {}, [], [], [], [], []
    for b in batches:
        # plain decoding (the baseline) and the target's isolated costs at this batch
        reqs = make_requests(b, context, shape["vocab_size"], seed=b, first_id=next_id)
        next_id += b
        prefill(runner, None, reqs, max_tokens)
        for _ in range(warm):
            plain_round(runner, reqs)
        sync(device)
        t = time.perf_counter()
        toks = sum(plain_round(runner, reqs) for _ in range(rounds))
        sync(device)
        plain_s = time.perf_counter() - t
        tv = {n: target_verify_ms(runner, reqs, n, layers, inner) for n in sorted({1} | {t.nodes for t in trees})}
        release(runner, None, reqs)
        costs[b] = {"plain_step_ms": 1e3 * plain_s / rounds, "plain_tok_s": toks / plain_s,
                    "target_forward_ms": tv}
        log(f"b={b}: plain {toks / plain_s:.1f} tok/s ({1e3 * plain_s / rounds:.2f} ms/step), target forward "
            + " ".join(f"{n}:{ms:.2f}" for n, ms in tv.items()) + " ms (rows per request: ms)")

        # the head's step cost, timed alone, against the target's decode step
        reqs = make_requests(b, context, shape["vocab_size"], seed=100 + b, first_id=next_id)
        next_id += b
        prefill(runner, drafter, reqs, max_tokens)
        hc = {"batch": b, "target_decode_ms": tv[1],
              "extend_2rows_ms": head_step_ms(drafter, reqs, 2, inner, from_target=True)}
        for rows in sorted({1} | {t.topk for t in trees} | {t.topk * 2 for t in trees if t.topk > 1}):
            hc[f"step_{rows}rows_ms"] = head_step_ms(drafter, reqs, rows, inner)
        hc["c"] = hc["step_1rows_ms"] / tv[1]  # one chain draft step / one target decode step
        head_costs.append(hc)
        log(f"b={b}: head step " + ", ".join(f"{k[5:-3]} {v:.3f} ms" for k, v in hc.items() if k.startswith("step_"))
            + f", extend {hc['extend_2rows_ms']:.3f} ms; target decode {tv[1]:.2f} ms (c = {hc['c']:.3f})")

        # dynamic trees with synthetic acceptance vs their ideal, per drafting mode (graph / eager)
        for shape_t in trees:
            drafter.tree_topk, drafter.tree_steps, drafter.tree_nodes = shape_t.topk, shape_t.steps, shape_t.nodes
            head_ms = head_step_ms(drafter, reqs, 2, inner, from_target=True, want=1) + sum(
                head_step_ms(drafter, reqs, shape_t.topk * d, max(1, inner // 4), want=shape_t.topk)
                for d in range(1, shape_t.steps))
            # the same head forwards replayed from CUDA graphs: the kernels alone (a stricter ideal)
            head_k_ms = head_step_ms(drafter, reqs, 2, inner, from_target=True, want=1, graph=True) + sum(
                head_step_ms(drafter, reqs, shape_t.topk * d, max(1, inner // 4), want=shape_t.topk, graph=True)
                for d in range(1, shape_t.steps)) if cuda else head_ms
            for mode in modes:
                # fresh requests at the configured context for every row: rows reusing the same requests ran at a
                # context grown by every row before (at batch 64 the last row's attention read ~8x the KV bytes of
                # the verify forward its ideal was timed with: the session-26/27 sweeps' "drift" at batch 64)
                release(runner, drafter, reqs)
                reqs = make_requests(b, context, shape["vocab_size"], seed=100 + b, first_id=next_id)
                next_id += b
                prefill(runner, drafter, reqs, max_tokens)
                drafter.cuda_graphs = None if mode in GRAPH_MODES else False
                drafter.overlap_trees = False if mode == "serial" else None
                if mode in GRAPH_MODES:  # every extend length a round can feed, and the tree: nothing captured while timed
                    t = time.perf_counter()
                    n_graphs = drafter.capture_graphs([b], [(shape_t.topk, shape_t.steps, shape_t.nodes)])
                    log(f"b={b}: {n_graphs} drafting graphs captured ({time.perf_counter() - t:.1f} s)")
                draft_alone = draft_phase_ms(drafter, reqs, inner)
                profiled = dict(batch=b, tree=[shape_t.topk, shape_t.steps, shape_t.nodes], mode=mode)
                if args.profile and mode == modes[0]:
                    profiles.append(dict(profiled, what="propose_tree",
                                         **profile_calls(lambda: drafter.propose_tree(reqs), device)))
                drafts.append(dict(batch=b, topk=shape_t.topk, steps=shape_t.steps, nodes=shape_t.nodes, mode=mode,
                                   draft_ms=draft_alone, ideal_draft_ms=head_ms,
                                   fraction_of_ideal=head_ms / draft_alone, kernel_ideal_draft_ms=head_k_ms,
                                   fraction_of_kernel_ideal=head_k_ms / draft_alone))
                log(f"b={b} tree {shape_t.topk},{shape_t.steps},{shape_t.nodes} [{mode}]: drafting phase alone "
                    f"{draft_alone:.3f} ms (ideal {head_ms:.3f} ms: {100 * head_ms / draft_alone:.1f}%; head kernels "
                    f"alone {head_k_ms:.3f} ms: {100 * head_k_ms / draft_alone:.1f}%)")
                if args.draft_only:
                    continue
                sampler = SyntheticTreeSampler(q, device, shape_t.steps, seed=1000 * b + shape_t.nodes)
                tr = TreeRound(runner, drafter, sampler)
                tr.preverify = {"prelaunch": False, "forced": True}.get(mode)
                for _ in range(warm):
                    tree_round(tr, reqs, shape_t.nodes)
                sync(device)
                sampler.trees.clear()
                pre0 = dict(drafter.prelaunch_stats)
                pv0 = dict(tr.preverify_stats)
                # what `forerun serve` does after its warm-up (since session 48 here too): the objects made so far
                # out of the collector's way, and the collections that still run timed (a full collection of this
                # process's heap can stall a round by ~0.1 s: session 48's one-off batch-64 dip is a suspect)
                gc.collect()
                gc.freeze()
                gc_s = GcClock()
                t = time.perf_counter()
                committed, draft_s = 0, 0.0
                with gc_s:
                    for _ in range(rounds):
                        c_, d_ = tree_round(tr, reqs, shape_t.nodes)
                        committed += c_
                        draft_s += d_
                    sync(device)
                secs = time.perf_counter() - t
                gc.unfreeze()
                prelaunched = {k: v - pre0[k] for k, v in drafter.prelaunch_stats.items()}
                preverified = {k: v - pv0[k] for k, v in tr.preverify_stats.items()}
                expect = sampler.expect
                drafted = [len(par) for pars in sampler.trees for par in pars]
                if min(drafted) < shape_t.nodes:
                    log(f"WARNING: trees of {min(drafted)}..{max(drafted)} nodes drafted, "
                        f"the shape has {shape_t.nodes}")
                syncs = count_syncs(lambda: tree_round(tr, reqs, shape_t.nodes), device)
                sync_where = getattr(count_syncs, "where", None)
                hostp = None
                if args.host_profile and cuda:
                    hostp = dict(batch=b, tree=[shape_t.topk, shape_t.steps, shape_t.nodes], mode=mode,
                                 **host_profile(lambda: tree_round(tr, reqs, shape_t.nodes), device))
                    host_profiles.append(hostp)
                    log(f"b={b} {mode}: round {hostp['wall_ms']:.2f} ms, host work {hostp['host_ms']:.2f} ms, "
                        f"waiting {hostp['waiting_ms']:.2f} ms; top: " + "; ".join(
                            f"{f['where']} {f['own_us']:.0f}us" for f in hostp['profiled_functions'][:8]))
                if args.profile and mode == modes[0]:
                    profiles.append(dict(profiled, what="tree_round",
                                         **profile_calls(lambda: tree_round(tr, reqs, shape_t.nodes), device)))
                if args.gaps and mode == modes[0]:
                    gaps.append(dict(batch=b, tree=[shape_t.topk, shape_t.steps, shape_t.nodes], mode=mode,
                                     **traced_gaps(lambda: tree_round(tr, reqs, shape_t.nodes), device, 24, 4)))
                tok_round = committed / (rounds * b)
                exp_round = expect / (rounds * b)
                round_ms = tv[shape_t.nodes] + head_ms
                kernel_round_ms = tv[shape_t.nodes] + head_k_ms
                ideal = b * exp_round / (round_ms * 1e-3)
                ideal_real = b * tok_round / (round_ms * 1e-3)
                row = dict(batch=b, topk=shape_t.topk, steps=shape_t.steps, nodes=shape_t.nodes, mode=mode,
                           tok_s=committed / secs, round_ms=1e3 * secs / rounds, ideal_round_ms=round_ms,
                           ideal_head_ms=head_ms, ideal_verify_ms=tv[shape_t.nodes],
                           draft_ms=1e3 * draft_s / rounds, flagged_syncs_per_round=syncs,
                           expected_tokens_per_round=exp_round, tokens_per_round=tok_round,
                           nodes_per_tree=sum(drafted) / len(drafted),
                           ideal_tok_s=ideal, fraction_of_ideal=committed / secs / ideal,
                           ideal_realized_tok_s=ideal_real, fraction_realized=committed / secs / ideal_real,
                           kernel_ideal_round_ms=kernel_round_ms, kernel_ideal_head_ms=head_k_ms,
                           fraction_of_kernel_ideal=committed / secs / (b * exp_round / (kernel_round_ms * 1e-3)),
                           fraction_realized_kernels=kernel_round_ms / (1e3 * secs / rounds),
                           speedup_vs_plain=committed / secs / costs[b]["plain_tok_s"],
                           prelaunch=prelaunched, preverify=preverified, sync_sites=sync_where,
                           gc_ms=round(1e3 * gc_s.seconds, 3), gc_collections=gc_s.count)
                rows_out.append(row)
                log(f"b={b} tree {shape_t.topk},{shape_t.steps},{shape_t.nodes} [{mode}]: {row['tok_s']:.1f} tok/s, "
                    f"{row['round_ms']:.2f} ms/round (ideal {round_ms:.2f}; drafting {row['draft_ms']:.2f}, ideal "
                    f"{head_ms:.2f}), {tok_round:.2f} tok/round (E {exp_round:.2f}); "
                    f"{100 * row['fraction_realized']:.1f}% of ideal ({100 * row['fraction_realized_kernels']:.1f}% of "
                    f"the kernels-alone ideal {kernel_round_ms:.2f} ms), {row['speedup_vs_plain']:.2f}x plain"
                    + (f"; {syncs} synchronising calls flagged in a round" if syncs is not None else "")
                    + (f"; {row['gc_collections']} garbage collections timed, {row['gc_ms']:.1f} ms"
                       if row["gc_collections"] else ""))
            drafter.cuda_graphs = None
        release(runner, drafter, reqs)
        if drafter.static is not None:
            res["draft_graphs"] = len(drafter.static.graphs)
        res.update(costs={str(k): v for k, v in costs.items()}, head_step=head_costs, trees=rows_out,
                   drafting=drafts, **({"profiles": profiles} if profiles else {}),
                   **({"gaps": gaps} if gaps else {}),
                   **({"host_profiles": host_profiles} if host_profiles else {}))
        save(res, args.out)

    # the budget the measured costs give (forerun/drafters/eagle_budget.py), for a head whose confidence is
    # its acceptance (tree values = the synthetic model's)
    big = max(trees, key=lambda t: (t.nodes, t.steps, t.topk))
    pol = TreeBudgetPolicy(big, target_cost=_Measured(costs))
    for hc in head_costs:
        for k, v in hc.items():
            if k.startswith("step_"):
                pol.record_head_step(hc["batch"] * int(k[5:-7]), v * 1e-3)
    parent, depth, score, rank = [-1], [0], [0.0], [0]  # the candidate tree of a calibrated head
    level = [0]
    for _ in range(big.steps):
        new = []
        for node in level:
            for r in range(big.topk):
                parent.append(node)
                depth.append(depth[node] + 1)
                score.append(score[node] + math.log(max(q[r], 1e-12)))
                rank.append(r)
                new.append(len(parent) - 1)
        level = sorted(sorted(new, key=lambda j: -score[j])[: big.topk])
    pol.record_values(pol.tree_values(parent, depth, score, rank))
    res["budget"] = pol.table(sorted(set(batches) | {1, 2, 4, 8, 16, 32, 64}))
    # the greedy tree's bookkeeping: forerun/kernels/eagle_tree.py's Triton kernels (CUDA's default) or torch ops
    res["tree_ops"] = ("torch" if os.environ.get("FORERUN_EAGLE_FUSED") == "0" or not cuda
                       else "fused (for the shapes forerun.kernels.eagle_tree.fits)")
    res["ideal_definition"] = ("B x expected tokens per round (synthetic model, exact over the trees drafted) / "
                               "(target forward over B x nodes rows + head extend + (steps-1) head tree steps, "
                               "each timed alone)")
    save(res, args.out)
    plot(res, os.path.splitext(args.out)[0] + ".png")
    print_table(res)
    for p in res.get("profiles", []):
        print_profile(f"b={p['batch']} tree {p['tree']} {p['what']} [{p['mode']}]", p)
    for g in res.get("gaps", []):
        print_gaps(f"b={g['batch']} tree {g['tree']} round [{g['mode']}]", g)


class _Measured:
    """target_time(tokens) from the measured forwards: per (batch, rows per request), interpolated in tokens."""

    def __init__(self, costs: dict) -> None:
        pts = sorted((b * n, ms * 1e-3) for b, c in costs.items() for n, ms in c["target_forward_ms"].items())
        self.x = np.array([p[0] for p in pts], dtype=float)
        self.y = np.maximum.accumulate(np.array([p[1] for p in pts], dtype=float))

    def target_time(self, tokens: int) -> float:
        if tokens <= self.x[-1]:
            return float(np.interp(tokens, self.x, self.y))
        slope = (self.y[-1] - self.y[0]) / max(self.x[-1] - self.x[0], 1.0)
        return float(self.y[-1] + slope * (tokens - self.x[-1]))


def save(res: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


def plot(res: dict, png: str) -> None:
    """Per tree row: the measured round against its kernels-alone ideal (verify + head), ms; PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res.get("trees") or []
    if not rows:
        return
    labels = [f"b={r['batch']} {r['topk']},{r['steps']},{r['nodes']} {r.get('mode', '')}" for r in rows]
    y = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(rows) + 2.0))
    ax.barh(y - 0.2, [r["round_ms"] for r in rows], 0.4, label="round (measured)", color="tab:blue")
    ax.barh(y + 0.2, [r["ideal_verify_ms"] for r in rows], 0.4, label="target verify alone", color="tab:gray")
    ax.barh(y + 0.2, [r.get("kernel_ideal_head_ms", r["ideal_head_ms"]) for r in rows], 0.4,
            left=[r["ideal_verify_ms"] for r in rows], label="head steps alone (graphs)", color="tab:green")
    for i, r in enumerate(rows):
        ax.text(r["round_ms"], i - 0.2, f" {100 * r.get('fraction_realized_kernels', float('nan')):.0f}% of ideal",
                va="center", fontsize=8)
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms per round")
    ax.set_title(f"EAGLE dynamic trees, {res['device']}, synthetic a={res['accept']} ({res.get('date', '')})",
                 fontsize=9)
    ax.set_xlim(0, 1.25 * max(r["round_ms"] for r in rows))
    fig.legend(*ax.get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=3)
    fig.tight_layout(rect=(0, 0.45 / fig.get_figheight(), 1, 1))  # room for the legend below, whatever the rows
    fig.savefig(png, dpi=110)


def print_table(res: dict) -> None:
    print(f"\n{res['device']}: target {res['target']}, head {res['head']}, synthetic a={res['accept']} "
          f"rho={res['rho']} (q_r {res['rank_probs']})")
    print("ideal: target verify + head extend + tree steps, each timed alone, head eagerly (as in the first run); "
          "%kern(real): the same with the head steps replayed from CUDA graphs (kernels alone), realized tokens")
    print(f"\n{'batch':>5s} {'target decode ms':>16s} {'head step ms (1 row)':>20s} {'c':>6s} {'extend ms':>9s}")
    for hc in res["head_step"]:
        print(f"{hc['batch']:5d} {hc['target_decode_ms']:16.3f} {hc['step_1rows_ms']:20.3f} {hc['c']:6.3f} "
              f"{hc['extend_2rows_ms']:9.3f}")
    print(f"\n{'batch':>5s} {'tree':>9s} {'mode':>9s} {'tok/s':>9s} {'ideal':>9s} {'%ideal':>7s} {'%ideal(real)':>12s} "
          f"{'ms/round':>8s} {'ideal ms':>8s} {'draft ms':>8s} {'ideal':>6s} {'tok/round':>9s} {'E':>5s} {'x plain':>7s} "
          f"{'%kern(real)':>11s}")
    for r in res["trees"]:
        print(f"{r['batch']:5d} {r['topk']},{r['steps']},{r['nodes']:<5d} {r.get('mode', '-'):>9s} {r['tok_s']:9.1f} "
              f"{r['ideal_tok_s']:9.1f} {100 * r['fraction_of_ideal']:6.1f}% {100 * r['fraction_realized']:11.1f}% "
              f"{r['round_ms']:8.2f} {r['ideal_round_ms']:8.2f} {r.get('draft_ms', float('nan')):8.2f} "
              f"{r['ideal_head_ms']:6.2f} {r['tokens_per_round']:9.2f} {r['expected_tokens_per_round']:5.2f} "
              f"{r['speedup_vs_plain']:7.2f} {100 * r.get('fraction_realized_kernels', float('nan')):10.1f}%")
    if res.get("drafting"):
        print("\ndrafting phase alone (propose_tree back to back, wall ms incl. its one host read) vs its ideal "
              "(head extend + tree steps, each timed alone):")
        print(f"{'batch':>5s} {'tree':>9s} {'mode':>9s} {'draft ms':>9s} {'ideal ms':>9s} {'%ideal':>7s} "
              f"{'kernels ms':>10s} {'%kernels':>8s}")
        for r in res["drafting"]:
            print(f"{r['batch']:5d} {r['topk']},{r['steps']},{r['nodes']:<5d} {r['mode']:>9s} {r['draft_ms']:9.3f} "
                  f"{r['ideal_draft_ms']:9.3f} {100 * r['fraction_of_ideal']:6.1f}% {r['kernel_ideal_draft_ms']:10.3f} "
                  f"{100 * r['fraction_of_kernel_ideal']:7.1f}%")
    print("\nbudget from the measured costs (forerun/drafters/eagle_budget.py):")
    for b in res["budget"]:
        print(f"  batch {b['batch']:3d}: topk {b['topk']}, steps {b['steps']}, nodes {b['nodes']:3d} "
              f"(E {b['expected_tokens']:.2f} tokens, {b['round_ms']:.2f} ms/round)")


if __name__ == "__main__":
    main()
