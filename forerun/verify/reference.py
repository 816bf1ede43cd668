"""Per-row reference implementations: plain Python loops in float64, the oracle of the tests.

Slow on purpose and written to be read next to the rules' docstrings in chain.py / tree.py. Inputs
are the same tensors as the batched functions; outputs are plain lists.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from .probs import SamplingTensors


def ref_probs(logits: Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """One row [V]: temperature, top-k, top-p, min-p, softmax (module docstring of probs.py)."""
    x = [float(v) for v in logits.double()]
    vocab = len(x)
    if temperature <= 0:
        best = max(range(vocab), key=lambda i: x[i])  # first index on ties
        return [1.0 if i == best else 0.0 for i in range(vocab)]
    x = [v / temperature for v in x]
    if 0 < top_k < vocab:
        kth = sorted(x, reverse=True)[top_k - 1]
        x = [v if v >= kth else -math.inf for v in x]
    if top_p < 1:
        p = _softmax(x)
        order = sorted(range(vocab), key=lambda i: p[i])  # ascending, stable
        cumulative = 0.0
        for i in order[:-1]:  # the most likely token is always kept
            cumulative += p[i]
            if cumulative <= 1 - top_p:
                x[i] = -math.inf
    if min_p > 0:
        p = _softmax(x)
        floor = min_p * max(p)
        x = [v if p[i] >= floor else -math.inf for i, v in enumerate(x)]
    return _softmax(x)


def _softmax(x: list[float]) -> list[float]:
    top = max(x)
    e = [math.exp(v - top) for v in x]
    total = sum(e)
    return [v / total for v in e]


def ref_sample(weights: list[float], u: float) -> int:
    """Inverse CDF over unnormalised weights: the first i with cumulative weight > u * total."""
    threshold = u * sum(weights)
    cumulative = 0.0
    for i, w in enumerate(weights):
        cumulative += w
        if w > 0 and cumulative > threshold:
            return i
    return max(i for i, w in enumerate(weights) if w > 0)


def _argmax(x: list[float]) -> int:
    return max(range(len(x)), key=lambda i: x[i])


def _entropy_threshold(p: list[float], epsilon: float, delta: float) -> float:
    entropy = -sum(v * math.log(v) for v in p if v > 0)
    return min(epsilon, delta * math.exp(-entropy))


@dataclass(frozen=True)
class RefOutcome:
    num_accepted: list[int]
    output_token_ids: list[list[int]]  # accepted tokens then the final token
    accepted_nodes: list[list[int]] | None = None  # trees: local path, root first


def _row_probs(logits: Tensor, sampling: SamplingTensors, req: int, row: int) -> list[float]:
    return ref_probs(logits[row], float(sampling.temperature[req]), int(sampling.top_k[req]),
                     float(sampling.top_p[req]), float(sampling.min_p[req]))


def ref_verify_chain(target_logits: Tensor, draft_token_ids: Tensor, ftp: Tensor, seqlens_q: Tensor,
                     sampling: SamplingTensors, uniforms: Tensor, draft_probs: Tensor | None = None,
                     rule: str = "auto", penalty: float = 5e-5, typical_epsilon: float = 0.09,
                     typical_delta: float = 0.3) -> RefOutcome:
    """Walk each request's rows in order; stop at the first rejected draft or at the last row."""
    accepted_counts, outputs = [], []
    for r in range(len(ftp)):
        greedy = rule == "greedy" or (rule == "auto" and float(sampling.temperature[r]) <= 0)
        out = []
        for j in range(int(seqlens_q[r])):
            row = int(ftp[r]) + j
            last = j == int(seqlens_q[r]) - 1
            if greedy:
                best = _argmax([float(v) for v in target_logits[row]])
                if last or int(draft_token_ids[row]) != best:
                    out.append(best)
                    break
                out.append(best)
                continue
            p = _row_probs(target_logits, sampling, r, row)
            u_accept, u_final = float(uniforms[row, 0]), float(uniforms[row, 1])
            if last:
                out.append(ref_sample(p, u_final))
                break
            x = int(draft_token_ids[row])
            if rule == "typical":
                if p[x] > _entropy_threshold(p, typical_epsilon, typical_delta):
                    out.append(x)
                    continue
                out.append(ref_sample(p, u_final))
                break
            q = [float(v) for v in draft_probs[row]]
            if u_accept * q[x] < p[x]:  # accept with probability min(1, p/q)
                out.append(x)
                continue
            alpha = math.exp(-penalty) if rule == "penalty" else 1.0
            residual = [max(pi - alpha * qi, 0.0) for pi, qi in zip(p, q)]
            out.append(ref_sample(residual if sum(residual) > 0 else p, u_final))
            break
        accepted_counts.append(len(out) - 1)
        outputs.append(out)
    return RefOutcome(accepted_counts, outputs)


