"""Prometheus metrics for GET /metrics: request and token counters and latencies, measured where
the API server receives each token, and the scheduler's load as it last reported it."""

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from minisgl.messages import Finished, SchedulerLoad

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self._prompt_total = self._cached_total = 0  # for the hit rate
        self.registry = r = CollectorRegistry()
        counter = functools.partial(Counter, registry=r)
        gauge = functools.partial(Gauge, registry=r)
        latency = functools.partial(Histogram, buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = counter("minisgl_requests", "Finished requests", ["finish_reason"])
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
        self.preemptions = gauge("minisgl_preemptions", "Preemptions so far")
        self.integrity_checks = gauge(
            "minisgl_kv_integrity_checks", "KV cache integrity checks run when idle"
        )
        self.integrity_failures = gauge(
            "minisgl_kv_integrity_failures", "KV cache integrity checks that failed"
        )

    def tokens_arrived(self, num_tokens: int, seconds: float, first: bool) -> None:
        """Tokens of one request that reached the server together, `seconds` after its last."""
        (self.ttft if first else self.itl).observe(seconds)
        self.generation_tokens.inc(num_tokens)

    def request_finished(self, end: Finished) -> None:
        self.requests.labels(end.reason).inc()
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
        self.preemptions.set(load.num_preemptions)
        self.integrity_checks.set(load.integrity_checks)
        self.integrity_failures.set(load.integrity_failures)

    def render(self) -> bytes:
        return generate_latest(self.registry)
