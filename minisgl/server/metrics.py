"""Prometheus metrics for GET /metrics: request and token counters and latencies, measured where
the API server receives each token, and the scheduler's load as it last reported it."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from minisgl.messages import Finished, SchedulerLoad

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self._prompt_total = self._cached_total = 0  # for the hit rate
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "minisgl_requests", "Finished requests", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "minisgl_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.cached_prompt_tokens = Counter(
            "minisgl_cached_prompt_tokens",
            "Prompt tokens of finished requests found in the prefix cache",
            registry=r,
        )
        self.generation_tokens = Counter(
            "minisgl_generation_tokens", "Generated tokens", registry=r
        )
        self.ttft = Histogram(
            "minisgl_time_to_first_token_seconds",
            "From submission to the first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "minisgl_inter_token_latency_seconds",
            "Between two tokens of one request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("minisgl_running_requests", "Requests being computed", registry=r)
        self.queued = Gauge("minisgl_queued_requests", "Requests waiting to start", registry=r)
        self.kv_pages = Gauge(
            "minisgl_kv_pages",
            "KV cache pages: held by requests, held by the prefix cache only, free",
            ["state"],
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "minisgl_prefix_cache_hit_rate",
            "Share of finished requests' prompt tokens found in the prefix cache",
            registry=r,
        )
        self.preemptions = Gauge("minisgl_preemptions", "Preemptions so far", registry=r)
        self.integrity_checks = Gauge(
            "minisgl_kv_integrity_checks", "KV cache integrity checks run when idle", registry=r
        )
        self.integrity_failures = Gauge(
            "minisgl_kv_integrity_failures", "KV cache integrity checks that failed", registry=r
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