def ref_verify_tree(target_logits: Tensor, node_token_ids: Tensor, parents: Tensor, ftp: Tensor,
                    seqlens_q: Tensor, sampling: SamplingTensors, uniforms: Tensor,
                    draft_probs: Tensor | None = None, rule: str = "greedy", threshold_single: float = 1.0,
                    threshold_acc: float = 1.0, draft_scheme: str = "with_replacement",
                    typical_epsilon: float = 0.09, typical_delta: float = 0.3) -> RefOutcome:
    """Walk each tree from the root, children in index order (SGLang's kernels, one request at a time)."""
    counts, outputs, paths = [], [], []
    for r in range(len(ftp)):
        base, n = int(ftp[r]), int(seqlens_q[r])
        children = {i: [c for c in range(1, n) if int(parents[base + c]) == i] for i in range(n)}
        token = {c: int(node_token_ids[base + c]) for c in range(1, n)}
        greedy = rule == "greedy" or (rule == "auto" and float(sampling.temperature[r]) <= 0)
        probs = lambda node: _row_probs(target_logits, sampling, r, base + node)  # noqa: E731
        if greedy:
            path, final = _walk_greedy(target_logits, base, children, token)
        elif rule == "typical":
            path, final = _walk_typical(probs, children, token, uniforms, base, typical_epsilon, typical_delta)
        elif rule == "target_only":
            path, final = _walk_target_only(probs, children, token, uniforms, base, threshold_single, threshold_acc)
        else:
            path, final = _walk_exact(probs, draft_probs, children, token, uniforms, base,
                                      draft_scheme == "without_replacement")
        counts.append(len(path) - 1)
        outputs.append([token[c] for c in path[1:]] + [final])
        paths.append(path)
    return RefOutcome(counts, outputs, paths)


def _walk_greedy(logits, base, children, token):
    path = [0]
    while True:
        best = _argmax([float(v) for v in logits[base + path[-1]]])
        match = [c for c in children[path[-1]] if token[c] == best]
        if not match:
            return path, best
        path.append(match[0])


def _walk_target_only(probs, children, token, uniforms, base, threshold_single, threshold_acc):
    path = [0]
    while True:
        node = path[-1]
        p, coin, prob_acc, rejected, chosen = probs(node), float(uniforms[base + node, 0]), 0.0, [], None
        for c in children[node]:
            prob_acc += p[token[c]]
            if p[token[c]] > 0 and (coin < prob_acc / max(threshold_acc, 1e-9) or p[token[c]] >= threshold_single):
                chosen = c
                break
            rejected.append(token[c])
        if chosen is None:
            residual = [0.0 if i in rejected else v for i, v in enumerate(p)]
            return path, ref_sample(residual if sum(residual) > 0 else p, float(uniforms[base + node, 1]))
        path.append(chosen)


def _walk_exact(probs, draft_probs, children, token, uniforms, base, without_replacement):
    path = [0]
    while True:
        node = path[-1]
        p, q, chosen = probs(node), [float(v) for v in draft_probs[base + node]], None
        for c in children[node]:
            x = token[c]
            if float(uniforms[base + c, 0]) * q[x] < p[x]:
                chosen = c
                break
            residual = [max(pi - qi, 0.0) for pi, qi in zip(p, q)]
            if sum(residual) > 0:
                p = [v / sum(residual) for v in residual]
            if without_replacement:
                q[x] = 0.0
                q = [v / sum(q) for v in q] if sum(q) > 0 else q
        if chosen is None:
            return path, ref_sample(p, float(uniforms[base + node, 1]))
        path.append(chosen)


def _walk_typical(probs, children, token, uniforms, base, epsilon, delta):
    """Score every root-to-node path: longest passing prefix, then log-likelihood, then lowest index."""
    best = (0, 0.0, 0)  # (depth, loglik, -index) of the root
    best_path, stack = [0], [([0], 0.0)]
    while stack:
        path, loglik = stack.pop()
        p = probs(path[-1])
        threshold = _entropy_threshold(p, epsilon, delta)
        for c in children[path[-1]]:
            if p[token[c]] > threshold:
                key = (len(path), loglik + math.log(p[token[c]]), -c)
                if key > best:
                    best, best_path = key, path + [c]
                stack.append((path + [c], key[1]))
    return best_path, ref_sample(probs(best_path[-1]), float(uniforms[base + best_path[-1], 1]))
