"""The online engine under load: requests arrive while others run (closed loop at a fixed concurrency, and
Poisson arrivals at a sweep of rates); throughput, TTFT and time per output token (p50 / p99) for plain
decoding, fixed k and adaptive k; plus a 4k-token prompt arriving mid-run (chunked prefill keeps the running
requests' p99 time per token within 2x their median).

  GPU (H200): python benchmarks/online.py --gpu      random Qwen3-8B-shape target, 0.6B-shape draft,
      synthetic acceptance 0.6 / 0.8 / 0.9 and a useless draft; concurrency 1..64.
  CPU:        python benchmarks/online.py --cpu      the real Qwen2.5-Coder 1.5B + 0.5B pair, greedy, low load.

Synthetic acceptance (GPU, as benchmarks/gpu.py): the draft model and the verifier run for real (their costs
are real), then the verdict is replaced: each draft accepted with probability a until the first miss. The
useless draft is the real random 0.6B-shape draft model, verified for real (acceptance ~0). The engine,
scheduler and k policy are the real ones. Prints a table; writes benchmarks/results/online_{gpu,cpu}.json and a PNG.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import random
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from forerun.config import CacheConfig, SpecConfig  # noqa: E402
from forerun.engine.engine import Engine  # noqa: E402
from forerun.engine.k_policy import KPolicy  # noqa: E402
from forerun.engine.sampler import RoundSampler, Verdict  # noqa: E402
from forerun.sampling_params import SamplingParams  # noqa: E402


class SyntheticSampler(RoundSampler):
    """The documented synthetic-acceptance mode (as benchmarks/gpu.py): the real verifier runs (its cost is
    paid), then the verdict is replaced: each draft position is accepted with probability `a` until the first
    miss, and the final token is the target's argmax at that row. With random weights the target's greedy
    path flips with batch numerics, so a reference continuation cannot give a controlled acceptance; this can.
    Output is NOT the target's (benchmark only); costs, scheduling and the k policy are the engine's."""

    def __init__(self, a: float, seed: int = 0) -> None:
        super().__init__("auto")
        self.a, self.rng = a, random.Random(seed)
        # drafts accepted per verdict, by k: host-side counts of the ordinary rounds, device-side ones of the
        # overlapped rounds (summed on the device, read at take_hist: no extra wait per round)
        self.host_hist: dict[int, list[int]] = {}
        self.device_hist: dict[int, torch.Tensor] = {}

    def take_hist(self) -> dict:
        """{"host" | "device": {k: [verdicts accepting 0 .. k drafts]}} since the last call (then cleared)."""
        out = {"host": {k: list(v) for k, v in sorted(self.host_hist.items())},
               "device": {k: v.tolist() for k, v in sorted(self.device_hist.items())}}
        self.host_hist, self.device_hist = {}, {}
        return out

    def chain(self, logits, requests, drafts, draft_probs, starts, device_drafts=None) -> Verdict:
        best = logits.argmax(-1)  # [T], queued before the real verifier's sync
        real = super().chain(logits, requests, drafts, draft_probs, starts, device_drafts=device_drafts)
        if device_drafts is not None:  # the drafts' values (the verification has synchronised: no wait)
            flat, values, at = device_drafts.tolist(), [], 0
            for d in drafts:
                values.append(flat[at: at + len(d)])
                at += len(d)
            drafts = values
        acc, emitted, rows = [], [], []
        for d, s in zip(drafts, starts):
            m = 0
            while m < len(d) and self.rng.random() < self.a:
                m += 1
            acc.append(m)
            rows.append(s + m)
            if d:
                self.host_hist.setdefault(len(d), [0] * (len(d) + 1))[m] += 1
        best = best.tolist()
        for d, m, r in zip(drafts, acc, rows):
            emitted.append(d[:m] + [best[r]])
        return Verdict(acc, emitted, real.logprobs)

    def device_verdict(self, logits, drafts):
        """The same on the device, for overlapped speculative rounds (engine/overlap_spec.py): the greedy verdict
        is computed (its cost paid), then each request accepts its drafts while coins < a."""
        best, _ = super().device_verdict(logits, drafts)
        b, k = drafts.shape
        if getattr(self, "_gen", None) is None:
            self._gen = torch.Generator(device=drafts.device).manual_seed(self.rng.randrange(1 << 30))
        u = torch.rand(b, k, device=drafts.device, generator=self._gen)
        acc = (u < self.a).to(torch.int64).cumprod(1).sum(1)
        if k not in self.device_hist:
            self.device_hist[k] = torch.zeros(k + 1, dtype=torch.int64, device=drafts.device)
        self.device_hist[k].index_add_(0, acc, torch.ones_like(acc))
        keep = torch.arange(k, device=drafts.device)[None, :] < acc[:, None]
        tokens = best.clone()
        tokens[:, :k] = torch.where(keep, drafts, best[:, :k])
        return tokens, acc


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


class _StallProbe:
    """What a slow step spent its time on besides kernels (ONLINE_TRACE_SLOW=1): Python garbage collections
    (gc.callbacks) and Triton JIT compiles (triton.knobs.runtime.jit_post_compile_hook) since the last take()."""

    def __init__(self) -> None:
        import gc

        self.gc_s, self.compiles, self._t = 0.0, [], None
        gc.callbacks.append(self._gc)
        try:
            import triton.knobs as knobs

            knobs.runtime.jit_post_compile_hook = self._compiled
        except Exception:  # (older Triton: compiles go unreported)
            pass

    def _gc(self, phase, info) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.gc_s += time.perf_counter() - self._t
            self._t = None

    def _compiled(self, *a, **kw) -> None:
        fn = kw.get("fn")
        what = f"{getattr(fn, 'name', '?')} {kw.get('repr', '')}"[:600]
        self.compiles.append(what)
        print(f"[triton compile] {what}", file=sys.stderr, flush=True)
        return None

    def take(self) -> tuple[float, list[str]]:
        out = (self.gc_s, self.compiles)
        self.gc_s, self.compiles = 0.0, []
        return out


_PROBE: _StallProbe | None = None


def drive(eng: Engine, prompts: list[list[int]], new_tokens: "int | tuple[int, int]", *,
          concurrency: int | None = None, rate: float | None = None, seed: int = 0,
          late: tuple[float, list[int]] | None = None) -> dict:
    """Run the engine until every request is done. Closed loop (`concurrency` outstanding at all times) or
    Poisson arrivals at `rate` requests/s. late: (time, prompt) of one extra request arriving mid-run.
    new_tokens: every request's max_tokens, or (lo, hi): the i-th request added draws it uniformly from lo..hi
    (a seeded draw: every config gets the same lengths in the same order)."""
    rng = random.Random(seed)
    spread = random.Random(1000 + seed) if isinstance(new_tokens, tuple) else None
    same = None if spread else SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    queue = list(prompts)
    arrivals, t_next = [], 0.0
    if rate is not None:
        for _ in queue:
            t_next += rng.expovariate(rate)
            arrivals.append(t_next)
    info: dict[str, dict] = {}
    st0 = eng.stats()
    graphs0 = _graph_counts(eng)
    j0 = {k: getattr(eng, k, 0) for k in ("session_joins", "session_reads", "mixed_joins")}
    t0 = time.perf_counter()
    outstanding = 0
    late_id = None
    steps, slow = [], []  # seconds of each engine step; (seconds, deltas, graph counts, k) when tracing
    kinds: dict[str, list] = {}  # where the time went: kind of step -> [steps, seconds, tokens]
    trace_slow = os.environ.get("ONLINE_TRACE_SLOW") == "1"
    global _PROBE
    if trace_slow and _PROBE is None:
        _PROBE = _StallProbe()

    rounds = _RoundTrace(eng) if os.environ.get("ONLINE_TRACE_ROUNDS") == "1" else None
    # ONLINE_STEP_LOG=1: every step's [start s, seconds, kind, requests running, waiting, tokens given]
    step_log = [] if os.environ.get("ONLINE_STEP_LOG") == "1" else None

    def add(prompt, now):
        nonlocal outstanding
        sp = same or SamplingParams(temperature=0, max_tokens=spread.randint(*new_tokens), ignore_eos=True)
        rid = eng.add_request(prompt, sp)
        info[rid] = {"arrive": now, "times": []}
        outstanding += 1
        return rid

    try:
        while queue or eng.has_unfinished() or (late is not None and late_id is None):
            now = time.perf_counter() - t0
            if rate is None:
                while queue and outstanding < concurrency:
                    add(queue.pop(0), now)
            else:
                while queue and arrivals[len(prompts) - len(queue)] <= now:
                    add(queue.pop(0), now)
            if late is not None and late_id is None and now >= late[0]:
                late_id = add(late[1], now)
            if not eng.has_unfinished():
                time.sleep(0.0005)
                continue
            ts0 = time.perf_counter()
            g0 = _graph_counts(eng) if trace_slow else None
            if trace_slow:
                _PROBE.take()
            kind = _step_kind(eng)
            joins0 = getattr(eng, "session_reads", 0)
            mixed0 = getattr(eng, "mixed_joins", 0)
            deltas = eng.step()
            dt = time.perf_counter() - ts0
            steps.append(dt)
            if kind == "round" and getattr(eng, "_overlap", None) is not None:
                kind = "session start"
            elif kind == "spec session" and getattr(eng, "session_reads", 0) != joins0:
                kind = "session join"  # (prompts read between two of the session's rounds: Engine._regroup)
            elif kind == "spec session" and getattr(eng, "mixed_joins", 0) != mixed0:
                kind = "session join, mixed"  # (a prompt read in the members' next verify forward: MIX_JOINS)
            if step_log is not None:
                step_log.append([round(ts0 - t0, 5), round(dt, 5), kind, len(eng.scheduler.running),
                                 len(eng.scheduler.waiting), sum(len(d.new_token_ids) for d in deltas)])
            k = kinds.setdefault(kind, [0, 0.0, 0])
            k[0], k[1], k[2] = k[0] + 1, k[1] + dt, k[2] + sum(len(d.new_token_ids) for d in deltas)
            if trace_slow:  # what a step that took long did: graph replays / eager steps / captures, requests, k
                gc_s, compiles = _PROBE.take()
                slow.append((dt, len(deltas), {k: v - g0.get(k, 0) for k, v in _graph_counts(eng).items()
                                               if v != g0.get(k, 0)}, round(gc_s, 4), compiles[:4]))
            for d in deltas:
                t = time.perf_counter() - t0
                info[d.request_id]["times"].extend([t] * len(d.new_token_ids))
                if d.finished:
                    outstanding -= 1
    finally:  # the engine's round.run back as it was, even if a step raised
        trace = rounds.close() if rounds is not None else None
    end = time.perf_counter() - t0
    ttft, tpot, gaps = [], [], []
    for rid, v in info.items():
        ts = v["times"]
        if not ts:
            continue
        ttft.append(ts[0] - v["arrive"])
        if len(ts) > 1:
            tpot.append((ts[-1] - ts[0]) / (len(ts) - 1))
        if rid != late_id:
            gaps.extend(b - a for a, b in zip(ts, ts[1:]) if b > a)  # time between steps that gave tokens
    tokens = sum(len(v["times"]) for v in info.values())
    st = eng.stats()
    drafted = st.spec_num_draft_tokens - st0.spec_num_draft_tokens
    accepted = st.spec_num_accepted_tokens - st0.spec_num_accepted_tokens
    res = dict(requests=len(info), tokens=tokens, seconds=end, tok_s=tokens / end,
               ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99),
               tpot_p50=percentile(tpot, 50), tpot_p99=percentile(tpot, 99),
               acceptance=round(accepted / drafted, 4) if drafted else None, drafted=drafted,
               preemptions=st.num_preemptions - st0.num_preemptions,
               graphs={k: v - graphs0.get(k, 0) for k, v in _graph_counts(eng).items()},
               split_rounds=getattr(eng.round, "split_rounds", 0),
               joins={k: getattr(eng, k, 0) - j0[k] for k in j0})
    med = percentile(steps, 50)  # stalls: time of steps that took > 5x the median step, beyond the median
    res.update(steps=len(steps), step_p50=med, step_max=max(steps),
               stall_s=sum(x - med for x in steps if x > 5 * med),
               step_kinds={k: dict(steps=v[0], seconds=round(v[1], 4), tokens=v[2]) for k, v in sorted(kinds.items())})
    if trace is not None:
        res["round_trace"] = trace
    if step_log is not None:
        res["step_log"] = step_log
    if trace_slow:
        res["slowest_steps"] = [dict(seconds=round(a, 4), deltas=b, graphs=c, gc_s=g, compiles=k)
                                for a, b, c, g, k in sorted(slow, key=lambda r: -r[0])[:6]]
    if late is not None:
        res.update(step_gap_p50=percentile(gaps, 50), step_gap_p99=percentile(gaps, 99), step_gap_max=max(gaps),
                   long_prompt_ttft=info[late_id]["times"][0] - info[late_id]["arrive"] if late_id else None)
    return res


class _RoundTrace:
    """ONLINE_TRACE_ROUNDS=1: where ordinary rounds spend their time, rounds carrying prefill apart from pure ones
    (the device is synchronised around each round: wall times, and the round's own draft / target phase times)."""

    def __init__(self, eng: Engine) -> None:
        self.eng, self.run = eng, eng.round.run
        self.acc: dict[str, list[float]] = {}
        eng.round.run = self._run
        # the draft's feeds (drafter.feed: a session's catch-up, and prompts passed on by Round._feed_drafter) and
        # the call that decides and builds a session (_try_spec_overlap: the k policy and the scope checks; the
        # catch-up and the device state run later, in the session's first step), each synchronised around
        self.feed = getattr(eng.drafter, "feed", None)
        self.start = eng._try_spec_overlap
        if self.feed is not None:
            eng.drafter.feed = self._feed
        eng._try_spec_overlap = self._start

    def _timed(self, key, fn, *args, tokens=0):
        sync = torch.cuda.synchronize if self.eng.device.type == "cuda" else (lambda: None)
        sync()
        t = time.perf_counter()
        res = fn(*args)
        sync()
        a = self.acc.setdefault(key, [0] * 8)
        a[0], a[1], a[4] = a[0] + 1, a[1] + time.perf_counter() - t, a[4] + tokens
        return res

    def _feed(self, requests, upto):
        kv = self.eng.drafter.runner.kv
        todo = sum(max(0, n - (kv.length(r.req_id) if kv.has(r.req_id) else 0)) for r, n in zip(requests, upto))
        return self._timed("draft feed", self.feed, requests, upto, tokens=todo)

    def _start(self):
        return self._timed("session start call", self.start)

    def _run(self, items):
        sync = torch.cuda.synchronize if self.eng.device.type == "cuda" else (lambda: None)
        sync()
        t = time.perf_counter()
        res = self.run(items)
        sync()
        wall = time.perf_counter() - t
        pre = [it for it in items if it.feed > 1]  # prompt chunks (a prompt's last chunk samples: final)
        key = "prefill" if pre else "pure"
        a = self.acc.setdefault(key, [0] * 8)
        vals = (1, wall, res.draft_seconds, res.target_seconds, sum(it.feed for it in pre), len(pre),
                len(items) - len(pre), max((it.k for it in items), default=0))
        for i, v in enumerate(vals):
            a[i] += v
        return res

    def close(self) -> dict:
        self.eng.round.run = self.run
        if self.feed is not None:
            self.eng.drafter.feed = self.feed
        self.eng._try_spec_overlap = self.start
        names = ("rounds", "wall_s", "draft_s", "target_s", "prefill_tokens", "prefill_items", "final_items", "sum_max_k")
        return {k: {n: round(v, 4) for n, v in zip(names, a)} for k, a in self.acc.items()}


def _step_kind(eng: Engine) -> str:
    """What the next step will be: inside an overlapped session ("session": plain or speculative), or an
    ordinary round that carries prefill (a waiting request or a prompt not fully read: "round + prefill") or not
    ("round"; one that starts a session is counted as "session start" afterwards)."""
    ov = getattr(eng, "_overlap", None)
    if ov is not None:
        return "spec session" if len(ov) > 2 and ov[2] else "plain session"
    sched, kv = eng.scheduler, eng.runner.kv
    if sched.waiting or any(not kv.has(r.req_id) or kv.length(r.req_id) < r.num_tokens - 1 for r in sched.running):
        return "round + prefill"
    return "round"


def count_k_decisions(eng: Engine) -> None:
    """Wrap the engine's batch_k: `eng._k_hist` counts the batch k chosen per decision; `eng._k_on` records the
    decisions that switched drafting on or off (a probe or the model, the batch size, the model's inputs)."""
    from collections import Counter

    pol = eng.k_policy
    eng._k_hist, eng._k_on, eng._k_last, batch_k = Counter(), [], 0, pol.batch_k

    def counted(ids, room):
        before = (pol.batch_idle, pol.batch_probe_every)
        k = batch_k(ids, room)
        eng._k_hist[k] += 1
        if (k > 0) != (eng._k_last > 0) and len(eng._k_on) < 64:
            n, c = len(ids), pol.cost
            eng._k_on.append(dict(step=eng._steps, requests=n, k=k, probe=pol.batch_probing, idle=before[0],
                                  probe_every=before[1], vetoes=pol.vetoes, pool_rate=round(pol.overall.rates(1)[0], 4),
                                  t_plain=c.target_time(n), t_k1=c.target_time(2 * n), draft=c.draft_step_time(n),
                                  start_spec=pol.restart_per_token(True, n), start_plain=pol.restart_per_token(False, n)))
        eng._k_last = k
        return k

    pol.batch_k = counted


def _graph_counts(eng: Engine) -> dict:
    """Replays, eager steps and captured graphs of the target and draft runners (where steps ran)."""
    out = {}
    for name, runner in (("target", eng.runner), ("draft", getattr(eng.drafter, "runner", None))):
        gr = getattr(runner, "graphs", None)
        if gr is not None and not (name == "draft" and runner is eng.runner):
            out.update({f"{name}_replays": gr.replays, f"{name}_eager": gr.eager_steps, f"{name}_captured": len(gr.graphs),
                        f"{name}_pieces": getattr(gr, "pieces_steps", 0)})
    return out


def run_grid(make_engine, prompts_for, new_tokens: "int | tuple[int, int]", concurrencies, configs, log, rates=(),
             poisson_requests: int = 64) -> list[dict]:
    """Per config: a closed loop at each concurrency (rows with `concurrency`), then Poisson arrivals at each rate
    in requests/s (rows with `rate`, `concurrency` None), on the same engine."""
    rows = []
    for name, spec_kw in configs:
        eng = make_engine(spec_kw)
        drive(eng, prompts_for(1), 8, concurrency=1)  # warm-up (graphs captured on first use)
        for c in concurrencies:
            drive(eng, prompts_for(2 * c), new_tokens, concurrency=c)  # the same workload once: every graph captured
            if getattr(eng, "_k_hist", None) is not None:
                eng._k_hist.clear()
                eng._k_on = []
            prof = _profiler(name)
            vetoes0 = getattr(getattr(eng, "k_policy", None), "vetoes", 0)
            if hasattr(eng.sampler, "take_hist"):
                eng.sampler.take_hist()
            r = drive(eng, prompts_for(int(os.environ.get("ONLINE_REPEAT", 3)) * c), new_tokens, concurrency=c)
            _profile_report(prof, f"{name} c={c}")
            r.update(config=name, concurrency=c)
            if hasattr(eng.sampler, "take_hist"):  # drafts accepted per verdict, by k (synthetic acceptance)
                r["verdict_hist"] = eng.sampler.take_hist()
            hist = getattr(eng, "_k_hist", None)
            if hist is not None:  # the batch k chosen per decision during this run (adaptive)
                r["batch_k_hist"] = dict(sorted(hist.items()))
                r["k_on"], eng._k_on = eng._k_on, []
                r["vetoes"] = eng.k_policy.vetoes - vetoes0  # rounds where realized rates overruled k > 0
                if r["vetoes"]:  # the last ones' inputs: realized vs plain's predicted rate, the cost points
                    r["veto_log"] = list(eng.k_policy.veto_log)[-min(r["vetoes"], 8):]
                hist.clear()
            rows.append(r)
            if os.environ.get("ONLINE_PARTIAL"):  # survive a time limit: what is measured so far
                json.dump(rows, open(os.environ["ONLINE_PARTIAL"], "w"), indent=1)
            log(f"{name:>26} c={c:<3} {r['tok_s']:8.1f} tok/s  TTFT p50 {r['ttft_p50'] * 1e3:7.1f} ms  "
                f"TPOT p50/p99 {r['tpot_p50'] * 1e3:6.2f}/{r['tpot_p99'] * 1e3:6.2f} ms  acc {r['acceptance']}  {r['graphs']}  "
                f"steps {r['steps']} p50 {r['step_p50'] * 1e3:.2f} ms max {r['step_max'] * 1e3:.0f} ms "
                f"stalls {r['stall_s']:.2f} s  kinds {r['step_kinds']} {r.get('round_trace', '')}" + (f"  slowest {r['slowest_steps'][:3]}" if "slowest_steps" in r else ""))
        for i, rate in enumerate(rates):
            hist = getattr(eng, "_k_hist", None)
            if hist is not None:
                hist.clear()
                eng._k_on = []
            prof = _profiler(name)
            r = drive(eng, prompts_for(poisson_requests), new_tokens, rate=rate, seed=11 + i)
            _profile_report(prof, f"{name} Poisson {rate:g}/s")
            r.update(config=name, concurrency=None, rate=rate)
            if hist is not None:
                r["batch_k_hist"] = dict(sorted(hist.items()))
                r["k_on"], eng._k_on = eng._k_on, []
            rows.append(r)
            log(f"{name:>26} Poisson {rate:g}/s {r['tok_s']:8.1f} tok/s  TTFT p50/p99 {r['ttft_p50'] * 1e3:7.1f}/"
                f"{r['ttft_p99'] * 1e3:7.1f} ms  TPOT p50/p99 {r['tpot_p50'] * 1e3:6.2f}/{r['tpot_p99'] * 1e3:6.2f} ms  "
                f"acc {r['acceptance']}  kinds {r['step_kinds']} {r.get('round_trace', '')}")
        del eng
        free_memory()
    return rows


def _profiler(name: str):
    """ONLINE_CPROFILE=PREFIX[,PREFIX...]: a started cProfile.Profile for the configs whose names start so (where
    the host time of a run goes), else None."""
    prefixes = [p for p in os.environ.get("ONLINE_CPROFILE", "").split(",") if p]
    if not any(name.startswith(p) for p in prefixes):
        return None
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    return prof


def _profile_report(prof, label: str) -> None:
    if prof is None:
        return
    import pstats

    prof.disable()
    print(f"-- host profile: {label}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(int(os.environ.get("ONLINE_CPROFILE_LINES", 22)))


def _profile_dump(prof, label: str) -> None:
    """ONLINE_PROF_DIR=DIR: the profile written to DIR/<label>.prof (pstats; compare configs offline), else printed."""
    if prof is None:
        return
    out = os.environ.get("ONLINE_PROF_DIR")
    if not out:
        return _profile_report(prof, label)
    prof.disable()
    os.makedirs(out, exist_ok=True)
    prof.dump_stats(os.path.join(out, "".join(c if c.isalnum() or c in "._-" else "_" for c in label) + ".prof"))


def free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rep_ratios(rows: list[dict], name: str, key: str, level, ratio) -> list[float]:
    """ratio(row, plain's row) for config `name` at rows[key] == level, against plain's row of the same repetition
    (rows carry `rep`), in repetition order."""
    plain = {r["rep"]: r for r in rows if r["config"] == "plain" and r.get(key) == level}
    return [ratio(r, plain[r["rep"]]) for r in sorted(rows, key=lambda r: r["rep"])
            if r["config"] == name and r.get(key) == level and r["rep"] in plain]


def poisson_ab(make_engine, configs, prompts_for, new_tokens, rates, reps: int, requests: int, log) -> dict:
    """Poisson arrivals with the configs interleaved: every engine is built and warmed first, then each rate runs
    `reps` times, every config once per repetition on the same arrival times (seed per repetition). Time per
    output token differs run to run by more than the effect measured (two runs of one config: 8.9 and 9.9 ms p50
    at 40 requests/s on the H200), so each config is compared with the plain run of the same repetition, minutes
    apart at most, and the median of those ratios is reported."""
    if not any(name == "plain" for name, _ in configs):
        raise SystemExit("--poisson-ab compares every config with plain: keep 'plain' in --only")
    engines = [(name, make_engine(kw)) for name, kw in configs]
    for _, eng in engines:  # every graph of these loads captured, every kernel compiled, before any measurement
        drive(eng, prompts_for(16), new_tokens, concurrency=8)
        drive(eng, prompts_for(64), 16, concurrency=64)
    rows = []
    for i, rate in enumerate(rates):
        for rep in range(reps):
            prompts = prompts_for(requests)
            for name, eng in engines[rep % len(engines):] + engines[: rep % len(engines)]:  # (order rotates)
                hist = getattr(eng, "_k_hist", None)
                if hist is not None:
                    hist.clear()
                    eng._k_on = []
                prof = _profiler(name)
                r = drive(eng, prompts, new_tokens, rate=rate, seed=101 * rep + 11 + i)
                _profile_dump(prof, f"{name}_{rate:g}_{rep}")
                r.update(config=name, concurrency=None, rate=rate, rep=rep)
                if hist is not None:  # the batch k per decision, and the switches on / off (probes among them)
                    r["batch_k_hist"] = dict(sorted(hist.items()))
                    r["k_on"], eng._k_on = eng._k_on, []
                rows.append(r)
                log(f"{name:>26} Poisson {rate:g}/s rep {rep}: TPOT p50 {r['tpot_p50'] * 1e3:6.2f} ms, "
                    f"{r['tok_s']:8.1f} tok/s, steps {r['steps']}, kinds {r['step_kinds']}")
    summary = []
    for name, _ in engines:
        if name == "plain":
            continue
        for rate in rates:
            rs = sorted(rep_ratios(rows, name, "rate", rate, lambda r, plain: plain["tpot_p50"] / r["tpot_p50"]))
            summary.append(dict(config=name, rate=rate, tpot_ratios=rs, median=rs[len(rs) // 2]))
            log(f"{name:>26} Poisson {rate:g}/s: plain TPOT / this TPOT, per repetition "
                f"{' '.join(f'{x:.3f}' for x in rs)}; median {rs[len(rs) // 2]:.3f}x")
    return dict(rows=rows, summary=summary)


def ratios(rows: list[dict]) -> list[dict]:
    """Throughput vs plain at the same concurrency (closed loop), and TPOT of plain / TPOT of the config at the same
    Poisson rate (the arrivals fix the throughput there; what speculation changes is the time per token)."""
    plain = {r["concurrency"]: r["tok_s"] for r in rows if r["config"] == "plain" and r.get("concurrency")}
    plain_tpot = {r["rate"]: r["tpot_p50"] for r in rows if r["config"] == "plain" and r.get("rate")}
    out = []
    for r in rows:
        if r["config"] == "plain":
            continue
        if r.get("concurrency") in plain:
            out.append(dict(config=r["config"], concurrency=r["concurrency"], vs_plain=r["tok_s"] / plain[r["concurrency"]]))
        elif r.get("rate") in plain_tpot:
            out.append(dict(config=r["config"], concurrency=f"Poisson {r['rate']:g}/s",
                            vs_plain=plain_tpot[r["rate"]] / r["tpot_p50"]))
    return out


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == name and r.get("concurrency")]  # (Poisson rows: the JSON only)
        ls = "" if any("rep" in r for r in rs) else "-"  # (--repeat: a point per repetition)
        ax[0].plot([r["concurrency"] for r in rs], [r["tok_s"] for r in rs], marker="o", ls=ls, label=name)
        ax[1].plot([r["concurrency"] for r in rs], [r["tpot_p50"] * 1e3 for r in rs], marker="o", ls=ls, label=name)
    for a, yl in zip(ax, ("throughput (tok/s)", "TPOT p50 (ms)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrency")
        a.set_ylabel(yl)
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def gpu_main(args) -> dict:
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from gpu import BF16, QWEN3_06B, QWEN3_8B, _NoTextTokenizer, build_model

    T0 = time.perf_counter()

    def log(m):
        print(f"[{time.perf_counter() - T0:6.1f}s] {m}", flush=True)

    torch.manual_seed(0)
    target = build_model(QWEN3_8B, None, seed=0)
    draft = build_model(QWEN3_06B, None, seed=3)
    tok = _NoTextTokenizer()
    cache = CacheConfig(block_size=16, num_blocks=args.blocks)
    prompt_len, new = 128, args.new_tokens
    pool = [torch.randint(0, 151936, (prompt_len,)).tolist() for _ in range(128)]
    log("models built")

    built: dict = {}  # speculative engines by (spec, overlapped, mixed): configs that differ only in acceptance or
    # policy tweaks share one (its graphs captured once: the warm-up, not the runs, was most of a grid's time), each
    # run with a fresh k policy, sampler and tweaks

    def joins(eng, tweaks=None):  # --join-wait RATIO STEPS: every engine of the run (plain too) holds joins back
        # alike; --join-wait-ab: the configs tagged "join wait" only. Set on every run: an engine is reused
        jw = (tweaks or {}).get("join_wait") or args.join_wait or (0.0, 0)
        eng.JOIN_WAIT_RATIO, eng.JOIN_WAIT_STEPS = float(jw[0]), int(jw[1])
        # --join-hold off: the configs tagged "no join hold" read an arrival at once even when a running request is
        # about to finish (Engine.JOIN_HOLD_STEPS = 0); the others, plain included, keep the engine's default
        eng.JOIN_HOLD_STEPS = Engine.JOIN_HOLD_STEPS if (tweaks or {}).get("hold", True) else 0
        return eng

    def make(spec_kw):
        if spec_kw is None or spec_kw[0] == "plain":  # ("plain", tweaks): plain with tweaks (--join-wait-ab)
            return joins(Engine.from_model(target, tok, device="cuda", dtype=BF16, cache=cache, max_num_seqs=64,
                                           enable_prefix_caching=args.prefix_caching == "on"),
                         None if spec_kw is None else spec_kw[1])
        a, kw, overlapped, mixed, tweaks = (*spec_kw, *(False, {})[len(spec_kw) - 3:])  # (defaults by position)
        key = (tuple(sorted(kw.items())), overlapped, mixed)
        alive = args.poisson_ab or args.repeat  # (--poisson-ab, --repeat: engines side by side, each its own)
        eng = built.get(key) if not alive else None
        if eng is None:
            if len(built) >= 2:  # at most two kept (~17 GB of caches each on the 141 GB card): the oldest goes
                built.pop(next(iter(built)))
                free_memory()
            eng = Engine.from_model(target, tok, device="cuda", dtype=BF16, cache=cache, max_num_seqs=64,
                                    spec=SpecConfig(method="draft", draft_model=(draft, tok), **kw),
                                    overlap_spec=overlapped, mixed_prefill=mixed,
                                    enable_prefix_caching=args.prefix_caching == "on")
            if not alive:
                built[key] = eng
        eng.k_policy = KPolicy(eng.spec)
        eng.round.sampler = eng.sampler = SyntheticSampler(a) if a > 0 else RoundSampler(eng.spec.rule,
                                                                                       eng._verify_kwargs())
        if tweaks.get("margin") is not None:  # KPolicy.SWITCH_MARGIN for this engine
            eng.k_policy.SWITCH_MARGIN = tweaks["margin"]
        if os.environ.get("ONLINE_REALIZED_MARGIN"):  # KPolicy.REALIZED_MARGIN (batch_k's veto) for every engine
            eng.k_policy.REALIZED_MARGIN = float(os.environ["ONLINE_REALIZED_MARGIN"])
        # a new k ends the overlapped session (the tenth session's engine) or goes on in it
        eng.KEEP_SESSION_ON_NEW_K = not tweaks.get("restart")
        # arrivals join running sessions and finished requests leave them (Engine.JOIN_IN_SESSION, the engine's
        # default: the k = 4 rows and --profile too), or each ends the session ("joins restart" rows)
        eng.JOIN_IN_SESSION = bool(tweaks.get("join_in_session", Engine.JOIN_IN_SESSION))
        # a lone arrival read in the members' verify forward (Engine.MIX_JOINS, the default), or in a round of its
        # own ("joins read alone" rows, --mix-joins off / both)
        eng.MIX_JOINS = bool(tweaks.get("mix_joins", Engine.MIX_JOINS))
        if tweaks.get("no_start_cost"):  # batch_k without sessions' start costs (KPolicy.record_session)
            eng.k_policy.SESSION_MIN = 1 << 30
        return joins(eng, tweaks)

    def make_warm(spec_kw):
        eng = make(spec_kw)
        if spec_kw is not None and spec_kw[0] != "plain" and spec_kw[1].get("adaptive"):
            count_k_decisions(eng)
        t = time.perf_counter()
        n = eng.warmup(max_batch=max(args.concurrency), join_lens=(prompt_len,))  # the buckets this run reaches
        log(f"warm-up: {n} CUDA graphs captured in {time.perf_counter() - t:.1f} s")
        return eng

    rng = random.Random(1)
    if args.profile:  # where a speculative round's host time goes: k = 4, synthetic a = 0.8, 4 requests
        import cProfile
        import pstats

        eng = make((0.8, dict(k=4), args.overlap_spec != "off"))
        eng.warmup(max_batch=8)
        drive(eng, pool[:8], 64, concurrency=4)
        r0 = drive(eng, pool[8:16], 96, concurrency=4)
        prof = cProfile.Profile()
        prof.enable()
        r = drive(eng, pool[16:24], 96, concurrency=4)
        prof.disable()
        log(f"run without / with the profiler: TPOT p50 {r0['tpot_p50'] * 1e3:.2f} / {r['tpot_p50'] * 1e3:.2f} ms, "
            f"steps {r0['steps']} / {r['steps']}, step p50 {r0['step_p50'] * 1e3:.2f} ms, acc {r['acceptance']}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(40)
        pstats.Stats(prof).sort_stats("cumtime").print_stats(40)
        gr = eng.runner.graphs
        print("target graph replays", gr.replays, "eager steps", gr.eager_steps)
        dg = eng.drafter.runner.graphs
        print("draft graph replays", dg.replays, "eager steps", dg.eager_steps)
        return dict(rows=[], ratios=[], long_prompt=[])
    jw_ab = [None] + ([tuple(args.join_wait_ab)] if args.join_wait_ab else [])  # --join-wait-ab: side by side
    jw_tag = lambda jw: "" if jw is None else f", join wait {jw[0]:g}/{int(jw[1])}"
    configs = [("plain", None)] + [(f"plain{jw_tag(jw)}", ("plain", dict(join_wait=jw))) for jw in jw_ab[1:]
                                   if not args.join_wait_spec_only]
    for a in args.acceptance:
        label = "useless draft" if a == 0 else f"a={a}"
        modes = {"on": (("", True),), "off": (("", False),),
                 "both": (("", True), (", not overlapped", False))}[args.overlap_spec]
        mixes = {"on": ((True, ", mixed prefill"),), "off": ((False, ""),),
                 "both": ((False, ""), (True, ", mixed prefill"))}[args.mixed_prefill]
        for tag, ovs in modes:
            for mixed, mtag in mixes:
                configs += [(f"k=4, {label}{tag}{mtag}", (a, dict(k=4), ovs, mixed))]
                both = lambda v, off=False: {"on": (not off,), "off": (off,), "both": (False, True)}[v]  # noqa: E731
                for margin, restart, nsc, jw, jis, hold, mj in itertools.product(
                        args.switch_margin or [None], both(args.restart_on_new_k), both(args.start_cost, off=True),
                        jw_ab, both(args.join_in_session), both(args.join_hold), both(args.mix_joins)):
                    if not jis and not mj:  # (joins restarting read no prompt in a session: one row for both)
                        continue
                    gtag = ("" if margin is None else f", switch margin {margin:g}") + \
                        (", restart on new k" if restart else "") + (", no start cost" if nsc else "") + \
                        jw_tag(jw) + ("" if jis else ", joins restart") + ("" if hold else ", no join hold") + \
                        ("" if mj or not jis else ", joins read alone")
                    configs += [(f"adaptive, {label}{tag}{mtag}{gtag}",
                                 (a, dict(adaptive=True, k_max=8), ovs, mixed,
                                  dict(margin=margin, restart=restart, no_start_cost=nsc, join_wait=jw,
                                       join_in_session=jis, hold=hold, mix_joins=mj)))]
    if args.only:  # e.g. --only plain adaptive: a shorter run
        configs = [c for c in configs if any(c[0].startswith(o) for o in args.only)]
    if args.control:  # an A/A row: a second plain engine, measured after every other config (its ratio to plain
        # is the run's noise and order effect: in run 75 every host function ran ~35 % slower in the adaptive
        # engine measured after plain, a useless draft that never drafted included)
        configs.append(("plain, control", ("plain", {})))

    def sample_prompts(n: int) -> list[list[int]]:
        return rng.sample(pool, min(n, len(pool)))

    taken = []  # models an engine already holds

    def make_own(spec_kw):  # engines alive side by side: each its own models (enable_cuda_graphs replaces a
        nonlocal target, draft  # model's attention backend, whose buffers another engine's graphs would read)
        if taken:  # (the first engine takes the models built above)
            target = build_model(QWEN3_8B, None, seed=0)
            draft = build_model(QWEN3_06B, None, seed=3) if spec_kw is not None and spec_kw[0] != "plain" else None
        taken.append(target)
        return make_warm(spec_kw)

    if (args.poisson_ab or args.repeat) and len(configs) > 4:  # ~18 GB of weights, ~17 GB of caches per engine
        raise SystemExit(f"--poisson-ab / --repeat keep every engine alive: at most 4 configs on the 141 GB card "
                         f"(got {len(configs)}; narrow with --acceptance / --only)")
    if args.repeat:  # the closed loop's repetitions interleaved, as on the CPU (a drawn-length run at 64 requests
        # moved 7 % between two identical plain engines: run 76)
        res = interleaved(make_own, configs, pool, args, log, warm_levels=True)
        return dict(res, long_prompt=[], prompt_len=prompt_len)
    if args.poisson_ab:
        ab = poisson_ab(make_own, configs, sample_prompts, new, args.rates, args.poisson_ab, args.poisson_requests,
                        log)
        return dict(rows=ab["rows"], ratios=[], poisson_ab=ab["summary"], long_prompt=[], prompt_len=prompt_len,
                    new_tokens=new)
    rows = run_grid(make_warm, sample_prompts, new, args.concurrency, configs, log, rates=args.rates,
                    poisson_requests=args.poisson_requests)
    built.clear()  # (the engines kept for reuse: their caches go before the 4k check builds its own)
    free_memory()
    if args.no_4k:
        return dict(rows=rows, ratios=ratios(rows), long_prompt=[], prompt_len=prompt_len, new_tokens=new)
    # chunked prefill: a 4k prompt arrives while 4 requests decode
    late = []
    for budget in (128, 256, 512, 8192):
        eng = Engine.from_model(target, tok, device="cuda", dtype=BF16, cache=cache, max_num_seqs=64,
                                max_num_batched_tokens=budget, enable_prefix_caching=args.prefix_caching == "on")
        eng.warmup(max_batch=8)
        drive(eng, pool[:4], 8, concurrency=4)
        long_prompt = torch.randint(0, 151936, (4096,)).tolist()
        r = drive(eng, pool[:4], 192, concurrency=4, late=(0.15, long_prompt))
        r.update(max_num_batched_tokens=budget, p99_over_p50=r["step_gap_p99"] / r["step_gap_p50"],
                 step_gap_max=r.get("step_gap_max"))
        late.append(r)
        log(f"4k prompt mid-run, budget {budget}: running requests' step gap p50 {r['step_gap_p50'] * 1e3:.2f} ms, "
            f"p99 {r['step_gap_p99'] * 1e3:.2f} ms ({r['p99_over_p50']:.2f}x), max {r['step_gap_max'] * 1e3:.1f} ms; "
            f"the 4k prompt's TTFT {r['long_prompt_ttft'] * 1e3:.0f} ms")
        del eng
        free_memory()
    return dict(rows=rows, ratios=ratios(rows), long_prompt=late, prompt_len=prompt_len, new_tokens=new)


def cpu_main(args) -> dict:
    from forerun.models.registry import load_model

    torch.set_num_threads(args.threads)
    from forerun.bench_prompts import CODE_PROMPTS

    T0 = time.perf_counter()

    def log(m):
        print(f"[{time.perf_counter() - T0:6.1f}s] {m}", flush=True)

    q = args.quantize
    target, tok, _ = load_model("qwen2.5-coder-1.5b-instruct", quantize=q)
    from forerun.engine.engine import draft_dtype

    draft, dtok, _ = load_model("qwen2.5-coder-0.5b-instruct", quantize=q,
                                dtype=draft_dtype(SpecConfig(), torch.device("cpu"), torch.float32))
    log(f"models loaded (weights: {q})")
    prompts = []
    for p in CODE_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))

    at = [0]  # every config reads the same prompts in the same order (the prompts differ in length)

    def make(spec_kw):
        at[0] = 0
        spec_kw = dict(spec_kw) if spec_kw is not None else None
        priced = spec_kw.pop("price_catch_up", True) if spec_kw is not None else True
        timed_plain = spec_kw.pop("plain_rounds", True) if spec_kw is not None else True
        spec = SpecConfig() if spec_kw is None else SpecConfig(method="draft", draft_model=(draft, dtok), **spec_kw)
        eng = Engine.from_model(target, tok, device="cpu", spec=spec, max_num_seqs=8,
                                enable_prefix_caching=args.prefix_caching == "on")
        eng.PRICE_CATCH_UP = priced  # (Engine.PRICE_CATCH_UP: the draft's prompt reads priced against its savings)
        if not timed_plain:  # the veto's plain step from the cost model, as before the seventeenth session
            eng.k_policy.PLAIN_ROUNDS_MIN = 1 << 30
        return eng

    def prompts_for(n: int) -> list[list[int]]:
        at[0] += n
        return [prompts[i % len(prompts)] for i in range(at[0] - n, at[0])]

    configs = [("plain", None), ("k=4", dict(k=4))]
    if args.catch_up in ("on", "both"):
        configs.append(("adaptive", dict(adaptive=True, k_max=8)))
    if args.catch_up in ("off", "both"):
        configs.append(("adaptive, unpriced", dict(adaptive=True, k_max=8, price_catch_up=False)))
    if args.plain_rounds in ("off", "both"):
        configs.append(("adaptive, modelled plain step", dict(adaptive=True, k_max=8, plain_rounds=False)))
    if args.plain_rounds == "off":
        configs = [c for c in configs if c[0] != "adaptive"]
    if args.only:
        configs = [c for c in configs if c[0] == "plain" or any(c[0].startswith(o) for o in args.only)]
    if args.control:  # an A/A row: a second plain engine, measured like the others (the noise band of the run)
        configs.insert(1, ("plain, control", None))
    if args.repeat:
        return interleaved(make, configs, prompts, args, log)
    rows = run_grid(make, prompts_for, args.new_tokens, args.concurrency, configs, log)
    poisson = []
    for name, kw in configs if args.poisson_requests else ():  # (--poisson-requests 0: closed loop only)
        eng = make(kw)
        r = drive(eng, prompts[: args.poisson_requests], args.new_tokens, rate=args.rate, seed=3)
        r.update(config=name, rate=args.rate)
        poisson.append(r)
        log(f"Poisson {args.rate}/s {name}: {r['tok_s']:.2f} tok/s TTFT p50 {r['ttft_p50']:.2f} s TPOT p50 {r['tpot_p50'] * 1e3:.0f} ms")
    return dict(rows=rows, ratios=ratios(rows), poisson=poisson, new_tokens=args.new_tokens, quantize=q)


def interleaved(make, configs, prompts, args, log, warm_levels: bool = False) -> dict:
    """--repeat N: every config's engine built and warmed once (its k policy keeps what it learns, as a server's
    does), then N repetitions of the closed loop at each concurrency, configs interleaved in an order that rotates
    per repetition, every config on the same prompts within a repetition. A config's ratio is the median over
    repetitions of its throughput over plain's in the same repetition: this CPU's speed drifts by 10-40 % between
    runs minutes apart, and on the H200 two identical plain engines ran 7 % apart, so only same-repetition ratios
    compare. warm_levels (GPU): each engine first runs the workload of every level once (its graphs captured)."""
    engines = {}
    for name, kw in configs:
        engines[name] = make(kw)
        drive(engines[name], prompts[:1], 8, concurrency=1)  # warm-up
        for c in args.concurrency if warm_levels else ():
            drive(engines[name], prompts[: 2 * c], args.new_tokens, concurrency=c)
    per = int(os.environ.get("ONLINE_REPEAT", 3))
    rows, at = [], 0
    for rep in range(args.repeat):
        for c in args.concurrency:
            ps = [prompts[(at + j) % len(prompts)] for j in range(per * c)]
            at += per * c
            names = [n for n, _ in configs]
            names = names[rep % len(names):] + names[: rep % len(names)]
            for name in names:
                r = drive(engines[name], ps, args.new_tokens, concurrency=c)
                r.update(config=name, concurrency=c, rep=rep)
                rows.append(r)
                log(f"rep {rep} {name:>20} c={c}: {r['tok_s']:.2f} tok/s, drafted {r['drafted']}, "
                    f"acceptance {r['acceptance']}")
    summary = []
    for name, _ in configs:
        if name == "plain":
            continue
        for c in args.concurrency:
            each = rep_ratios(rows, name, "concurrency", c, lambda r, plain: r["tok_s"] / plain["tok_s"])
            summary.append(dict(config=name, concurrency=c, vs_plain=statistics.median(each),
                                each=[round(x, 4) for x in each], min=min(each), max=max(each)))
    return dict(rows=rows, ratios=summary, poisson=[], new_tokens=args.new_tokens, quantize=args.quantize,
                repeat=args.repeat, requests_per_level=per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--gpu", action="store_true")
    g.add_argument("--cpu", action="store_true")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None)
    ap.add_argument("--acceptance", type=float, nargs="+", default=None,
                    help="GPU: synthetic acceptance rates (0: the useless draft); default 0.6 0.8 0.9 0")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--new-tokens-range", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                    help="GPU: each request's max_tokens drawn uniformly from LO..HI (seeded, the same for every "
                         "config) instead of --new-tokens for all: plain decoding's requests then no longer finish "
                         "on the same step")
    ap.add_argument("--blocks", type=int, default=None, help="GPU: KV blocks per pool (default 4000)")
    ap.add_argument("--threads", type=int, default=None, help="CPU: torch threads (default 2)")
    ap.add_argument("--quantize", default=None, choices=["auto", "none", "int8", "int4"],
                    help="CPU: how the GGUF weights are held (as forerun bench: auto = kept quantized, int4 or int8; "
                         "none = widened to fp32, the runs before the quantized kernels)")
    ap.add_argument("--rate", type=float, default=None, help="CPU: the Poisson run's requests/s (default 0.05)")
    ap.add_argument("--poisson-requests", type=int, default=None, help="requests per Poisson run (CPU 4, GPU 64)")
    ap.add_argument("--rates", type=float, nargs="*", default=None,
                    help="GPU: Poisson arrival rates (requests/s) run after the closed loop (default 10 40 100)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--mixed-prefill", choices=["on", "off", "both"], default="off",
                    help="GPU: new prompts share rounds with verify rows (on: Engine(mixed_prefill=True)) or are read "
                         "alone while the others run overlapped sessions (off, the engine's default)")
    ap.add_argument("--only", nargs="+", default=None, help="run only the configs whose names start so "
                    "(plain, k=4, adaptive)")
    ap.add_argument("--profile", action="store_true", help="GPU: profile one speculative run instead")
    ap.add_argument("--switch-margin", type=float, nargs="+", default=None, metavar="M",
                    help="GPU: adaptive rows with KPolicy.SWITCH_MARGIN = M (several values: side by side; "
                         "default: the policy's own)")
    ap.add_argument("--restart-on-new-k", choices=["on", "off", "both"], default="off",
                    help="GPU: adaptive rows whose overlapped sessions end when k changes (on: "
                         "Engine.KEEP_SESSION_ON_NEW_K = False, the tenth session's engine), go on (off, the default), "
                         "or both side by side")
    ap.add_argument("--start-cost", choices=["on", "off", "both"], default="on",
                    help="GPU: adaptive rows whose k policy weighs overlapped sessions' start costs (on, the default), "
                         "does not (off: KPolicy.SESSION_MIN out of reach), or both side by side")
    ap.add_argument("--join-wait", type=float, nargs=2, default=None, metavar=("RATIO", "STEPS"),
                    help="GPU: every engine holds joins back while a session runs until RATIO x the running requests "
                         "wait or the oldest has waited STEPS steps (Engine.JOIN_WAIT_RATIO / JOIN_WAIT_STEPS; off "
                         "by default)")
    ap.add_argument("--join-wait-ab", type=float, nargs=2, default=None, metavar=("RATIO", "STEPS"),
                    help="GPU: besides every plain and adaptive config, the same config holding joins back "
                         "(--join-wait's RATIO STEPS), side by side in the same run")
    ap.add_argument("--join-wait-spec-only", action="store_true",
                    help="GPU: --join-wait-ab adds no plain row with the wait (plain without it is the reference)")
    ap.add_argument("--join-in-session", choices=["on", "off", "both"], default="on",
                    help="GPU: adaptive rows whose overlapped sessions take arrivals and let finished requests leave "
                         "(on: Engine.JOIN_IN_SESSION, the default since the thirteenth session; runs 35-36 labeled "
                         "them 'joins in session'), end at each (off: labeled 'joins restart' from run 37 on), or "
                         "both side by side")
    ap.add_argument("--join-hold", choices=["on", "off", "both"], default="on",
                    help="GPU: adaptive rows holding a due join while a running request is about to finish "
                         "(Engine.JOIN_HOLD_STEPS, on: the default), not ('no join hold'), or both side by side")
    ap.add_argument("--mix-joins", choices=["on", "off", "both"], default="on",
                    help="GPU: adaptive rows reading a lone arrival in the session members' next verify forward "
                         "(Engine.MIX_JOINS, on: the default since the fifteenth session), in a round of its own "
                         "('joins read alone'), or both side by side")
    ap.add_argument("--catch-up", choices=["on", "off", "both"], default="on",
                    help="CPU: adaptive k prices the draft's prompt reads against what drafting saves (on: "
                         "Engine.PRICE_CATCH_UP, the default), not (off: every prompt read by the draft), or both")
    ap.add_argument("--poisson-ab", type=int, default=0, metavar="REPS",
                    help="GPU: only Poisson arrivals, the configs interleaved (all engines built first), each rate "
                         "REPS times; reports the median over repetitions of plain TPOT / config TPOT")
    ap.add_argument("--prefix-caching", choices=["on", "off"], default="off",
                    help="engines with the prefix cache (the engine's default since session 41; off here, as every "
                         "earlier run of this script measured)")
    ap.add_argument("--no-4k", action="store_true", help="GPU: only the concurrency sweep (no 4k-prompt check)")
    ap.add_argument("--overlap-spec", choices=["on", "off", "both"], default="on",
                    help="GPU: speculative rounds overlapped (Engine(overlap_spec=True), engine/overlap_spec.py, the "
                         "default), not, or both side by side in the same run")
    ap.add_argument("--plain-rounds", choices=["on", "off", "both"], default="on",
                    help="CPU: the veto weighs drafting against the timed plain rounds (KPolicy.record_plain_round, "
                         "the default), the cost model's plain step (before), or both side by side")
    ap.add_argument("--repeat", type=int, default=0, metavar="N",
                    help="N interleaved repetitions of the closed loop, every engine kept warm (GPU: at most 4 configs, "
                         "each its own models); ratios are medians of same-repetition ratios (no Poisson rows)")
    ap.add_argument("--control", action="store_true",
                    help="a second plain engine as one more config ('plain, control'; GPU: measured last): its ratio "
                         "to plain is the run's noise (this CPU: 0.84-1.05x between identical engines, 15 s apart)")
    args = ap.parse_args()
    if args.cpu:  # GPU-only flags are refused, not ignored
        given = [f for f, v in (("--profile", args.profile), ("--no-4k", args.no_4k),
                                ("--new-tokens-range", args.new_tokens_range), ("--poisson-ab", args.poisson_ab),
                                ("--switch-margin", args.switch_margin), ("--rates", args.rates),
                                ("--restart-on-new-k", args.restart_on_new_k != "off"),
                                ("--start-cost", args.start_cost != "on"), ("--join-wait", args.join_wait),
                                ("--join-wait-ab", args.join_wait_ab),
                                ("--join-in-session", args.join_in_session != "on"),
                                ("--join-hold", args.join_hold != "on"), ("--mix-joins", args.mix_joins != "on"),
                                ("--join-wait-spec-only", args.join_wait_spec_only),
                                ("--mixed-prefill", args.mixed_prefill != "off"),
                                ("--overlap-spec", args.overlap_spec != "on"), ("--acceptance", args.acceptance),
                                ("--blocks", args.blocks)) if v]
        if given:
            ap.error(f"{', '.join(given)}: GPU only (--gpu)")
        args.threads, args.rate = args.threads or 2, 0.05 if args.rate is None else args.rate
        args.quantize = args.quantize or "auto"
    else:
        given = [f for f, v in (("--threads", args.threads), ("--rate", args.rate is not None),
                                ("--quantize", args.quantize), ("--catch-up", args.catch_up != "on"),
                                ("--plain-rounds", args.plain_rounds != "on")) if v]
        if given:
            ap.error(f"{', '.join(given)}: CPU only (--cpu)")
        args.acceptance = [0.6, 0.8, 0.9, 0.0] if args.acceptance is None else args.acceptance
        args.blocks = args.blocks or 4_000
    if args.gpu:
        args.concurrency = args.concurrency or [1, 2, 4, 8, 16, 32, 64]
        args.new_tokens = tuple(args.new_tokens_range) if args.new_tokens_range else (args.new_tokens or 96)
        args.rates = [10.0, 40.0, 100.0] if args.rates is None else args.rates
        args.poisson_requests = args.poisson_requests or 64
        res = gpu_main(args)
        name = "online_gpu"
        res["device"] = torch.cuda.get_device_name()
    else:
        args.concurrency = args.concurrency or [1, 2]
        args.new_tokens = args.new_tokens or 32
        args.poisson_requests = 4 if args.poisson_requests is None else args.poisson_requests
        res = cpu_main(args)
        name = "online_cpu"
        res["device"] = "cpu"
        res["load_average"] = os.getloadavg()
    res["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    out_dir = args.out or os.path.join(REPO, "benchmarks", "results")
    os.makedirs(out_dir, exist_ok=True)
    json.dump(res, open(os.path.join(out_dir, f"{name}.json"), "w"), indent=1)
    plot(res["rows"], os.path.join(out_dir, f"{name}.png"), f"forerun online engine ({res['device']})")
    print("\nspeculation / plain throughput:")
    for r in res["ratios"]:
        print(f"  {r['config']:>26} c={r['concurrency']:<3} {r['vs_plain']:.3f}x")
    print(f"wrote {out_dir}/{name}.json")


if __name__ == "__main__":
    main()
