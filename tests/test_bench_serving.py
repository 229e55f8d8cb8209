"""The online serving benchmark: its metrics and arrivals against hand-computed values, its trace
loader, and a smoke run of the whole tool (real processes, real HTTP) against our server on the
embedded model, checking that its JSON has every field with sane values."""

import itertools
import json
import math
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from .conftest import DEVICE
from .server_process import free_port, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark" / "online"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark" / "offline"))
from client import RequestResult, run_clients, split_jobs
from common import make_workload
from serving_metrics import count_text_tokens, parse_slos, summarize
from workload import arrivals, load_trace, random_workload, shifted

REPO = Path(__file__).resolve().parents[1]
BENCH_SERVING = REPO / "benchmark" / "online" / "bench_serving.py"

# RequestResult(index, ok, sent at, TTFT, ITLs, E2E latency, output tokens), times in s
# request 0: first event at 0.1 s, then 0.3 and 0.4 (gaps 0.2, 0.1), 4 tokens: TPOT 0.3 / 3 = 0.1
# request 1: one token at 0.5 s: no TPOT of its own, 0 for goodput; request 2 failed
RESULTS = [
    RequestResult(0, True, 10.0, 0.1, [0.2, 0.1], 0.4, 4, tokens_from_usage=True, prompt_tokens=7),
    RequestResult(1, True, 10.2, 0.5, [], 0.5, 1, tokens_from_usage=True),
    RequestResult(2, ok=False, latency=0.1, error="HTTP 500: boom"),
]
PROMPT_LENS = [5, 6, 8]  # request 1's usage gave no prompt tokens: its workload length counts


def test_metrics_follow_vllm_definitions() -> None:
    m = summarize(RESULTS, PROMPT_LENS, duration_s=2.0, slos={})
    assert (m["completed"], m["failed"], m["errors"]) == (2, 1, ["HTTP 500: boom"])
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (7 + 6, 5)
    assert m["output_tokens_from"] == "usage"
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_token_throughput"] == pytest.approx(9.0)
    assert m["request_goodput"] is None
    assert m["ttft_ms"] == pytest.approx({"mean": 300, "p50": 300, "p90": 460, "p99": 496})
    assert m["tpot_ms"] == pytest.approx({"mean": 100, "p50": 100, "p90": 100, "p99": 100})
    assert m["itl_ms"] == pytest.approx({"mean": 150, "p50": 150, "p90": 190, "p99": 199})
    assert m["e2el_ms"] == pytest.approx({"mean": 450, "p50": 450, "p90": 490, "p99": 499})


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 200, "tpot": 150}, 1),  # request 1's TTFT of 500 ms misses
        ({"tpot": 50}, 1),  # request 0's TPOT of 100 ms misses; request 1's counts as 0
        ({"e2el": 500}, 2),  # at the SLO is within it
        ({"ttft": 50}, 0),
    ],
)
def test_goodput_counts_requests_meeting_every_slo(slos: dict[str, float], good: int) -> None:
    m = summarize(RESULTS, PROMPT_LENS, duration_s=2.0, slos=slos)
    assert m["request_goodput"] == pytest.approx(good / 2.0)


def test_a_request_without_usage_counts_its_texts_tokens_as_vllm() -> None:
    """One event may hold several tokens: without a usage chunk the streamed text is tokenized
    again (here 5 tokens in 2 events), not its events counted."""
    result = RequestResult(0, True, 0.0, 0.1, [0.4], 0.5, text="a b c d e")
    count_text_tokens([result], str.split)
    m = summarize([result], [3], duration_s=1.0, slos={})
    assert m["total_output_tokens"] == 5 and m["output_tokens_from"] == "text"
    assert m["tpot_ms"]["mean"] == pytest.approx(1e3 * 0.4 / 4)


