"""A run's metrics as vLLM's `bench serve` defines them (vllm/benchmarks/serve.py), from the
client's timings of each request:

- TTFT: from sending to the first streamed event with a choice;
- TPOT: (e2e latency - TTFT) / (output tokens - 1), one value a request;
- ITL: every gap between two streamed events of a request (an event may hold several tokens);
- E2EL: from sending to the last streamed event;
- goodput: completed requests/s that meet every SLO given (`ttft:MS tpot:MS e2el:MS`); a request
  of one output token counts with a TPOT of 0.

Each latency is reported in ms as mean, p50, p90 and p99 (numpy's linear percentiles, as vLLM).
"""

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from client import RequestResult

SLO_METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)


def parse_slos(specs: Sequence[str]) -> dict[str, float]:
    """{"ttft": 500.0, ...} from ["ttft:500", ...]; values in ms."""
    slos = {}
    for spec in specs:
        name, _, value = spec.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if name not in SLO_METRICS or ms < 0:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {SLO_METRICS}, not {spec!r}")
        slos[name] = ms
    return slos


def tpot(result: RequestResult) -> float:
    """Seconds per output token after the first; 0 for a request of one token."""
    assert result.ttft is not None, "only completed requests have a TPOT"
    if result.output_tokens < 2:
        return 0.0
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def distribution(seconds: Sequence[float]) -> dict[str, float | None]:
    """Mean and percentiles in ms; None where there are no values."""
    if not seconds:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = 1e3 * np.asarray(seconds, dtype=float)
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    assert result.ttft is not None, "only completed requests meet SLOs"
    seconds = {"ttft": result.ttft, "tpot": tpot(result), "e2el": result.latency}
    return all(seconds[name] * 1e3 <= ms for name, ms in slos.items())


def count_text_tokens(results: Sequence[RequestResult], tokenize: Callable[[str], list]) -> None:
    """The output tokens of each request whose server sent no usage chunk: its streamed text
    tokenized again, as vLLM's `bench serve` counts them (an event may hold several tokens)."""
    for r in results:
        if r.ok and not r.tokens_from_usage:
            r.output_tokens = len(tokenize(r.text))


def _count_source(done: Sequence[RequestResult]) -> str | None:
    """Where the output token counts come from: "usage" (the usage chunk), "text" (the streamed
    text tokenized again, where the server sent no usage), "mixed", or None without results."""
    sources = {"usage" if r.tokens_from_usage else "text" for r in done}
    return sources.pop() if len(sources) == 1 else ("mixed" if sources else None)


def summarize(
    results: Sequence[RequestResult],
    prompt_lens: Sequence[int],
    duration_s: float,
    slos: dict[str, float],
) -> dict[str, Any]:
    """The metrics of one run; `prompt_lens` (by request index) counts the prompt tokens of the
    requests whose usage chunk gave none."""
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(prompt_lens[r.index] if r.prompt_tokens is None else r.prompt_tokens for r in done)
    cached = [r.cached_tokens for r in done]
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": [r.error for r in results if not r.ok][:5],
        "duration_s": duration_s,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "output_tokens_from": _count_source(done),
        "usage_cached_tokens": sum(cached) if cached and None not in cached else None,
        "request_throughput": len(done) / duration_s,
        "request_goodput": sum(meets_slos(r, slos) for r in done) / duration_s if slos else None,
        "output_throughput": output / duration_s,
        "total_token_throughput": (prompt + output) / duration_s,
        "ttft_ms": distribution([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution([tpot(r) for r in done if r.output_tokens > 1]),
        "itl_ms": distribution([gap for r in done for gap in r.itl]),
        "e2el_ms": distribution([r.latency for r in done]),
    }
