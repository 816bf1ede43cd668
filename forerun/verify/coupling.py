"""Position-keyed Gumbel-max coupling: seeded sampling whose output does not depend on k, trees or batching.

Rejection sampling is exact, but WHICH token it emits at a position depends on what was drafted there
(and so on k, the tree shape, the drafter, timing-driven adaptive k): the same seed gives different text
for different k. The Gumbel-max coupling fixes the token of every position by noise keyed on
(seed, absolute position) alone:

    target token at position n:   argmax_v  log p_n(v) + g(seed, n, v)
    draft token at position n:    argmax_v  log q_n(v) + g(seed, n, v)      (the same g)
    a draft is accepted iff it equals the target's token at its position.

Exactness: with g(seed, n, .) i.i.d. standard Gumbel, argmax(log p + g) is distributed as p (the
Gumbel-max trick). The noise of position n is independent of the noise of earlier positions, which alone
decided the prefix, so each token is distributed as p(. | prefix): the output is distributed exactly as
plain sampling with p. The drafts only decide how many target tokens one forward confirms, never which
tokens, so the output is a function of (prompt, seed) only. Verification is the greedy rule applied to
the perturbed scores log p + g (and the draft proposes greedily on log q + g). Acceptance is
P(argmax(log q + g) = argmax(log p + g)) <= 1 - TV(p, q), the optimum that rejection sampling reaches;
benchmarks/coupling.py measures the gap on real drafts.

The noise is a counter-based hash (no generator state), computed the same way on CPU and CUDA: 32-bit
`lowbias32` mixing (Wellons) of (seed, position, token), evaluated in int64 without overflow.
"""
from __future__ import annotations

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF


def _mul32(x: Tensor | int, c: int) -> Tensor | int:
    """(x * c) mod 2^32 for 0 <= x < 2^32 without int64 overflow: split x into 16-bit halves."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + ((hi * c) & 0xFFFF) * 65536) & _M32


def _mix32(x: Tensor | int) -> Tensor | int:
    """lowbias32: a 32-bit integer hash with good avalanche (x in [0, 2^32))."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_key(seed: int, position: int) -> int:
    """A 32-bit key for (seed, absolute position); seed may use 64 bits."""
    s = int(seed) & ((1 << 64) - 1)
    k = _mix32((s & _M32) ^ 0x9E3779B9)
    k = _mix32(k ^ ((s >> 32) & _M32))
    return _mix32(k ^ (int(position) & _M32))


def gumbel_noise(keys: Tensor, vocab: int) -> Tensor:
    """[N, vocab] float32 standard Gumbel noise; row i is a pure function of keys[i] (int64 [N] in [0, 2^32))."""
    tok = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    h = _mix32(keys.to(torch.int64).unsqueeze(1) ^ _mul32(tok, 0x2C1B3C6D).unsqueeze(0))  # [N, V]
    h = _mix32(h ^ 0x68E31DA4)
    u = (h.to(torch.float64) + 0.5) * (1.0 / 4294967296.0)  # (0, 1)
    return (-torch.log(-torch.log(u))).to(torch.float32)


def coupled_scores(probs: Tensor, keys: Tensor) -> Tensor:
    """log(probs) + g: the scores whose argmax is the coupled token. probs [N, V] (after the shared transform:
    tokens it removed get -inf and can never win); keys [N] from row_key."""
    return probs.float().log() + gumbel_noise(keys, probs.shape[-1])


def keys_for(seed: int, first_position: int, count: int, device: torch.device | str | None = None) -> Tensor:
    """Keys of `count` consecutive positions first_position, first_position + 1, ... as int64 [count]."""
    from ..devices import h2d

    return h2d([row_key(seed, first_position + j) for j in range(count)], device, torch.int64)
