"""Prometheus metrics on a dedicated registry (never the process-global one, so two apps in one
process, as in tests, do not collide).

Engine-side numbers (running/waiting, KV usage, prefix-cache and preemption counters) are read
from the client's latest `SchedulerStats` at scrape time; request-level counters and histograms
are observed here as responses finish. `kv_cache_usage_perc` is a fraction in [0, 1], as vLLM's is.
`request_queue_time_seconds` is approximate: the frontend does not learn when the scheduler first
ran a request, so it records arrival -> first delta (an upper bound that includes the prefill).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from pagebus.bus.messages import SchedulerStats
from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _StatsCollector(Collector):
    def __init__(self, stats: Callable[[], SchedulerStats | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats() or SchedulerStats()
        yield GaugeMetricFamily(
            "pagebus:num_requests_running", "Requests in the running batch", s.num_running
        )
        yield GaugeMetricFamily(
            "pagebus:num_requests_waiting", "Requests waiting to be scheduled", s.num_waiting
        )
        yield GaugeMetricFamily(
            "pagebus:kv_cache_usage_perc", "Fraction of KV blocks held by requests (0-1)", s.kv_usage
        )
        yield CounterMetricFamily(
            "pagebus:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            s.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            "pagebus:prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_cache_hits
        )
        yield CounterMetricFamily("pagebus:num_preemptions", "Requests preempted", s.num_preemptions)
        yield CounterMetricFamily(
            "pagebus:engine_steps", "Engine steps finished (what stall detection counts)", s.num_steps
        )
        yield from _spec_decode_metrics(s)


def _spec_decode_metrics(s: SchedulerStats) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters, plus drafted-per-position (drafts here vary in
    length, so a position's acceptance rate is accepted / drafted at that position)."""
    yield CounterMetricFamily(
        "pagebus:spec_decode_num_drafts", "Verifications of at least one draft token", s.spec_num_drafts
    )
    yield CounterMetricFamily(
        "pagebus:spec_decode_num_draft_tokens", "Draft tokens verified", s.spec_num_draft_tokens
    )
    yield CounterMetricFamily(
        "pagebus:spec_decode_num_accepted_tokens", "Draft tokens accepted", s.spec_num_accepted_tokens
    )
    drafted = CounterMetricFamily(
        "pagebus:spec_decode_num_drafted_tokens_per_pos",
        "Draft tokens verified at each position",
        labels=["position"],
    )
    accepted = CounterMetricFamily(
        "pagebus:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted at each position",
        labels=["position"],
    )
    for i, (d, a) in enumerate(zip(s.spec_drafted_per_position, s.spec_accepted_per_position, strict=True)):
        drafted.add_metric([str(i)], d)
        accepted.add_metric([str(i)], a)
    yield drafted
    yield accepted
    rate = s.spec_num_accepted_tokens / s.spec_num_draft_tokens if s.spec_num_draft_tokens else 0.0
    yield GaugeMetricFamily("pagebus:spec_decode_acceptance_rate", "Accepted / verified draft tokens", rate)
    mean = 1.0 + s.spec_num_accepted_tokens / s.spec_num_drafts if s.spec_num_drafts else 0.0
    yield GaugeMetricFamily(
        "pagebus:spec_decode_mean_accepted_length", "Tokens gained per verification (accepted + 1)", mean
    )


class Metrics:
    def __init__(
        self,
        stats: Callable[[], SchedulerStats | None],
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StatsCollector(stats))
        r = self.registry
        # pagebus:parallel_config_info{tensor_parallel_size="2",pipeline_parallel_size="1"} 1.0
        Info("pagebus:parallel_config", "Worker layout: tensor x pipeline ranks", registry=r).info(
            {
                "tensor_parallel_size": str(tensor_parallel_size),
                "pipeline_parallel_size": str(pipeline_parallel_size),
            }
        )
        self.prompt_tokens = Counter("pagebus:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("pagebus:generation_tokens", "Tokens generated", registry=r)
        self.request_success = Counter(
            "pagebus:request_success",
            "Finished choices by finish reason",
            ["finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "pagebus:time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pagebus:inter_token_latency_seconds",
            "Time between token deltas",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pagebus:e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "pagebus:request_queue_time_seconds",
            "Arrival to first delta (approximate queue time; includes prefill)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Per-request timing fed to the histograms as deltas arrive."""

    def __init__(self, metrics: Metrics, arrival: float) -> None:
        self.m, self.arrival = metrics, arrival
        self.last_token: float | None = None
        self.first_delta = False

    def on_delta(self, now: float, num_new_tokens: int) -> None:
        if not self.first_delta:
            self.first_delta = True
            self.m.queue_time.observe(now - self.arrival)
        if num_new_tokens:
            self.m.generation_tokens.inc(num_new_tokens)
            if self.last_token is None:
                self.m.ttft.observe(now - self.arrival)
            else:
                self.m.itl.observe(now - self.last_token)
            self.last_token = now

    def on_finish(self, now: float, prompt_tokens: int, finish_reasons: list[str | None]) -> None:
        self.m.e2e.observe(now - self.arrival)
        self.m.prompt_tokens.inc(prompt_tokens)
        for r in finish_reasons:
            if r is not None:
                self.m.request_success.labels(finished_reason=r).inc()