def test_slos_parse_from_name_and_ms() -> None:
    assert parse_slos(["ttft:500", "e2el:2000.5"]) == {"ttft": 500.0, "e2el": 2000.5}
    for bad in ("itl:5", "ttft", "ttft:-1", "ttft:fast"):
        with pytest.raises(ValueError, match="NAME:MS"):
            parse_slos([bad])


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrivals_offer_exactly_the_rate_with_vllms_gamma_gaps(burstiness: float) -> None:
    """As vLLM's `bench serve`: the last request arrives at N / rate whatever the seed; the gaps'
    spread is the gamma's (coefficient of variation 1 / sqrt(burstiness))."""
    times = arrivals(20000, rate=50.0, burstiness=burstiness, seed=3)
    gaps = [times[0], *(b - a for a, b in itertools.pairwise(times))]
    assert times[-1] == pytest.approx(20000 / 50.0) and min(gaps) >= 0
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(
        burstiness**-0.5, rel=0.05
    )
    assert arrivals(100, 50.0, burstiness, seed=3) != arrivals(100, 50.0, burstiness, seed=4)
    assert arrivals(100, 50.0, burstiness, seed=3)[-1] == pytest.approx(2.0)


def test_arrivals_at_an_infinite_rate_or_burstiness() -> None:
    assert arrivals(5, math.inf, 1.0, seed=3) == [0.0] * 5
    assert arrivals(0, 8.0, 1.0, seed=3) == []
    assert arrivals(4, 8.0, math.inf, seed=3) == pytest.approx([0.125, 0.25, 0.375, 0.5])


def test_trace_replays_arrivals_lengths_and_shared_blocks(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 1500, "input_length": 10, "output_length": 3, "hash_ids": [0, 2]},
        {"timestamp": 500, "input_length": 6, "output_length": 4, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 5, "output_length": 2},
    ]
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    requests = load_trace(trace, vocab_size=512, seed=0, block_size=4)
    assert [r.arrival_s for r in requests] == [0.0, 0.5, 1.0]
    assert [(len(r.prompt), r.output_len) for r in requests] == [(6, 4), (5, 2), (10, 3)]
    assert all(0 <= t < 512 for r in requests for t in r.prompt)
    first, last = requests[0].prompt, requests[2].prompt
    assert first[:4] == last[:4] and first[4:6] != last[4:6]  # block 0 shared, 1 and 2 not
    assert load_trace(trace, vocab_size=512, seed=0, block_size=4) == requests

    trace.write_text(json.dumps({"timestamp": 0, "input_length": 0, "output_length": 1}))
    with pytest.raises(ValueError, match=":1: needs"):
        load_trace(trace, vocab_size=512, seed=0)


def test_shifted_prompts_keep_their_lengths_but_no_prefix() -> None:
    requests = random_workload(4, 3, 9, vocab_size=16, seed=0)
    moved = shifted(requests, 15, vocab_size=16)
    for r, m in zip(requests, moved, strict=True):
        assert len(m.prompt) == len(r.prompt) and m.output_len == r.output_len
        assert m.prompt == [(t + 15) % 16 for t in r.prompt]


RUN_FIELDS = {
    "request_rate",
    "max_concurrency",
    "completed",
    "failed",
    "errors",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "output_tokens_from",
    "usage_cached_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2el_ms",
    "requested_output_tokens",
    "short_outputs",
    "prefix_cache",
    "client",
    "online_offline_ratio",
}


@pytest.fixture
def sse_stub():
    port = free_port()
    stub = subprocess.Popen([sys.executable, "-m", "tests.sse_stub", str(port)], cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _answers(url + "/peak"), timeout=30)
    yield url
    stub.kill()
    stub.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_concurrency_cap_is_shared_by_every_client_process(sse_stub: str) -> None:
    """As vLLM's one semaphore: process 1's long request 1 holds one of the 2 slots, and the
    short requests 0 and 2 (process 0) take the other one after the other; process 1's request 3
    then starts in the slot request 2 left, not after request 1 (3 s) as a cap split 1 + 1
    would have it."""
    waits = [0.1, 3.0, 0.1, 0.1]
    sends = [(i, 0.0, {"wait_s": wait}) for i, wait in enumerate(waits)]
    jobs = split_jobs(sse_stub + "/v1/completions", {}, sends, num_procs=2, max_concurrency=2)
    start, reports = run_clients(jobs, 2, lambda: None)
    results = {r.index: r for report in reports for r in report.results}
    assert all(r.ok for r in results.values()), results
    assert httpx.get(sse_stub + "/peak").json()["peak"] == 2
    assert results[3].start - start < 2.0, results[3].start - start


