"""Prometheus metrics for GET /metrics: request and token counters and latencies, measured where
the API server receives each token, and the scheduler's load as it last reported it."""

import functools
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from minisgl.messages import Finished, SchedulerLoad

# up to 40 minutes, as vLLM's: a request that queues behind a long backlog waits that long
_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 150, 300, 600, 1200,
    2400,
)  # fmt: skip


class _SchedulerTotals(Collector):
    """The scheduler's running totals as it last reported them, exposed as counters (a
    prometheus_client Counter can only be incremented)."""

    def __init__(self) -> None:
        self.load: SchedulerLoad | None = None

    def collect(self) -> Iterator[CounterMetricFamily]:
        load = self.load
        for name, help, value in (
            ("minisgl_preemptions", "Preemptions", load and load.num_preemptions),
            (
                "minisgl_kv_integrity_checks",
                "KV cache integrity checks run when idle",
                load and load.integrity_checks,
            ),
            (
                "minisgl_kv_integrity_failures",
                "KV cache integrity checks that failed",
                load and load.integrity_failures,
            ),
        ):
            yield CounterMetricFamily(name, help, value=value or 0)


class Metrics:
    def __init__(self) -> None:
        self._prompt_total = self._cached_total = 0  # for the hit rate
        self.registry = r = CollectorRegistry()
        counter = functools.partial(Counter, registry=r)
        gauge = functools.partial(Gauge, registry=r)
        latency = functools.partial(Histogram, buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = counter(
            "minisgl_requests",
            "Finished requests (error: ended in error once queued; refusals are not counted)",
            ["finish_reason"],
        )
        self.prompt_tokens = counter("minisgl_prompt_tokens", "Prompt tokens of finished requests")
        self.cached_prompt_tokens = counter(
            "minisgl_cached_prompt_tokens",
            "Prompt tokens of finished requests found in the prefix cache",
        )
        self.generation_tokens = counter("minisgl_generation_tokens", "Generated tokens")
        self.ttft = latency(
            "minisgl_time_to_first_token_seconds", "From submission to the first token"
        )
        self.itl = latency(
            "minisgl_inter_token_latency_seconds", "Between two tokens of one request"
        )
        self.e2e = latency(
            "minisgl_e2e_request_latency_seconds", "From submission to the request's end"
        )
        self.running = gauge("minisgl_running_requests", "Requests being computed")
        self.queued = gauge("minisgl_queued_requests", "Requests waiting to start")
        self.kv_pages = gauge(
            "minisgl_kv_pages",
            "KV cache pages: held by requests, held by the prefix cache only, free",
            ["state"],
        )
        self.prefix_hit_rate = gauge(
            "minisgl_prefix_cache_hit_rate",
            "Share of finished requests' prompt tokens found in the prefix cache",
        )
        self.kv_usage = gauge(
            "minisgl_kv_cache_usage", "Share of the KV cache's pages held by requests (0-1)"
        )
        self._totals = _SchedulerTotals()
        r.register(self._totals)

    def tokens_arrived(self, num_tokens: int, seconds: float, first: bool) -> None:
        """Tokens of one request that reached the server together, `seconds` after its last."""
        (self.ttft if first else self.itl).observe(seconds)
        self.generation_tokens.inc(num_tokens)

    def request_finished(self, end: Finished, seconds: float | None) -> None:
        """A request that ended `seconds` after its submission (None: not timed)."""
        self.requests.labels(end.reason).inc()
        if seconds is not None:
            self.e2e.observe(seconds)
        self.prompt_tokens.inc(end.prompt_tokens)
        self.cached_prompt_tokens.inc(end.cached_tokens)
        self._prompt_total += end.prompt_tokens
        self._cached_total += end.cached_tokens
        self.prefix_hit_rate.set(self._cached_total / max(1, self._prompt_total))

    def request_failed(self) -> None:
        self.requests.labels("error").inc()

    def set_load(self, load: SchedulerLoad) -> None:
        self.running.set(load.num_running)
        self.queued.set(load.num_waiting)
        self.kv_pages.labels("request").set(load.request_pages)
        self.kv_pages.labels("cached").set(load.cached_pages)
        self.kv_pages.labels("free").set(load.free_pages)
        pages = load.request_pages + load.cached_pages + load.free_pages
        self.kv_usage.set(load.request_pages / max(1, pages))
        self._totals.load = load

    def render(self) -> bytes:
        return generate_latest(self.registry)
