"""Overlapped plain decoding: the device runs step n+1 while the host commits step n.

Without overlap, every decode step ends with a device -> host read of the new tokens, and the device idles
while the host commits them (stop checks, detokenisation) and prepares the next step. Here the next step
is launched first, fed on the device (its input ids are the previous step's sampled tokens, its positions
and cache slots are computed inside the CUDA graph from the context lengths and block tables:
`GraphRunner.run_uniform`), and only then does the host wait for the previous step's tokens. So the host
work of step n hides behind the device work of step n+1 (seed 000's zero-overhead scheduling).

Exactness: a launched step never changes what is committed. Each step draws the same two coins per request
from the request's own generator as a non-overlapped round with k = 0 (engine/sampler.py), and samples with
the same rule (seeded requests: the same position-keyed coupling), so outputs equal the non-overlapped ones
for the same seeds. When a request finishes
(stop token or string, found only after its step was committed), the step already in flight is still
committed for the others; the finished request's extra token is dropped and its cache is freed. A step is
launched only if every request still needs a token after the pending one (max_tokens, context length), so
no request is ever fed past its limits.

Scope: plain decoding (no drafter, or adaptive k at 0 for every request, for as many steps as the k scheduler
allows before it probes again), every request past its prefill, sampling the fused kernel covers on CUDA
(temperature; no top-k / top-p / min-p / logprobs). Elsewhere the engine runs ordinary rounds.
"""
from __future__ import annotations

from typing import Callable, Generator

import torch

from ..devices import h2d
from ..kvcache.pool import OutOfBlocks
from ..request import Request
from ..verify.coupling import row_key
from ..runtime.runner import ModelRunner
from .sampler import RoundSampler, is_coupled, temperature_only


def overlap_applies(runner: ModelRunner, requests: list[Request], limit: int, rule: str) -> bool:
    """All requests sample as the fused kernel does (rule auto, temperature only), are past their prefill, fit
    one graph bucket and need two more tokens."""
    gr, kv = runner.graphs, runner.kv
    if gr is None or not requests or gr.bucket(len(requests)) is None or rule != "auto":
        return False
    if not temperature_only(requests):
        return False
    return all(kv.length(r.req_id) == r.num_tokens - 1 and r.remaining >= 2 and r.num_tokens + 1 < limit
               for r in requests)


def overlapped_decode(runner: ModelRunner, requests: list[Request], limit: int,
                      commit: Callable[[Request, list[int], None], int], sampler: RoundSampler,
                      max_steps: int | None = None, should_stop: Callable[[], bool] | None = None,
                      step_time: Callable[[int, float], None] | None = None) -> Generator[int, None, int]:
    """Decode steps for `requests` with one step in flight; yields tokens committed per step; stops when a
    request has finished, another step would pass a request's limits, the pool has no block for another step,
    max_steps steps have run or should_stop() says so (new arrivals, an abort), and returns
    the number of steps run (each committed for every request still unfinished). On return every unfinished
    request holds the round invariant (its cache has every committed token but the newest).
    step_time(tokens, seconds): each step's device time (CUDA events, read when its tokens are), for the k
    policy's cost model: what a plain step of this batch costs. sampler: the engine's verifier entry, whose
    `plain_launch` samples each step on the device."""
    gr, kv, dev = runner.graphs, runner.kv, runner.device
    cuda = dev.type == "cuda"
    b = len(requests)
    ids = torch.tensor([[r.last_token] for r in requests], device=dev)  # [B, 1] next input, fed on device
    ctx = torch.tensor([kv.length(r.req_id) for r in requests], device=dev)  # [B] cached tokens before a step
    runner.load_block_tables([r.req_id for r in requests])  # row i = requests[i] (run_uniform's rows)
    inputs = sampler.plain_inputs(requests, dev)  # seeded requests: greedy on log p + g(seed, position)
    coupled = {i for i, r in enumerate(requests) if is_coupled(r, sampler.rule)}  # the rows inputs perturbs

    def launch() -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Reserve a slot per request, replay the step, sample, feed the tokens back; start the token copy."""
        keys, before = [], []
        try:  # every request's slot first: a full pool ends the session before anything moved
            for r in requests:
                before.append(len(kv.blocks(r.req_id)))
                kv.reserve(r.req_id, kv.length(r.req_id) + 1)
        except OutOfBlocks:  # the engine's next ordinary round preempts
            return None
        for i, r in enumerate(requests):
            n = kv.length(r.req_id)
            if i in coupled:  # the token sampled now sits at index n + 1 of the sequence
                keys.append(row_key(r.params.seed, n + 1))
            for j, blk in enumerate(kv.blocks(r.req_id)[before[i]:], start=before[i]):
                runner.buffers.block_tables[i, j] = blk
            kv.set_length(r.req_id, n + 1)
        coins = torch.cat([torch.rand(1, 2, generator=r.generator) for r in requests])  # as speculative_round
        coins = coins.pin_memory().to(dev, non_blocking=True) if cuda else coins
        t0 = None
        if cuda and step_time is not None:
            t0 = torch.cuda.Event(enable_timing=True)
            t0.record()
        logits = gr.run_uniform(ids, ctx, 1)  # [B, V]
        # queued copies (the forward above is still running); the verifier is RoundSampler.chain's
        tok = sampler.plain_launch(logits, inputs, coins, h2d(keys, dev, torch.int64) if coupled else None)
        ids.copy_(tok.view(b, 1))
        ctx.add_(1)
        if not cuda:
            return tok, None, None
        host = torch.empty(b, dtype=torch.int64, pin_memory=True)
        host.copy_(tok, non_blocking=True)
        done = torch.cuda.Event(enable_timing=t0 is not None)
        done.record()
        return host, done, t0

    def commit_step(step, only_unfinished: bool) -> int:
        tokens, done, t0 = step
        if done is not None:
            done.synchronize()
            if t0 is not None:
                step_time(b, t0.elapsed_time(done) * 1e-3)
        produced = 0
        for r, t in zip(requests, tokens.tolist()):
            if only_unfinished and r.finished:
                continue
            n = commit(r, [t], None)
            r.stats.record(0, 0, n)
            produced += n
        return produced

    pending, launched = None, 0
    while True:
        ahead = 0 if pending is None else 1  # steps launched but not committed
        room = all(r.remaining - ahead >= 1 and r.num_tokens + ahead < limit for r in requests)
        go = room and (max_steps is None or launched < max_steps) and not (should_stop and should_stop())
        step = launch() if go else None
        launched += step is not None
        if pending is not None:
            yield commit_step(pending, only_unfinished=False)
            if any(r.finished for r in requests):
                if step is not None:  # already computed for everyone: commit it for those still running
                    yield commit_step(step, only_unfinished=True)
                return launched
        if step is None:
            return launched
        pending = step
