"""Prometheus metrics with vLLM's names (prefix `forerun:` instead of `vllm:`), so vLLM dashboards work.

One CollectorRegistry per app (not the process-global one): two servers in one process (tests) do not share
or collide. Engine counters and gauges (speculation, running/waiting, KV blocks) are read from one
`EngineStats` snapshot at scrape time by a custom collector, so they cannot drift from the engine; latency
histograms and per-request counters are observed by the server as requests finish.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's buckets (vllm/engine/metrics.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


class EngineCollector:
    """Engine state at scrape time: vLLM's spec-decode counters, running/waiting, KV blocks used/free."""

    def __init__(self, stats: Callable[[], object], model_name: str) -> None:
        self._stats, self._model = stats, model_name

    def describe(self):
        return []  # no describe-time collection: stats() may not be callable before the engine starts

    def collect(self):
        s = self._stats()
        labels, m = ["model_name"], [self._model]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(m, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(m, value)
            return c

        yield gauge("forerun:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("forerun:num_requests_waiting", "Requests waiting to be admitted.", s.num_waiting)
        used = s.kv_blocks_total - s.kv_blocks_free
        yield gauge("forerun:kv_blocks_used", "Target KV-cache blocks in use.", used)
        yield gauge("forerun:kv_blocks_free", "Target KV-cache blocks free.", s.kv_blocks_free)
        yield gauge("forerun:kv_cache_usage_perc", "Fraction of target KV-cache blocks in use (0..1).",
                    used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        yield counter("forerun:num_preemptions", "Cumulative preemptions.", s.num_preemptions)
        yield counter("forerun:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      getattr(s, "prefix_cache_queries", 0))
        yield counter("forerun:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      getattr(s, "prefix_cache_hits", 0))
        yield counter("forerun:spec_decode_num_drafts", "Speculative rounds that drafted at least one token.",
                      s.spec_num_drafts)
        yield counter("forerun:spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_num_draft_tokens)
        yield counter("forerun:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_num_accepted_tokens)
        per_pos = CounterMetricFamily("forerun:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, per draft position.", labels=["model_name", "position"])
        for pos, n in enumerate(s.spec_accepted_per_pos):
            per_pos.add_metric([self._model, str(pos)], n)
        yield per_pos


class ServerMetrics:
    """The app's registry: engine collector + latency histograms + request/token counters."""

    def __init__(self, stats: Callable[[], object], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(stats, model_name))
        kw = dict(labelnames=["model_name"], registry=self.registry)
        self.ttft = Histogram("forerun:time_to_first_token_seconds", "Time to first token (arrival to first token).",
                              buckets=TTFT_BUCKETS, **kw).labels(model_name)
        self.tpot = Histogram("forerun:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", buckets=TPOT_BUCKETS,
                              **kw).labels(model_name)
        self.e2e = Histogram("forerun:e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=E2E_BUCKETS, **kw).labels(model_name)
        self.prompt_tokens = Counter("forerun:prompt_tokens", "Prefill tokens processed.", **kw).labels(model_name)
        self.generation_tokens = Counter("forerun:generation_tokens", "Tokens generated.", **kw).labels(model_name)
        self.success = Counter("forerun:request_success", "Finished requests (choices), by finish reason.",
                               labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.errors = Counter("forerun:http_errors", "Requests answered with an error, by status.",
                              labelnames=["model_name", "status"], registry=self.registry)
        self._model = model_name

    def finished(self, reason: str, prompt_tokens: int, output_tokens: int, arrival: float, first: float | None,
                 end: float) -> None:
        """One choice finished: arrival, first-token and end times from time.perf_counter()."""
        self.success.labels(self._model, reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        self.e2e.observe(end - arrival)
        if first is not None:
            self.ttft.observe(first - arrival)
            if output_tokens > 1:
                self.tpot.observe((end - first) / (output_tokens - 1))

    def error(self, status: int) -> None:
        self.errors.labels(self._model, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
