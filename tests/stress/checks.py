"""What every stress scenario checks: answers in OpenAI's error shape, metric deltas, the clean
state a scenario that the server survives must leave."""

from collections.abc import Callable
from typing import Any

import httpx

from ..server_process import ServerProcess, wait_for

MODEL = "stories"  # the name every stress server serves the embedded stories260K model under
RUNNING = "minisgl_running_requests"
QUEUED = "minisgl_queued_requests"
REQUEST_PAGES = 'minisgl_kv_pages{state="request"}'
GENERATED = "minisgl_generation_tokens_total"
PROMPT_TOKENS = "minisgl_prompt_tokens_total"
FIRST_TOKENS = "minisgl_time_to_first_token_seconds_count"  # requests that got a first token
PREEMPTIONS = "minisgl_preemptions_total"
CHECKS = "minisgl_kv_integrity_checks_total"
FAILURES = "minisgl_kv_integrity_failures_total"
REASONS = ("stop", "length", "abort", "error")

Metrics = dict[str, float]


def finished(reason: str) -> str:
    """The counter of engine requests that ended for `reason`."""
    return f'minisgl_requests_total{{finish_reason="{reason}"}}'


def delta(before: Metrics, after: Metrics, name: str) -> float:
    # a labelled counter appears only once it has counted something
    return after.get(name, 0.0) - before.get(name, 0.0)


def ended(before: Metrics, after: Metrics) -> float:
    """Engine requests that ended, for any reason, between the two snapshots."""
    return sum(delta(before, after, finished(r)) for r in REASONS)


def wait_for_metrics(
    server: ServerProcess, condition: Callable[[Metrics], bool], timeout: float = 30
) -> Metrics:
    """The first snapshot of the server's metrics that meets `condition`."""
    seen: list[Metrics] = []

    def met() -> bool:
        seen.append(server.metrics())
        return condition(seen[-1])

    wait_for(met, timeout, "metrics never met the condition")
    return seen[-1]


def check_error_body(body: Any, detail: str = "") -> dict[str, Any]:
    """`body` is OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    detail = detail or repr(body)[:300]
    assert isinstance(body, dict) and set(body) == {"error"}, detail
    error = body["error"]
    assert isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error), detail
    assert isinstance(error["message"], str) and error["message"], detail
    assert isinstance(error["type"], str) and error["type"], detail
    assert error["param"] is None or isinstance(error["param"], str), detail
    assert error["code"] is None or isinstance(error["code"], (str, int)), detail
    return error


def assert_openai_error(response: httpx.Response, status: int | None = None) -> dict[str, Any]:
    """A client error (or exactly `status`) whose JSON body is OpenAI's error shape."""
    detail = f"{response.status_code}: {response.text[:300]!r}"
    if status is None:
        assert 400 <= response.status_code < 500, detail
    else:
        assert response.status_code == status, detail
    try:
        body = response.json()
    except ValueError as e:
        raise AssertionError(f"not JSON: {detail}") from e
    return check_error_body(body, detail)


def assert_clean(server: ServerProcess, before: Metrics, model: str | None = MODEL) -> None:
    """The end of every scenario the server survives: a small completion (for `model`; None:
    the served one) answers, then nothing runs or waits, no request holds a page, and the
    integrity check ran since `before` and never failed."""
    small = {"prompt": "Once", "max_tokens": 2} | ({} if model is None else {"model": model})
    small = server.post("/v1/completions", json=small)
    assert small.status_code == 200, small.text
    m = wait_for_metrics(
        server,
        lambda m: m[RUNNING] == m[QUEUED] == m[REQUEST_PAGES] == 0 and m[CHECKS] > before[CHECKS],
    )
    assert m[FAILURES] == 0
