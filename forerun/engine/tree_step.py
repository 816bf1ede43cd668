"""One tree round: the draft model proposes a tree per request, the target scores every node in one
forward with a tree mask, `verify_tree` picks the accepted path, and the caches are put back in order.

Target cache: the round writes [missing committed tokens] + tree nodes; node i of the tree sits at cache
position root + i while its RoPE position is root + depth(i). The accepted path's keys were computed at
positions root + 1, root + 2, ... (depth = index on the path), so moving them to those cache positions
(`KVPool.move`) makes the cache exactly what a chain would have written; then it is truncated to
root + accepted + 1 (seed 003's invariant). The draft cache holds the committed prefix only.
"""
from __future__ import annotations

import time

import torch

from ..drafters.tree_drafter import TreeDrafter
from ..request import Request
from ..verify import SamplingTensors, verify_tree
from ..runtime.runner import Chunk, ModelRunner
from .spec_step import RoundResult


def tree_round(target: ModelRunner, drafter: TreeDrafter, requests: list[Request]) -> RoundResult:
    t0 = time.perf_counter()
    prop = drafter.propose_tree(requests)
    t1 = time.perf_counter()
    shape, kv = drafter.shape, target.kv
    n = shape.num_nodes
    mask = shape.mask()
    chunks = []
    for r, toks in zip(requests, prop.tokens):
        catch = r.all_tokens[kv.length(r.req_id):-1]  # committed tokens before the root that the cache lacks
        c = len(catch)
        root = r.num_tokens - 1
        full = torch.zeros(c + n, c + n, dtype=torch.bool)  # catch-up tokens causal; nodes see them + ancestors
        full[:c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
        full[c:, :c] = True
        full[c:, c:] = mask
        chunks.append(Chunk(r.req_id, catch + toks, positions=list(range(root - c, root)) + [root + d for d in shape.depth],
                            tree_mask=full, logits=n))
    out, starts = target.forward(chunks)
    t2 = time.perf_counter()
    logits = out.logits  # [R * n, V]: rows of request i are its tree nodes, root first
    device = logits.device
    num_req = len(requests)
    res = verify_tree(
        logits, torch.tensor([t for toks in prop.tokens for t in toks], device=device),
        torch.tensor(list(shape.parents) * num_req, device=device),
        torch.tensor(starts, device=device), torch.full((num_req,), n, device=device),
        SamplingTensors.from_params([r.params for r in requests], device),
        torch.cat([torch.rand(n, 2, generator=r.generator) for r in requests]).to(device),
        draft_probs=torch.cat(prop.probs).to(device), rule="auto",
    )
    num_acc = res.num_accepted.tolist()
    nodes = res.accepted_nodes.tolist()
    out_ids = res.output_token_ids.tolist()
    for r, a, path in zip(requests, num_acc, nodes):
        root = r.num_tokens - 1
        kv.move(r.req_id, [root + j for j in path[1 : a + 1]], [root + i for i in range(1, a + 1)])
        kv.truncate(r.req_id, root + a + 1)
        drafter.rollback(r, root + a + 1)
    depth = len(shape.levels) - 1
    return RoundResult([row[: a + 1] for row, a in zip(out_ids, num_acc)], [depth] * num_req, num_acc, None,
                       draft_step_seconds=(t1 - t0) / depth, target_seconds=t2 - t1,
                       target_tokens=sum(len(c.token_ids) for c in chunks))
