"""The prefix-cache hit rate of one run: the growth of the server's prompt-token and cached-token
counters (GET /metrics, Prometheus text) from before the run to after it. A server without those
counters (another engine, or one that exports only a lifetime ratio) gets None, with a note."""

from typing import Any

import httpx

PROMPT_TOKENS = "minisgl_prompt_tokens_total"
CACHED_TOKENS = "minisgl_cached_prompt_tokens_total"


def scrape(base_url: str, headers: dict[str, str]) -> dict[str, float]:
    """Every sample of GET /metrics by name (with its labels); empty if there is no such page."""
    try:
        response = httpx.get(base_url + "/metrics", headers=headers, timeout=10, trust_env=False)
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    samples = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def cache_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Prompt tokens and cached prompt tokens the run added, and their ratio."""

    def grown(name: str) -> float | None:
        return after[name] - before.get(name, 0.0) if name in after else None

    prompt, cached = grown(PROMPT_TOKENS), grown(CACHED_TOKENS)
    missing = [
        name for name, value in ((PROMPT_TOKENS, prompt), (CACHED_TOKENS, cached)) if value is None
    ]
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt and cached is not None else None,
        "note": f"/metrics has no {' or '.join(missing)}" if missing else None,
    }