def test_requests_waiting_for_a_slot_leave_host_names_resolvable(sse_stub: str) -> None:
    """More requests wait for a slot than the loop's executor has threads, on which httpx
    looks a host name up: none of them may hold a thread while it waits."""
    sends = [(i, 0.0, {"wait_s": 0.01}) for i in range(48)]
    url = sse_stub.replace("127.0.0.1", "localhost") + "/v1/completions"
    jobs = split_jobs(url, {}, sends, num_procs=2, max_concurrency=2)
    with ThreadPoolExecutor(1) as pool:
        _, reports = pool.submit(run_clients, jobs, 2, lambda: None).result(timeout=120)
    assert sum(r.ok for report in reports for r in report.results) == 48


def test_smoke_run_against_our_server_reports_every_field(tmp_path: Path) -> None:
    result, png = tmp_path / "result.json", tmp_path / "result.png"
    command = [sys.executable, str(BENCH_SERVING), "--launch"]
    command += ["--offline", "--num-requests", "8", "--min-len", "8", "--max-len", "32"]
    command += ["--request-rate", "inf", "8", "--warmup", "4", "--num-client-procs", "2"]
    command += ["--goodput", "ttft:60000", "tpot:60000", "--no-progress"]
    command += ["--result-json", str(result), "--plot", str(png)]
    command += ["--", "--device", DEVICE, "--dtype", "float32", "--max-kv-tokens", "4096"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "online/offline" in run.stdout

    payload = json.loads(result.read_text())
    assert png.read_bytes().startswith(b"\x89PNG")
    commit = payload["provenance"]["commit"]  # None outside a checkout (the device's copy)
    assert (commit is None or len(commit) == 40) and payload["provenance"]["date"]
    workload = make_workload(8, 8, 32, vocab_size=512)
    assert payload["workload"] == {
        "kind": "random",
        "requests": 8,
        "prompt_tokens": workload.prompt_tokens,
        "output_tokens": workload.output_tokens,
    }
    assert payload["goodput_slos_ms"] == {"ttft": 60000, "tpot": 60000}
    runs = payload["runs"]
    assert [run["request_rate"] for run in runs] == [8.0, "inf"]  # in increasing order
    for run in runs:
        assert set(run) == RUN_FIELDS
        assert (run["completed"], run["failed"], run["short_outputs"]) == (8, 0, 0)
        assert run["total_output_tokens"] == run["requested_output_tokens"]
        assert run["total_output_tokens"] == workload.output_tokens
        assert run["total_input_tokens"] == workload.prompt_tokens
        assert run["output_tokens_from"] == "usage"
        assert run["request_goodput"] == pytest.approx(run["request_throughput"])
        assert run["output_throughput"] > 0 and run["online_offline_ratio"] > 0
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            d = run[metric]
            assert 0 <= d["p50"] <= d["p90"] <= d["p99"], (metric, d)
            assert d["mean"] > 0
        assert run["ttft_ms"]["p99"] <= run["e2el_ms"]["p99"]
        # the run's own prompt tokens, from the server's counter and from the usage chunks
        cache = run["prefix_cache"]
        assert cache["prompt_tokens"] == run["total_input_tokens"]
        if cache["cached_tokens"] is None:
            assert cache["hit_rate"] is None and "cached_prompt_tokens" in cache["note"]
        else:
            assert 0 <= cache["hit_rate"] <= 1
        assert run["usage_cached_tokens"] is not None
        client = run["client"]
        assert client["processes"] == 2 and len(client["busy_shares"]) == 2
        assert 0 < client["max_busy_share"] == max(client["busy_shares"])

    offline = payload["offline"]
    assert offline["total_output_tokens"] == workload.output_tokens
    assert offline["engine"]["chunk_size"] == 8192  # the server's default, not the offline API's
    assert offline["engine"]["max_kv_tokens"] == 4096
    # the server was stopped: nothing listens at its address any more
    with pytest.raises(httpx.TransportError):
        httpx.get(payload["base_url"] + "/health", timeout=2)
