"""Which k each request drafts this round: fixed, or adaptive from acceptance and measured costs (seed 003).

Adaptive k maximises expected tokens per second for each request,

    E[tokens](a, k) / (t_target(tokens in the verify batch) + k * t_draft_step)

with E[tokens] = (1 - a^(k+1)) / (1 - a), a the request's running acceptance estimate, t_target a linear
interpolation of measured target-forward time against the number of tokens it processed, and t_draft_step the
measured time of one draft step. When verifying k+1 tokens costs the same as one (t_target flat) this is
seed 003's speedup (1 - a^(k+1)) / ((1 - a)(1 + k c)), c = t_draft_step / t_target. k = 0 (plain decoding)
wins when acceptance is low, drafting is expensive, or the batch is large enough that extra verify
tokens are no longer free (compute-bound decode).

With CUDA graphs the batch drafts one k (`batch_k`), and what speculative rounds really deliver is checked
against the model: the committed tokens per request per second of recent rounds that drafted (prefill chunks of
joining requests, host work and stalls included, which the model does not see) against plain decoding's
measured step; drafting that realizes less is overruled until the next probe, and its shortfall against the model
still prices drafting after it (`_batch_remembered`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..config import SpecConfig
from ..stats import expected_tokens_per_round


def _bucket(n: int) -> int:
    """n rounded up to a power of two (batch-size buckets)."""
    return 1 << max(0, n - 1).bit_length()


def _median(xs, empty: float = 0.0) -> float:
    """The median of recent timings (one slow outlier, a compile or a catch-up, must not steer k), else `empty`."""
    if not xs:
        return empty
    xs = sorted(xs)
    return xs[len(xs) // 2]


@dataclass
class AcceptanceEstimate:
    """Acceptance per draft position, conditional on reaching it, with exponential forgetting and a prior.

    Drafts are not accepted independently: once the first is accepted the next ones usually are too (on
    the Qwen2.5-Coder pair: 0.83 for the first, then 0.93, 0.92, 0.96 given the ones before). So position i
    keeps its own rate a_i = accepted_i / tested_i, and a round of k drafts is worth
    E[tokens] = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k (seed 003's (1 - a^(k+1)) / (1 - a) when all a_i = a).
    A round that accepts m of k drafts tested positions 1 .. min(m + 1, k) and accepted 1 .. m."""

    prior: float = 0.6
    prior_weight: float = 1.0
    decay: float = 0.95
    accepted: list[float] = field(default_factory=list)
    tested: list[float] = field(default_factory=list)
    # a pooled estimate (the engine-wide one) whose current rates are the priors (instead of `prior`): a
    # request's estimate shrinks towards what the drafter does now for every request, not when it arrived
    pool: "AcceptanceEstimate | None" = None
    # expected_tokens_upto's last answer and its inputs (this estimate's version, k, the pool's rates): batch_k asks
    # for every request each round, and most have not changed since (k = 0 rounds update nothing)
    _version: int = field(default=0, repr=False, compare=False)
    _memo: tuple | None = field(default=None, repr=False, compare=False)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self._version += 1
        while len(self.tested) < drafted:
            self.tested.append(0.0)
            self.accepted.append(0.0)
        for i in range(len(self.tested)):
            self.tested[i] *= self.decay
            self.accepted[i] *= self.decay
        for i in range(min(accepted + 1, drafted)):
            self.tested[i] += 1.0
            self.accepted[i] += float(i < accepted)

    def rate(self, i: int) -> float:
        """Conditional acceptance of draft position i (0-based)."""
        return self.rates(i + 1)[i]

    def expected_tokens(self, k: int) -> float:
        return self.expected_tokens_upto(k)[k]

    def rates(self, n: int, pool_rates: list[float] | None = None) -> list[float]:
        """rate(i) for i in 0..n-1 in one pass (the pool's rates computed once, not once per position).
        pool_rates: the pool's rates(n) when the caller has them (one batch of requests shares one pool)."""
        prior = (pool_rates if pool_rates is not None else self.pool.rates(n)) if self.pool is not None \
            else [self.prior] * n
        out = []
        for i in range(n):
            if i < len(self.tested):
                out.append((self.accepted[i] + prior[i] * self.prior_weight) / (self.tested[i] + self.prior_weight))
            elif self.tested and self.pool is None:  # never drafted this far: like the deepest position seen
                out.append(out[-1])
            else:  # ... or, with a pool, the pool's rate
                out.append(prior[i])
        return out

    def expected_tokens_upto(self, k: int, pool_rates: list[float] | None = None) -> list[float]:
        """E[tokens] of a round drafting 0, 1, .., k tokens. (The caller must not modify the list.)"""
        key = (self._version, k, None if pool_rates is None else tuple(pool_rates))
        if self._memo is not None and self._memo[0] == key and (pool_rates is not None or self.pool is None):
            return self._memo[1]
        out, reach = [1.0], 1.0
        for a in self.rates(k, pool_rates):
            reach *= a
            out.append(out[-1] + reach)
        self._memo = (key, out)
        return out

    @property
    def alpha(self) -> float:
        """All positions pooled: accepted / tested."""
        tested = sum(self.tested)
        return (sum(self.accepted) + self.prior * self.prior_weight) / (tested + self.prior_weight)


@dataclass
class CostModel:
    """Measured seconds: target forwards by the number of tokens they process (recent calls), draft steps as a mean."""

    target_obs: deque = field(default_factory=lambda: deque(maxlen=64))
    draft_obs: deque = field(default_factory=lambda: deque(maxlen=64))
    overhead_obs: deque = field(default_factory=lambda: deque(maxlen=64))
    round_obs: deque = field(default_factory=lambda: deque(maxlen=64))
    # draft steps by the batch they drafted for (next power of two): a step of the 0.6B draft costs ~1 ms for one
    # request and ~2 ms for 64 on the H200; one number learned at 64 requests made drafting look twice as dear in
    # the small batches that followed (run 44)
    draft_by_batch: dict = field(default_factory=dict)

    # the medians and piecewise-linear points, with the observations they were computed from (all of them: a key of
    # length, first and last went stale when a full deque evicted a value equal to its successor, e.g. repeated
    # clipped 0.0 overheads): the k policy asks for them several times a round (at 64 requests batch_k spent
    # ~0.5 ms of host time per call recomputing them on this CPU), new observations arrive at most once a round
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _cached(self, name: str, obs: deque, compute):
        key = tuple(obs)
        hit = self._memo.get(name)
        if hit is None or hit[0] != key:
            hit = self._memo[name] = (key, compute())
        return hit[1]

    def record_target(self, tokens: int, seconds: float) -> None:
        self.target_obs.append((tokens, seconds))

    def timed(self, tokens: int) -> bool:
        """Whether a recent target forward processed exactly this many tokens (else target_time interpolates)."""
        return any(x == tokens for x, _ in self.target_obs)

    def record_draft_step(self, seconds: float, batch: int | None = None) -> None:
        """One draft step's seconds; batch: the requests it drafted for (None: unknown, kept in the pooled record
        only)."""
        self.draft_obs.append(seconds)
        if batch:
            self.draft_by_batch.setdefault(_bucket(batch), deque(maxlen=32)).append(seconds)

    def _target_points(self) -> list[tuple[int, float]]:
        """The median measured time at each token count seen (timings are noisy), never decreasing with the count."""
        by: dict[int, list[float]] = {}
        for x, y in self.target_obs:
            by.setdefault(x, []).append(y)
        pts, top = [], 0.0
        for x, ys in sorted(by.items()):
            top = max(top, _median(ys))
            pts.append((x, top))
        return pts

    def target_time(self, tokens: int) -> float:
        """Piecewise linear through the median measured time at each token count seen (a forward costs about the
        same up to some count, then grows: a straight-line fit gets both ends wrong); beyond the counts seen, the
        nearest segment's slope."""
        if not self.target_obs:
            return 1.0
        pts = self._cached("target", self.target_obs, self._target_points)
        if len(pts) == 1:
            return max(pts[0][1], 1e-6)
        if tokens <= pts[0][0]:  # below what was seen: the first segment's slope (at least half the time seen)
            (x0, y0), (x1, y1) = pts[0], pts[1]
            return max(y0 - max(0.0, (y1 - y0) / (x1 - x0)) * (x0 - tokens), 0.5 * y0, 1e-6)
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if tokens <= x1:
                return max(y0 + (y1 - y0) * (tokens - x0) / (x1 - x0), 1e-6)
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return max(y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (tokens - x1), 1e-6)

    def target_floor(self, tokens: int) -> float:
        """The least a forward of `tokens` tokens can cost by what was timed: the time of the largest count timed at
        or below it (more tokens never cost less); target_time where none was."""
        pts = [y for x, y in self._cached("target", self.target_obs, self._target_points) if x <= tokens]
        return pts[-1] if pts else self.target_time(tokens)

    def draft_step_time(self, batch: int | None = None) -> float:
        """The median recent draft step (a mean let two slow outliers keep k at 0 on the CPU pair); with a batch
        size, the steps timed at that batch's bucket, else at the nearest bucket timed, else all of them."""
        timed = {b: o for b, o in self.draft_by_batch.items() if len(o) >= self.DRAFT_BUCKET_MIN}
        if batch and timed:
            want = _bucket(batch).bit_length()
            near = min(timed, key=lambda b: (abs(b.bit_length() - want), -b))  # (a tie: the larger, dearer one)
            obs = timed[near]
            return self._cached(f"draft{near}", obs, lambda: _median(obs))
        return self._cached("draft", self.draft_obs, lambda: _median(self.draft_obs))

    DRAFT_BUCKET_MIN = 3  # steps a batch-size bucket needs before it prices rounds (one outlier must not steer k)

    # the drafter reading prompt chunks (tokens, seconds): timed where the host waits for it (the CPU path)
    feed_obs: deque = field(default_factory=lambda: deque(maxlen=32))

    def record_draft_feed(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.feed_obs.append((tokens, seconds))

    def draft_feed_per_token(self) -> float | None:
        """Seconds per token of the drafter reading tokens it lacks (recent feeds: their seconds over their tokens,
        so long reads weigh as much as they cost), None until timed. (Not a median of per-feed ratios: most feeds are
        1-2-token catch-ups whose fixed cost per forward, ~25 ms for the 0.5B draft on this CPU, put a prompt's read
        at ~14 ms a token, ten times what it costs.)"""
        if not self.feed_obs:
            return None
        return self._cached("feed", self.feed_obs,
                            lambda: sum(s for _, s in self.feed_obs) / sum(t for t, _ in self.feed_obs))

    def record_spec_overhead(self, seconds: float) -> None:
        """A speculative round's wall time beyond its target forward and draft steps (host work: verification
        inputs, the host read of the verdict, rollback, commit). Plain decoding hides its own host work by
        overlapping steps (engine/overlap.py), so only rounds with drafts pay this."""
        self.overhead_obs.append(max(0.0, seconds))

    def record_round_overhead(self, seconds: float) -> None:
        """Without overlapped decoding (the CPU): every round's wall time beyond its target forward and draft
        steps (scheduling, sampling, commit, detokenization). Plain decoding pays it per token, a speculative
        round once for several: leaving it out made k = 0 look best on the CPU pair while k = 4 ran 1.2x faster."""
        self.round_obs.append(max(0.0, seconds))

    def round_overhead(self) -> float:
        return self._cached("round", self.round_obs, lambda: _median(self.round_obs))

    def spec_overhead(self) -> float:
        """The median recent overhead: one round that waited on a kernel compile or a graph capture measured
        1.1-1.2 s on the H200, and in a mean it kept adaptive k at 0 for the next 64 rounds."""
        return self._cached("overhead", self.overhead_obs, lambda: _median(self.overhead_obs))

    def round_seconds(self, tokens: int, k: int, batch: int | None = None, floor: bool = False) -> float:
        """Predicted wall time of a round whose target forward processes `tokens` tokens after k draft steps (for
        `batch` requests: the draft step timed at that batch size). floor: its forward at `target_floor`."""
        return (self.target_floor(tokens) if floor else self.target_time(tokens)) + k * self.draft_step_time(batch) \
            + (self.spec_overhead() if k else 0.0) + self.round_overhead()


# choose_k: where a forward of 2 tokens a request was never timed (its cost a guess on the line between the counts
# timed), k = 1 is tried when it would beat plain decoding at the guess's floor (`CostModel.target_floor`: the time
# of the largest count timed below, e.g. 1 token a request; more tokens never cost less): the round times it, and
# the model decides on a measured cost from then on. A try costs one round. Measured on the Zen 3 pair (session
# 38): the first rounds timed forwards of 1 and 5 tokens, the line between them priced 2 tokens at 50 ms where they
# cost 45 (1.08x one token), so k = 1 lost by 2 % on paper and adaptive k decoded plainly from the third round of
# the first request on (6 prompts: 18.8 tok/s against 21.3 for a fixed k = 1). Session 38 tried k = 1 only where it
# lost by less than 10 % on the line; on the Zen 2 int4 pair (session 59: 1 and 5 tokens at 46.8 and 103.7 ms, the
# line's 61 ms for 2 where they cost ~55) it lost by 12 % after one rejected first round, and adaptive k ran at
# 0.96x plain where k = 1 ran at 1.20x (`benchmarks/adaptive_short_cpu.py`).
def choose_k(acceptance: "float | AcceptanceEstimate", k_max: int, batch_size: int, cost: CostModel) -> int:
    """The k in 0..k_max with the most expected tokens per second, the round being shared by batch_size
    requests that each verify k + 1 tokens (so extra verify tokens get dearer as the batch grows).
    acceptance: one rate for every position (seed 003's model) or per-position estimates. k = 1 instead of 0 where
    its round's cost is a guess and k = 1 wins at the guess's floor (see above)."""
    expected = acceptance.expected_tokens_upto(k_max) if isinstance(acceptance, AcceptanceEstimate) else \
        [expected_tokens_per_round(acceptance, k) for k in range(k_max + 1)]
    best_k, best, rates = 0, 0.0, []
    for k in range(k_max + 1):
        seconds = cost.round_seconds(batch_size * (k + 1), k, batch_size)
        rates.append(expected[k] / seconds)
        if rates[-1] > best * 1.0001:
            best_k, best = k, rates[-1]
    if best_k == 0 and k_max >= 1 and not cost.timed(2 * batch_size) \
            and expected[1] / cost.round_seconds(2 * batch_size, 1, batch_size, floor=True) > best:
        return 1
    return best_k


class KPolicy:
    def __init__(self, spec: SpecConfig) -> None:
        self.spec = spec
        self.cost = CostModel()
        self.estimates: dict[int, AcceptanceEstimate] = {}
        self.overall = AcceptanceEstimate(decay=0.99)  # across requests: the prior of a new request
        # ks (no CUDA graphs): the drafts of a request's first round (a prompt's last chunk), which guess the
        # answer's first token, across requests (`FIRST_DECAY`); they go neither into the request's estimate nor
        # into `overall`. A request is in its first round while it has no estimate of its own; `_first_asked`: the
        # requests ks decided a first round for (observe routes their next round here); `_first_skips`: first
        # rounds given k = 0 since the last one that drafted (every PROBE_EVERY-th drafts one token, to notice a
        # draft that now agrees)
        self.first = AcceptanceEstimate(decay=self.FIRST_DECAY)
        self._first_asked: set[int] = set()
        self._first_skips = 0
        self.idle_rounds: dict[int, int] = {}  # rounds since the request last drafted (adaptive k = 0)
        self.probe_every: dict[int, int] = {}  # per request: idle rounds before the next probe (backs off)
        self.probing: set[int] = set()  # requests whose current round is a probe
        # where a new request starts its probe interval: the last probe outcome of any request (a useless
        # drafter stays backed off for short requests too, instead of each paying its early probes again)
        self.default_probe_every = self.PROBE_EVERY
        # batch_k (CUDA graphs): the same probing, for the batch as a whole
        self.batch_mode, self.batch_idle, self.batch_probe_every, self.batch_probing = False, 0, self.PROBE_EVERY, False
        self.batch_trial: int | None = None  # k > 0 rounds since the last probe, while its outcome is open
        # batch_k: what speculative rounds really delivered, per batch-size bucket (next power of two):
        # (committed tokens per request, wall seconds) of recent rounds that drafted
        self.realized: dict[int, deque] = {}
        self.vetoes = 0  # rounds where the realized rate overruled the cost model's k > 0
        # ks with lags (the CPU path): batch-size bucket -> [plain rounds left to sit out, the wait] after a veto
        self._held: dict[int, list[int]] = {}
        # ks with lags: batch-size bucket -> (the realized rate, tokens per second per request, of the last trial the
        # veto ended; self._ks_calls then), for VETO_MEMORY of its waits (`_held`) or until a trial passes: what
        # catch_up_pays weighs reads against
        self._vetoed_rate: dict[int, tuple[float | None, int]] = {}
        self._ks_calls = 0  # ks calls with lags (the CPU path): the clock VETO_MEMORY counts in
        # batch_k: batch-size bucket -> (what the trial a veto ended realized over what the model predicted, both as
        # ratios to plain decoding; batch_k calls then; for how many calls it is remembered): see `_batch_remembered`
        self._batch_vetoed: dict[int, tuple[float, int, int]] = {}
        self._bk_calls = 0
        # the last vetoes' inputs (batch size, realized and plain rates per request, plain's predicted step, the
        # target cost points it came from): what benchmarks/online.py reports for a run that went plain
        self.veto_log: deque = deque(maxlen=8)
        # overlapped sessions (CUDA graphs), drafting (True) or plain (False): (seconds a start cost beyond a steady
        # step, tokens the session committed) of recent sessions, and the last steady step seen
        # per batch-size bucket: how often joins end sessions depends on the batch (64 requests: every round or two)
        self.sessions: dict[tuple[bool, int], deque] = {}
        self._steady: dict[tuple[bool, int], float] = {}
        # ks (no CUDA graphs): plain rounds run to time the plain step a k > 0 decision is weighed against, per batch
        # size (plain_checks: how many; _plain_asked: the round counter when the last one was asked)
        self.plain_checks: dict[int, int] = {}
        self._plain_asked: dict[int, int] = {}
        self._rounds = 0
        # ordinary rounds (no CUDA graphs) in which n requests decoded plainly, no prompt read: their wall seconds,
        # per exact n (a CPU forward of 3 rows costs less than one of 4), the plain step the veto weighs against
        self.plain_rounds: dict[int, deque] = {}

    # ks: a prompt's last round drafts the answer's first token, where a draft and its target disagree more than
    # anywhere after (the Qwen2.5-Coder pair on the bench prompts: the 0.5B opens with "Here" or "To", the 1.5B
    # with "```", in every prompt; later positions 0.92-0.96). Counted with the rest, each rejected first draft
    # cost a round of k draft steps (30-60 ms on the Zen 2, 1-2 % of a 48-token answer), pulled the request's
    # estimate down and put a round drafting at a loss in the veto's window. Their own estimate forgets at this
    # rate per observation (one per request)
    FIRST_DECAY = 0.9
    PROBE_EVERY = 16  # with k = 0 chosen this many rounds in a row, draft one token to re-measure acceptance
    PROBE_MAX = 256  # a probe that is rejected doubles the interval up to this; an accepted one resets it
    # batch_k (CUDA graphs): the same, up to this many plain rounds (times the batch factor below). A batch probe
    # ends the overlapped session, catches the draft up on every token since it last ran and starts two sessions:
    # with a useless draft on the H200 (8B shape, 1-8 requests, Poisson 10/s) each cost 8-17 ms beyond the plain
    # step it replaced, and one every 256 rounds (~1.1 s) cost 1-2 % of the time per token (run 51). At 1024 it
    # is < 0.5 %, and a draft that turns useful again is found within ~4 s of decoding there
    BATCH_PROBE_MAX = 1024
    PROBE_HOLD = 8  # batch_k: a probe is accepted when drafting then lasts this many rounds
    # batch_k: the plain rounds between probes grow with the batch, by a factor of batch size / PROBE_BATCH. A probe
    # first feeds the draft model every token each request got while it did not draft (an eager catch-up whose
    # cost grows with the batch: ~20-30 ms at 64 requests on the H200), while a plain round barely grows (4.4 ms
    # at 1 request, 5.7 ms at 64); with a useless draft at 32-64 requests the probes cost 2-4 % of the time
    PROBE_BATCH = 8
    # batch_k: from plain decoding (or right after a probe) drafting starts only when the model predicts more than
    # (1 + SWITCH_MARGIN) x plain's rate. Each switch on costs the draft's catch-up over every token it missed, and
    # drafting spreads the steps at which requests finish (more join rounds), none of which the model sees; at
    # a = 0.6 with 8-64 requests (H200 run 23: 0.78-0.96x plain) the policy switched on and off near break-even.
    # 0 (off) until measured on the H200: `benchmarks/online.py --gpu --switch-margin 0.2 ...`
    SWITCH_MARGIN = 0.0
    # batch_k: a session's start is dearer than a steady step, and a drafting session's much more so (the draft
    # catches up on every newcomer's prompt; nothing overlaps the first round). Sessions end at every join, so at
    # many requests with spread finishes they last a round or two: on the H200 at 64 requests a start cost ~19 ms
    # beyond a 6 ms round, 156 us per token drafted against plain decoding's 91 us per token. batch_k adds this
    # cost per token (recent sessions of the same mode as the one before them: a switch from plain decoding, whose
    # catch-up spans the whole plain stretch, is SWITCH_MARGIN's concern) to each mode's round.
    SESSION_WINDOW = 16
    SESSION_MIN = 2  # sessions of a mode before their start cost counts

    def record_session(self, spec: bool, requests: int, first: float, steady: float | None, tokens: int,
                       same_mode: bool) -> None:
        """An overlapped session of `requests` requests ended: its first step took `first` seconds, its later steps
        `steady` (median; None: it had none, the last steady step of this mode and batch size stands in), and it
        committed `tokens` tokens. same_mode: the session before it was of the same mode (else it is a switch,
        not recorded)."""
        key = (spec, self._bucket(requests))
        if steady is not None:
            self._steady[key] = steady
        steady = self._steady.get(key) if steady is None else steady
        if same_mode and steady is not None and tokens > 0:
            self.sessions.setdefault(key, deque(maxlen=self.SESSION_WINDOW)).append((max(0.0, first - steady), tokens))

    def _starts_measured(self, spec: bool, requests: int) -> bool:
        return len(self.sessions.get((spec, self._bucket(requests)), ())) >= self.SESSION_MIN

    def restart_per_token(self, spec: bool, requests: int) -> float:
        """Seconds of session starts per committed token, drafting or plain, at this batch size (0 until
        SESSION_MIN sessions)."""
        obs = self.sessions.get((spec, self._bucket(requests)), ())
        if len(obs) < self.SESSION_MIN:
            return 0.0
        # a start that waited on a graph capture, a kernel compile or a GC pause is left out, as in realized_rate
        cut = self.OUTLIER * _median([o[0] / o[1] for o in obs])
        kept = [o for o in obs if o[0] / o[1] <= cut] or list(obs)
        return sum(o[0] for o in kept) / max(1, sum(o[1] for o in kept))

    REALIZED_WINDOW = 32  # batch_k: recent speculative rounds whose realized rate is compared with plain decoding
    REALIZED_MIN = 8  # ... once there are this many since the last probe
    # drafting is overruled when it realizes less than this times plain's rate over the same rounds. Not below 1:
    # the comparison favours plain decoding (its host work in pure rounds is not counted), and on the H200 a margin
    # of 0.95 let adaptive k run at 0.94x plain at 16 requests (rounds realizing 0.95-1.0x plain's step)
    REALIZED_MARGIN = 1.0
    OUTLIER = 20.0  # a round longer than this many median rounds (a kernel compile) is left out of the rate

    _bucket = staticmethod(_bucket)

    def _batch_probe_wait(self, n: int) -> int:
        """Plain rounds before the batch probes, at batch size n (see PROBE_BATCH)."""
        return self.batch_probe_every * max(1, n // self.PROBE_BATCH)

    def record_realized(self, requests: int, tokens: int, seconds: float, plain: tuple[float, float] | None = None) -> None:
        """A speculative round of `requests` requests committed `tokens` tokens in `seconds` of wall time,
        everything included: host work, the draft's catch-up over new prompts, stalls, a new prompt's prefill.
        The cost model sees only the kernels of pure verify rounds and can miss these. (Not the first look of a
        session that switches drafting on after plain decoding: its catch-up over the plain stretch is paid once,
        and the engine leaves it out.)
        plain: (tokens, seconds) that plain decoding would have given in the same round, for a round carrying a
        new prompt's prefill (plain pays that prefill too: the engine passes the round minus its drafting and
        its extra verify rows); None for a pure round: one token per request in plain's predicted step."""
        if requests > 0 and seconds > 0:
            p = None if plain is None else (plain[0] / requests, max(plain[1], 1e-9))
            self.realized.setdefault(self._bucket(requests), deque(maxlen=self.REALIZED_WINDOW)).append(
                (tokens / requests, seconds, p))

    def _kept(self, requests: int) -> list[tuple] | None:
        """Recent speculative rounds at this batch size, rounds over OUTLIER x the median left out (None: too few
        rounds since the last probe)."""
        obs = self.realized.get(self._bucket(requests))
        if not obs or len(obs) < self.REALIZED_MIN:
            return None
        cut = self.OUTLIER * _median([o[1] for o in obs])
        return [o for o in obs if o[1] <= cut]

    def realized_rate(self, requests: int, pure: bool = False) -> float | None:
        """Tokens per second per request that speculative rounds realized at this batch size (None: too few
        rounds since the last probe). Rounds over OUTLIER x the median are left out. pure: only the rounds that
        carried no prompt's prefill (None without one), a rate to set against plain's seconds per token; with them
        the rate is only comparable to `plain_rate`, which prices each such round by its own plain equivalent."""
        kept = self._kept(requests)
        if kept is not None and pure:
            kept = [o for o in kept if o[2] is None] or None
        if kept is None:
            return None
        return sum(o[0] for o in kept) / sum(o[1] for o in kept)

    PLAIN_ROUNDS_MIN = 3  # plain rounds at a batch size before their mean is its plain step
    # _timed_plain_step: "mean" (rounds over OUTLIER x the median left out, as realized_rate treats drafting's rounds)
    # or "median" (the rule before session 61). The veto sets drafting's realized
    # rate, total tokens over total seconds, against plain's step: a median there compares a mean with a median.
    # Round times lean right (Zen 2, 1 request, int4 pair: plain rounds' mean 1.04-1.05x their median, a few at
    # 1.5-1.9x), so drafting had to realize ~1.10x plain to pass REALIZED_MARGIN_LAGGED's 1.05, and k = 1 rounds that
    # gave 1.07x per prompt were vetoed at a measured 1.0499x (adaptive 0.98x plain, k = 1 1.06x, session 60)
    PLAIN_STEP_STAT = "mean"

    def record_plain_round(self, requests: int, seconds: float) -> None:
        """An ordinary round (the path without CUDA graphs) in which `requests` requests each decoded one token and
        nothing else ran, from scheduling to commit: what plain decoding realizes, host work included."""
        if requests > 0 and seconds > 0:
            self.plain_rounds.setdefault(requests, deque(maxlen=self.REALIZED_WINDOW)).append(seconds)

    def _timed_plain_step(self, requests: int) -> float | None:
        """Seconds per plain round timed at exactly this batch size, the mean of those within OUTLIER x their median
        (PLAIN_STEP_STAT; None: fewer than PLAIN_ROUNDS_MIN)."""
        timed = self.plain_rounds.get(requests)
        if timed is None or len(timed) < self.PLAIN_ROUNDS_MIN:
            return None
        med = _median(timed)
        if self.PLAIN_STEP_STAT == "median":
            return med
        kept = [t for t in timed if t <= self.OUTLIER * med]
        return sum(kept) / len(kept)

    def plain_step(self, requests: int) -> float | None:
        """Plain decoding's step at this batch size, from measurements: the steady step of plain overlapped sessions
        at this batch size when one ran (what plain decoding realizes, host work overlapped), else the mean of the
        plain ordinary rounds at this batch size (`record_plain_round`, the path without graphs), else the cost model's
        forward of `requests` tokens when it has seen a forward of no more tokens than that. None: neither. Below
        the counts it has seen the cost model extrapolates the verify forwards' slope, which at many requests
        (verify forwards of 174+ tokens, compute-bound) put a 52-request decode step at 3.75 ms against the 6.24 ms
        plain sessions took: vetoes on that estimate sent a = 0.8 at 64 requests to plain decoding at 0.79-0.96x
        plain on the H200 (runs 36-38)."""
        steady = self._steady.get((False, self._bucket(requests)))
        if steady is not None:
            return steady
        timed = self._timed_plain_step(requests)
        if timed is not None:
            # the plain rounds at exactly this batch size, where they ran. The cost model's forward plus
            # its round overhead (a median over every round, drafting ones included, whose host work is larger)
            # put a 2-request plain round on this CPU at 57 ms where they took 51: drafting that realized 31 ms a
            # token against plain's 25.5 looked close to plain's estimated 28.5, trials passed the veto by chance
            # and adaptive k ran at 0.82x plain (seventeenth session)
            return timed
        if any(x <= requests for x, _ in self.cost.target_obs):
            # (+ a round's host work where rounds are not overlapped: the CPU path records it, plain pays it too)
            return self.cost.target_time(requests) + (self.cost.round_overhead() if self.cost.round_obs else 0.0)
        return None

    def plain_rate(self, requests: int) -> float:
        """What plain decoding would have realized giving the same tokens as the same rounds: a pure round's t tokens
        per request take it t steps (`plain_step`); a round that prefilled a new prompt takes it the round's own
        plain equivalent (f tokens per request in s seconds) plus a step for each of the t - f tokens beyond.
        (Counted as one plain step per round, pure rounds weighed ~1/3 of what they stand for at 2-3 tokens a
        round, so a prompt's prefill in the window pulled plain's rate down ~2x more than drafting's: on this CPU
        at 2 requests, drafting that realized 0.98x plain's step passed the veto's 1.05 margin; eighteenth
        session.)"""
        kept = self._kept(requests) or []
        step = self.plain_step(requests) or self.cost.target_time(requests)
        tokens = seconds = 0.0
        for t, _, p in kept:
            tokens += t
            if p is None:
                seconds += t * step
            else:
                f, s = p
                seconds += s + (t - f) * step if t >= f else s * t / max(f, 1e-9)
        return tokens / seconds if seconds > 0 else 1.0 / step

    # ks (the CPU path, a separate draft): drafting must realize this much more than plain decoding. Its rounds leave
    # out the draft's catch-up at each trial's start and its reads of new prompts (priced apart, by catch_up_pays),
    # so drafting that only matches plain loses: at 2 requests on this CPU, trials that realized about plain's rate
    # kept adaptive k drafting half the tokens at 0.92-1.10x plain (median 0.965x, seventeenth session)
    REALIZED_MARGIN_LAGGED = 1.05

    def _overruled(self, n: int, margin: float | None = None) -> bool:
        """Whether speculative rounds at this batch size realize less than `margin` (default REALIZED_MARGIN) times
        what plain decoding would over the same rounds (plain_rate). Not without a measured plain step
        (`plain_step`): an extrapolated one overrules drafting that pays."""
        rate = self.realized_rate(n)
        margin = self.REALIZED_MARGIN if margin is None else margin
        return rate is not None and self.plain_step(n) is not None and rate < margin * self.plain_rate(n)

    def catch_up_pays(self, req_id: int, lag: int, remaining: int, n: int, k: int | None = None,
                      optimistic: bool = False) -> bool:
        """Whether drafting k tokens a round (None: the best k) for this request, in a batch of n, saves more over its
        `remaining` tokens than the draft's reading the `lag` tokens its cache lacks costs (its prompt, or a
        stretch of plain decoding): remaining x (plain's seconds per token - drafting's) > lag x the draft's
        measured seconds per fed token. True until a feed is timed, and for a lag a round can leave behind.
        optimistic: drafting's rate from the prior acceptance (a probe asks whether a typical draft would repay its
        catch-up, whatever this one did before). On this CPU with int4 weights a 0.5B draft reads a prompt at
        ~40 % of the 1.5B target's cost (140 ms), and at 2 requests drafting saved ~1.3 ms per token: a 32-token
        answer lost ~100 ms to every prompt the draft read (adaptive 0.89x plain, fourteenth session)."""
        per_token = self.cost.draft_feed_per_token()
        if per_token is None or lag <= self.spec.max_draft_tokens + 2:
            return True
        held = self._held.get(self._bucket(n))
        if held is not None and held[0] > 0:  # the batch size sits out a veto: nothing drafts, a read now is
            return False  # paid for nothing (the request catches up when drafting pays again, priced then)
        kmax = max(1, self.spec.k_max)
        # (not made here: a request without an estimate is in its first round, see ks; a prompt read in chunks
        # is priced at every chunk)
        est = AcceptanceEstimate() if optimistic else self.estimates.get(req_id) or self._new_estimate()
        expected = est.expected_tokens_upto(kmax, None if optimistic else self.overall.rates(kmax))
        t_plain = self.cost.round_seconds(n, 0, n)  # a round gives each request one token
        options = range(1, kmax + 1) if k is None else [k]
        # (k = 1 where a forward of 2 tokens a request was never timed: priced at GUESS_MARGIN of the guess)
        t_draft = min(self.cost.round_seconds(n * (kk + 1), kk, n) / expected[kk]
                      * (self.GUESS_MARGIN if kk == 1 and not self.cost.timed(2 * n) else 1.0) for kk in options)
        # what rounds at this batch size measured, where they did, and the model agrees less: the read pays only if
        # drafting saves by both counts (the model's forwards leave out host work and the draft's other catch-ups;
        # on this CPU at 2 requests they predicted a gain the rounds did not give). A probe asks about acceptance,
        # not about costs: it too weighs drafting against the plain rounds timed (a probe priced against the
        # model's plain step read 60 tokens with the draft to draft one, ~2 % of a run at 2 requests)
        step = self._timed_plain_step(n)
        if step is not None:
            t_plain = min(t_plain, step)
        # (after a veto, for VETO_MEMORY of its waits, the rate of the trial it ended: the wait running out changes
        # nothing about what drafting realizes here. Priced by the model again, each arrival's prompt was read by the
        # draft once the wait ran out and drafted one or two rounds before the veto fired again: ~0.2 s a read, 3-6 %
        # of a run at 2 requests on this CPU, eighteenth session. A trial starts from a probe or when the memory
        # lapses)
        # (the pure rate: one 0.7 s round with a 47-token prefill in the window made drafting's tokens look 56 ms
        # each against plain's 41 at the next request's start, and adaptive k read no prompt for the rest of a
        # 20-prompt run; session 38)
        rate = None if optimistic else self.realized_rate(n, pure=True) or self._vetoed(n)
        if rate is not None:
            t_draft = max(t_draft, 1.0 / rate)
        return remaining * (t_plain - t_draft) > lag * per_token

    # catch_up_pays: k = 1 on a never timed forward of 2 tokens a request is priced at this fraction of the line's
    # guess (choose_k's try at the guess's floor costs one round; a probe's catch-up costs the draft's read of every
    # token it missed, so it gets less benefit of the doubt). At 1.0 (before session 59) the trap closed for good on
    # the Zen 2 int4 pair: after k fell to 0, the probe 16 rounds later at a typical draft's a = 0.6 did not repay
    # the draft's 17-token catch-up on the line's 61 ms for 2 tokens (they cost ~55), and as every plain round adds to
    # the catch-up and takes from the tokens left, no later probe did: 2 drafting rounds in 96 tokens, 0.96x plain
    GUESS_MARGIN = 0.9

    # ks: for how many rounds (ks calls), in units of the veto's wait, its trial's realized rate prices the draft's
    # reads at its batch size: 128 rounds after a first veto, doubling with the wait at each veto that follows
    # (to 8192). Then it is forgotten and the next read (an arrival's prompt) starts a new trial: this machine's
    # speed drifts by 10-40 % within minutes, drafting that lost at 2 requests can win there later (1.1-1.3x plain
    # in slow spells), and a first trial can lose for a cold start (at 1 request the first 8 rounds realized 0.54x
    # plain, where drafting then ran at 1.36x). A trial costs the draft's reads of ~2 requests' tokens (~0.4 s here)
    VETO_MEMORY = 8

    def _vetoed(self, n: int) -> float | None:
        """The realized rate of the last trial the veto ended at this batch size, while it is remembered."""
        b = self._bucket(n)
        v, held = self._vetoed_rate.get(b), self._held.get(b)
        return v[0] if v is not None and held is not None and self._ks_calls - v[1] <= held[1] * self.VETO_MEMORY \
            else None

    def ks(self, req_ids: list[int], room: list[int], plain_check: bool = True, lags: list[int] | None = None,
           remaining: list[int] | None = None, batch: int | None = None) -> list[int]:
        """k per request this round; room[i] caps it (context and max_tokens left). plain_check: the requests decode
        this round (not a prompt's last chunk), so a plain round of them may time the plain step. lags / remaining:
        per request the tokens its draft cache lacks and the tokens it has left; a request drafts (or probes) only
        where that catch-up pays (`catch_up_pays`), priced at `batch` requests where that is more than these (the
        batch the requests will decode in: a prompt's last chunk is decided alone, k_for([r]); priced at one request,
        every prompt that arrived with another was read by the draft at a batch size whose drafting the veto had
        stopped, eighteenth session)."""
        if not self.spec.enabled:
            return [0] * len(req_ids)
        if not self.spec.adaptive:
            return [max(0, min(self.spec.k, r)) for r in room]
        n = len(req_ids)
        warm = len(self.cost.target_obs) >= 2
        first = [rid not in self.estimates for rid in req_ids]
        self._first_asked.update(rid for rid, f in zip(req_ids, first) if f)
        # (before the cost model is warm: the configured k, but 1 in a first round, a prompt's read that times no
        # verify forward: all it can learn is whether the first token is guessed, and one draft tells that. At k = 4
        # on the Zen 2 pair the first rounds of a fresh engine lost 46-64 ms each, no draft accepted)
        ks = [choose_k(self.first if f else self._estimate(rid), min(self.spec.k_max, r), n, self.cost) if warm
              else min(self.spec.k, r, 1) if f else min(self.spec.k, r) for rid, r, f in zip(req_ids, room, first)]
        for i, f in enumerate(first):
            if f and ks[i] == 0 and room[i] > 0:  # a first draft the estimate says no to: every PROBE_EVERY-th
                self._first_skips += 1  # drafts one token anyway
                if self._first_skips >= self.PROBE_EVERY:
                    ks[i], self._first_skips = 1, 0
        if lags is not None and warm:
            self._ks_calls += 1
            b = self._bucket(n)
            held = self._held.get(b)
            if held is not None and held[0] > 0:  # a vetoed batch size sits out its wait: no drafting, no probe
                held[0] -= 1
                return [0] * n
            nb = max(n, batch or 0)
            ks = [k if k == 0 or self.catch_up_pays(rid, lag, rem, nb, k) else 0
                  for rid, k, lag, rem in zip(req_ids, ks, lags, remaining)]
            if any(ks) and self._overruled(n, self.REALIZED_MARGIN_LAGGED):
                # the model says drafting pays, the rounds it ran say it does not (the engine records them on the
                # CPU path with a separate draft: `Engine._catch_up_priced`). On this CPU at 2 requests the model
                # predicted ~7 % over plain from the forwards' costs while the drafting rounds realized ~6 % less
                # (sixteenth session). The batch size then decodes plainly for a wait that doubles at every veto
                # (as batch_k's probes back off): a per-request probe, whose drafts are accepted, would otherwise
                # start a losing trial of REALIZED_MIN rounds every PROBE_EVERY rounds
                wait = min(2 * held[1], self.BATCH_PROBE_MAX) if held is not None else self.PROBE_EVERY
                self._held[b] = [wait, wait]
                self._vetoed_rate[b] = (self.realized_rate(n, pure=True), self._ks_calls)
                self.realized.pop(b, None)  # (the next trial is measured from scratch)
                self.vetoes += 1
                return [0] * n
            elif any(ks) and held is not None and self._kept(n) is not None:
                del self._held[b]  # a trial realized what plain decoding does: the wait starts over
                self._vetoed_rate.pop(b, None)
        if plain_check and warm and any(ks) and self._plain_unmeasured(n):
            # drafting is chosen against a plain step the model never timed at this batch size, only extrapolated
            # from verify forwards: one plain round times it. On this CPU with int4 weights a 1-token forward costs
            # ~37 ms and a 3-6-token one 59-62 ms, and the extrapolation put plain decoding at 59 ms: drafting at
            # 2 requests looked like a gain and ran at 0.81-0.89x plain (fourteenth session)
            self.plain_checks[n] = self.plain_checks.get(n, 0) + 1
            return [0] * n
        out = []
        for i, (rid, r, k) in enumerate(zip(req_ids, room, ks)):
            idle = self.idle_rounds.get(rid, 0) + 1 if k == 0 else 0
            if idle >= self.probe_every.setdefault(rid, self.default_probe_every) and r > 0 and (
                    lags is None or not warm or self.catch_up_pays(rid, lags[i], remaining[i], max(n, batch or 0), 1,
                                                                   optimistic=True)):
                k, idle = 1, 0
                self.probing.add(rid)
            self.idle_rounds[rid] = idle
            out.append(max(0, k))
        return out

    PLAIN_RECHECK = 64  # ks: rounds after an unanswered plain check before the next one (its round may not be timed)

    def _plain_unmeasured(self, n: int) -> bool:
        """Whether no recent target forward processed exactly n tokens (n requests decoding plainly) and no plain
        check at this batch size is pending (one asked within PLAIN_RECHECK rounds whose round was not timed)."""
        if any(t == n for t, _ in self.cost.target_obs):
            self._plain_asked.pop(n, None)
            return False
        self._rounds += 1
        asked = self._plain_asked.get(n)
        if asked is not None and self._rounds - asked < self.PLAIN_RECHECK:
            return False
        self._plain_asked[n] = self._rounds
        return True

    def batch_k(self, req_ids: list[int], room: list[int]) -> int:
        """One k for the whole batch (CUDA graphs replay uniform steps only): the k in 0..k_max with the most
        expected tokens per second summed over the batch, every request verifying k + 1 tokens. After
        PROBE_EVERY k = 0 rounds in a row the batch probes with k = 1. The probe is accepted (the wait goes back to
        PROBE_EVERY) when drafting then lasts PROBE_HOLD rounds; when k returns to 0 sooner the wait doubles. Each
        switch to drafting costs the draft's catch-up over every token since it last ran (an eager forward), so a
        batch where drafting barely pays must not flip between the two every few rounds (on the H200 at 2
        requests that flipping ran at 0.72x plain while fixed k = 4 ran at 1.31x)."""
        self.batch_mode = True
        self._bk_calls += 1
        kmax = min(self.spec.k_max, max(room, default=0))
        predicted = None  # the model's best rate over plain decoding's
        if len(self.cost.target_obs) < 2 or not self.cost.draft_obs:  # nothing measured yet: the configured k
            # (with no draft step timed, drafting would look free), at least 2: k = 1 rounds time no draft step
            # in ordinary rounds (ModelDrafter times steps 1..), so k = 0 or 1 would never measure one
            k = min(max(self.spec.k, 2), kmax)
        else:
            n = len(req_ids)
            expected = [0.0] * (kmax + 1)  # summed over the batch, per k
            pool = self.overall.rates(kmax)  # (every request's estimate shrinks towards it)
            for rid in req_ids:
                for kk, e in enumerate(self._estimate(rid).expected_tokens_upto(kmax, pool)):
                    expected[kk] += e
            k, best, plain = 0, 0.0, 0.0
            # (a drafting session's start not measured yet at this batch size, e.g. right after a probe forgot them:
            # priced as a plain one's, never as free. Priced at 0 against plain's measured start, a useless draft
            # (acceptance ~1 %) at 39 requests won k = 1 by 0.3 % and drafted 162 tokens at 0.93x plain: run 51)
            plain_start = self.restart_per_token(False, n)
            spec_start = self.restart_per_token(True, n) if self._starts_measured(True, n) else plain_start
            starts = (plain_start, spec_start)
            # plain decoding priced at its measured step (a plain session's steady step at this batch size, as the
            # veto weighs it), not at the cost model's forward of n tokens: that median also holds the ordinary,
            # non-overlapped rounds' forwards. On the H200 at 64 requests it said 7.1-7.6 ms where plain sessions
            # stepped in 5.9, so a = 0.6 drafted at k = 2 by a predicted 1.17x, realized 0.75x until vetoed, and
            # the drafting spread the requests' finishes: 0.88-0.95x plain (runs 63-69)
            plain_step = self.plain_step(n)
            for kk in range(kmax + 1):
                seconds = (self.cost.round_seconds(n * (kk + 1), kk, n) if kk or plain_step is None else plain_step) \
                    + starts[kk > 0] * expected[kk]
                rate = expected[kk] / seconds
                if kk == 0:
                    plain = rate
                if rate > best * 1.0001:
                    k, best = kk, rate
            predicted = best / plain if plain > 0 else None
            if k > 0 and (self.batch_idle > 0 or self.batch_probing) and best < plain * (1 + self.SWITCH_MARGIN):
                k = 0  # switching drafting on must promise more than its catch-up and spread joins cost
        if self.batch_probing:
            self.batch_probing, self.batch_trial = False, 0
        n, b = len(req_ids), self._bucket(len(req_ids))
        remembered = self._batch_remembered(n) if k > 0 and predicted is not None and self._kept(n) is None else None
        if k > 0 and self._overruled(n):
            # the model says drafting pays, the rounds say it does not (on the H200 at 64 requests: k = 2-3
            # realized 0.46-0.75x plain): decode plainly, and wait twice as long before the next probe
            k, self.vetoes = 0, self.vetoes + 1
            if predicted is not None:  # (remembered past the next probe, which clears the rounds' record)
                self._batch_vetoed[b] = (min(1.0, self.realized_rate(n) / self.plain_rate(n) / predicted),
                                         self._bk_calls, self.VETO_MEMORY * self._batch_probe_wait(n))
            self.veto_log.append(dict(requests=n, realized=self.realized_rate(n), plain=self.plain_rate(n),
                                      plain_step=self.plain_step(n), forward=self.cost.target_time(n),
                                      plain_steady=self._steady.get((False, self._bucket(n))),
                                      points=self.cost._target_points()[:8]))
            if self.batch_idle == 0:  # the batch was drafting: this trial of drafting failed
                self.batch_probe_every = min(2 * self.batch_probe_every, self.BATCH_PROBE_MAX)
            self.batch_trial = None
        elif remembered is not None and predicted * remembered < 1.0:
            # no trial measured since the last probe, but the last one at this batch size realized less than the
            # model predicted: its shortfall still applies (the model's costs and what joins and switches add
            # have not changed; acceptance may have, and the prediction follows it). Forgotten at each probe, the
            # veto's verdict let the model start drafting again with each wave of 64 new requests on the H200 at
            # a = 0.6: a switch's catch-up, 8 rounds at 0.67x plain before the next veto, and finishes spread
            # over many rounds (each join read alone): 0.87-0.95x plain (runs 63-70)
            k, self.vetoes = 0, self.vetoes + 1
        elif k > 0 and self._kept(n) is not None:
            self._batch_vetoed.pop(b, None)  # a trial realized what plain decoding does: nothing to remember
        if k == 0:
            if self.batch_trial is not None:  # drafting did not last after the probe: probe half as often
                self.batch_probe_every = min(2 * self.batch_probe_every, self.BATCH_PROBE_MAX)
                self.batch_trial = None
            self.batch_idle += 1
            if self.batch_idle >= self._batch_probe_wait(len(req_ids)) and kmax > 0:
                k, self.batch_idle, self.batch_probing = 1, 0, True
                self.realized.pop(self._bucket(len(req_ids)), None)  # the probe re-measures from scratch,
                # start costs included (recorded only between drafting sessions, they would never refresh at k = 0)
                self.sessions.pop((True, self._bucket(len(req_ids))), None)
        else:
            self.batch_idle = 0
            if self.batch_trial is not None:
                self.batch_trial += 1
                if self.batch_trial >= self.PROBE_HOLD:
                    self.batch_probe_every, self.batch_trial = self.PROBE_EVERY, None
        return k

    def _batch_remembered(self, n: int) -> float | None:
        """batch_k: the ratio of realized to predicted gain of the last trial a veto ended at this batch size, for
        VETO_MEMORY of the probe waits then (as `_vetoed` on the CPU path), or until a trial passes."""
        v = self._batch_vetoed.get(self._bucket(n))
        return v[0] if v is not None and self._bk_calls - v[1] <= v[2] else None

    def idle(self) -> bool:
        """Whether adaptive k last chose plain decoding (k = 0) for the batch (CUDA graphs) or for every request."""
        if not self.spec.adaptive:
            return False
        if self.batch_mode:
            return self.batch_idle > 0
        return bool(self.idle_rounds) and all(v > 0 for v in self.idle_rounds.values())

    def rounds_before_probe(self, req_ids: list[int]) -> int:
        """After ks() gave k = 0 to all of these requests: how many more k = 0 rounds, this one included, run
        before one of them probes (the engine runs those rounds overlapped, without asking again)."""
        if self.batch_mode:
            return max(1, self._batch_probe_wait(len(req_ids)) - self.batch_idle)
        return max(1, min(self.probe_every.get(rid, self.default_probe_every) - self.idle_rounds.get(rid, 0)
                          for rid in req_ids))

    def skip_idle_rounds(self, req_ids: list[int], rounds: int) -> None:
        """Count `rounds` more k = 0 rounds (run without calling ks())."""
        self.batch_idle += rounds
        for rid in req_ids:
            self.idle_rounds[rid] = self.idle_rounds.get(rid, 0) + rounds

    def _estimate(self, req_id: int) -> AcceptanceEstimate:
        if req_id not in self.estimates:
            self.estimates[req_id] = self._new_estimate()
        return self.estimates[req_id]

    def _new_estimate(self) -> AcceptanceEstimate:
        # shrunk towards the engine-wide estimate, position by position, with the weight of 4 observations: with
        # the weight of 1 (and the prior frozen at arrival) one rejected first draft turned a request to k = 0 until
        # a probe 16 rounds later (the CPU int4 pair: adaptive 0.95x plain, k = 4 1.06x)
        return AcceptanceEstimate(prior_weight=4.0, pool=self.overall)

    def observe(self, req_id: int, drafted: int, accepted: int, wanted: int | None = None) -> None:
        """drafted / accepted: this round's drafts; wanted: the k asked for. A drafter that proposed nothing
        when asked (n-gram without a match) counts as a rejected first draft: a drafter that rarely has
        anything to say is worth as little as one that is always wrong, and k should fall to 0 (where plain
        decoding runs overlapped) until a probe finds it useful again."""
        if self.spec.adaptive:
            if drafted == 0 and wanted:
                drafted, accepted = 1, 0
            if req_id in self._first_asked:  # the answer's first token (FIRST_DECAY)
                self._first_asked.discard(req_id)
                self._estimate(req_id)  # (from now on the request's own)
                self.first.update(drafted, accepted)
                if drafted:
                    self._first_skips = 0
                return
            self._estimate(req_id).update(drafted, accepted)
            self.overall.update(drafted, accepted)
            if req_id in self.probing:  # a rejected probe waits twice as long for the next one
                self.probing.discard(req_id)
                interval = self.probe_every.get(req_id, self.default_probe_every)
                if drafted:
                    self.probe_every[req_id] = self.PROBE_EVERY if accepted else min(2 * interval, self.PROBE_MAX)
                    self.default_probe_every = self.probe_every[req_id]

    def forget(self, req_id: int) -> None:
        self.estimates.pop(req_id, None)
        self._first_asked.discard(req_id)
        self.idle_rounds.pop(req_id, None)
        self.probe_every.pop(req_id, None)
        self.probing.discard(req_id)
