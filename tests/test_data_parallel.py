"""--dp: replicas behind the real vllm-router, as real processes (`python -m minisgl --dp 2`)
driven by real clients (`openai`, httpx): concurrent load reaches every replica, the router
forwards each body as sent, its cache-aware policy keeps a prompt prefix on one replica (a higher
prefix-cache hit rate than round robin), and a killed replica fails only its own streams in
flight while the others serve on."""

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import string
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from .server_process import ServerProcess, process_name, read_metrics, wait_for
from .stress.clients import read_stream

MODEL = "stories"
API_KEY = "dp-key"
ORIGIN = "https://chat.example"
SERVED = 'minisgl_requests_total{finish_reason="length"}'
PROMPT_TOKENS = "minisgl_prompt_tokens_total"
CACHED_TOKENS = "minisgl_cached_prompt_tokens_total"


def _start(tmp_path: Path, *options: str, **kwargs) -> ServerProcess:
    return ServerProcess(tmp_path, "--dp", "2", "--served-model-name", MODEL, *options, **kwargs)


def _replica_urls(server: ServerProcess) -> list[str]:
    """The replicas, as the launcher's ready line names them (replica 0 first)."""
    found = re.search(r"in front of replicas at (.*) \(ready in", server.log())
    assert found is not None, server.log()
    return found.group(1).split(", ")


def _replica_metrics(server: ServerProcess, name: str) -> list[float]:
    return [read_metrics(url, server.headers).get(name, 0.0) for url in _replica_urls(server)]


def _text(rng: random.Random, words: int) -> str:
    """Random words: no two texts share more than a few characters of prefix."""
    return " ".join(
        "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) for _ in range(words)
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = _start(
        tmp_path_factory.mktemp("dp"), "--max-kv-tokens", "8192",
        "--allowed-origins", json.dumps([ORIGIN]), api_key=API_KEY,
    )  # fmt: skip
    yield s
    s.stop(signal.SIGINT)  # a terminal's Ctrl-C reaches the router too


def test_64_concurrent_clients_are_served_by_both_replicas(server: ServerProcess) -> None:
    rng = random.Random(0)
    prompts = [_text(rng, 6) for _ in range(64)]  # unrelated: the policy spreads them
    before = _replica_metrics(server, SERVED)

    async def ask(client, i: int) -> int:
        kwargs = dict(model=MODEL, prompt=prompts[i], max_tokens=8, extra_body={"ignore_eos": True})
        if i % 2 == 0:
            return (await client.completions.create(**kwargs)).usage.completion_tokens
        stream = await client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
        return [chunk.usage async for chunk in stream if chunk.usage][-1].completion_tokens

    async def run() -> list[int]:
        client = server.async_client(max_retries=0, timeout=120)
        return await asyncio.gather(*(ask(client, i) for i in range(64)))

    assert asyncio.run(run()) == [8] * 64
    served = [b - a for a, b in zip(before, _replica_metrics(server, SERVED), strict=True)]
    assert sum(served) == 64 and min(served) > 0, served


def test_the_router_forwards_each_body_as_sent(server: ServerProcess) -> None:
    """/health is open (the router's health checks send no key), the rest needs the key, which
    the router checks and sends. A chat's fields reach the replicas as sent: sglang-router wrote
    chat bodies anew from its own fields, and a structured output, prompt_logprobs or
    include_stop_str_in_output was dropped (a 200 of free text), a bad one too, as any field
    the replicas refuse."""
    for url in _replica_urls(server):
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 1}
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 401  # the router's
    models = httpx.get(server.url + "/v1/models", headers=server.headers).json()
    assert [m["id"] for m in models["data"]] == [MODEL]

    def chat(**fields) -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 12, "temperature": 0, **fields}  # fmt: skip
        return httpx.post(
            server.url + "/v1/chat/completions", json=body, headers=server.headers, timeout=60
        )

    def content(reply: httpx.Response) -> str:
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]["content"]

    assert re.fullmatch("[0-9]{5}", content(chat(structured_outputs={"regex": "[0-9]{5}"})))
    assert content(chat(guided_choice=["yes", "no"])) in ("yes", "no")
    held = content(chat(stop=[" and"], include_stop_str_in_output=True))
    assert held.endswith(" and") and held == content(chat(stop=[" and"])) + " and"
    assert chat(prompt_logprobs=1).json()["prompt_logprobs"]
    for bad in ({"structured_outputs": {"regex": "("}}, {"no_such_field": 1}):
        reply = chat(**bad)
        assert reply.status_code == 400 and reply.json()["error"]["message"], reply.text


def test_clients_bad_requests_leave_the_replicas_serving(server: ServerProcess) -> None:
    """A replica's 400 is the client's error, not the replica's: 30 of them in a row (past the
    router's circuit-breaker threshold, 10) and the next good request is still served."""
    bad = {"model": MODEL, "prompt": "Once", "max_tokens": 100_000}
    codes = [
        httpx.post(server.url + "/v1/completions", json=bad, headers=server.headers).status_code
        for _ in range(30)
    ]
    good = {"model": MODEL, "prompt": "Once", "max_tokens": 2}
    r = httpx.post(server.url + "/v1/completions", json=good, headers=server.headers)
    assert codes == [400] * 30 and r.status_code == 200, r.text


def test_the_router_takes_the_allowed_origins(server: ServerProcess) -> None:
    """--allowed-origins reaches the router, the replicas' public face."""

    def preflight(origin: str) -> httpx.Response:
        headers = {"Origin": origin, "Access-Control-Request-Method": "POST"}
        return httpx.options(server.url + "/v1/completions", headers=headers)

    allowed = preflight(ORIGIN)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in preflight("https://other.example").headers


# 4 sessions, each a long prefix of its own (~230 tokens) and 16 questions after it, one at a
# time; each replica's KV pool holds two such prefixes and little more
SESSIONS, QUESTIONS, PREFIX_WORDS = 4, 16, 40
SMALL_POOL = ("--max-kv-tokens", "560", "--max-model-len", "512")


def _router_sum(server: ServerProcess, name: str) -> float:
    """The router's metric `name`, summed over its labels (the replicas)."""
    found = re.search(r"its metrics at (\S+)/metrics\)", server.log())
    assert found is not None, server.log()
    samples = read_metrics(found.group(1))
    return sum(value for sample, value in samples.items() if sample.startswith(name + "{"))


def _prefix_hit_rate(tmp_path: Path, policy: str) -> float:
    """The share of prompt tokens found in the replicas' prefix caches, over the sessions run at
    once on fresh replicas behind `policy`."""
    rng = random.Random(1)
    prefixes = [_text(rng, PREFIX_WORDS) for _ in range(SESSIONS)]
    sessions = [[f"{p}\n{_text(rng, 2)}" for _ in range(QUESTIONS)] for p in prefixes]
    (tmp_path / policy).mkdir()
    server = _start(tmp_path / policy, "--router-policy", policy, *SMALL_POOL)
    schedulers = [server.child(f"r{i}-scheduler-0") for i in range(2)]

    async def session(client, prompts: list[str], think: random.Random) -> None:
        for prompt in prompts:
            await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True}
            )
            # sessions in lockstep would take turns in a fixed order, which round robin would
            # map onto the replicas one session to one replica, as the cache-aware policy does
            await asyncio.sleep(think.uniform(0, 0.1))

    async def run() -> None:
        client = server.async_client(max_retries=0, timeout=120)
        think = random.Random(3)
        # The cache-aware policy puts a new prefix on the replica with the fewest requests in
        # flight (the first on equal loads), but reads loads the router has not yet counted
        # for a request it routed a moment before: sent at once, 3 of the 4 sessions' first
        # requests went to one replica in 1 of 3 runs on a busy machine. So each is sent once
        # the router counts the one before, which the stopped schedulers keep in flight
        # (round robin counts no loads, only its choices).
        counted = (
            "vllm_router_running_requests"
            if policy == "cache_aware"
            else "vllm_router_policy_decisions_total"
        )
        for pid in schedulers:
            os.kill(pid, signal.SIGSTOP)
        try:
            session_tasks = []
            deadline = time.monotonic() + 60
            for placed, prompts in enumerate(sessions, start=1):
                session_tasks.append(asyncio.create_task(session(client, prompts, think)))
                while await asyncio.to_thread(_router_sum, server, counted) < placed:
                    assert time.monotonic() < deadline, f"the router counts {placed - 1} requests"
                    await asyncio.sleep(0.05)
        finally:
            for pid in schedulers:
                os.kill(pid, signal.SIGCONT)
        await asyncio.gather(*session_tasks)

    try:
        asyncio.run(run())
        prompt_tokens = sum(_replica_metrics(server, PROMPT_TOKENS))
        cached = sum(_replica_metrics(server, CACHED_TOKENS))
    finally:
        server.stop()
    return cached / prompt_tokens


def test_log_level_warning_reaches_the_router(tmp_path: Path) -> None:
    """vllm-router takes Rust's `warn`: given "warning", it logged 16 INFO lines at start."""
    server = _start(tmp_path, "--log-level", "warning")
    try:
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        server.stop()
    assert not re.search(r"INFO.*vllm_router", server.log()), server.log()


def test_cache_aware_routing_hits_the_prefix_cache_more_than_round_robin(tmp_path: Path) -> None:
    """Measured on 2 cores: cache_aware 0.90 in every run (each replica serves two sessions,
    whose prefixes its pool holds), round_robin 0.39-0.59 (each replica serves every session,
    and its pool keeps evicting one prefix for another)."""
    cache_aware = _prefix_hit_rate(tmp_path, "cache_aware")
    round_robin = _prefix_hit_rate(tmp_path, "round_robin")
    print(f"prefix-cache hit rate: cache_aware {cache_aware:.3f}, round_robin {round_robin:.3f}")
    assert cache_aware > 0.8 and cache_aware - round_robin > 0.2, (cache_aware, round_robin)


STREAMS, AT_ONCE, STREAM_TOKENS = 16, 8, 512


def test_a_killed_replica_fails_only_its_streams_in_flight(tmp_path: Path) -> None:
    """Replica 1 is SIGKILLed (every process of it) once a quarter of the streams have ended, with
    AT_ONCE in flight, every other one of them its (round robin): of those, the ones it had begun
    sending break off, and the router sends the others to replica 0; every other stream, before
    and after, completes through the router, which stops sending to replica 1. The launcher
    serves on, and stops cleanly."""
    # round robin: replica 1 takes every other stream (cache-aware balances load only 64
    # requests apart). The kill is timed from the client's side: polling the replica's /metrics
    # for a stream it was sending missed the moment in 1 of 4-6 runs (the replica, on its one
    # core behind its streams, once took 5.6 s to answer)
    server = _start(tmp_path, "--max-kv-tokens", "8192", "--router-policy", "round_robin")
    alive, _ = _replica_urls(server)
    broken = (
        'minisgl_requests_total{finish_reason="abort"}',
        'minisgl_requests_total{finish_reason="error"}',
    )
    broken_before = [read_metrics(alive, server.headers).get(name, 0.0) for name in broken]
    rng = random.Random(2)
    prompts = [_text(rng, 6) for _ in range(STREAMS)]
    started: dict[int, float] = {}
    ended: dict[int, tuple[float, Exception | None]] = {}

    async def stream(http: httpx.AsyncClient, i: int, slots: asyncio.Semaphore) -> None:
        body = {
            "model": MODEL, "prompt": prompts[i], "max_tokens": STREAM_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
        }  # fmt: skip
        async with slots:
            started[i] = time.monotonic()
            try:
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200, await response.aread()
                    events = [line async for line in response.aiter_lines() if line]
                assert events[-1] == "data: [DONE]", events[-1]
                usage = json.loads(events[-2].removeprefix("data: "))["usage"]
                assert usage["completion_tokens"] == STREAM_TOKENS
                ended[i] = (time.monotonic(), None)
            except Exception as e:
                ended[i] = (time.monotonic(), e)

    async def kill_replica_1() -> float:
        while len(ended) < STREAMS // 4 or len(started) - len(ended) < AT_ONCE:
            assert len(started) < STREAMS, (
                "the streams ran out before a quarter had ended",
                {i: error for i, (_, error) in ended.items() if error is not None},
            )
            await asyncio.sleep(0.01)
        replica_1 = [p for p in server.children if process_name(p).startswith("r1-")]
        for pid in replica_1:
            with contextlib.suppress(ProcessLookupError):  # the launcher stops the rest itself
                os.kill(pid, signal.SIGKILL)
        return time.monotonic()

    async def run() -> float:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            slots = asyncio.Semaphore(AT_ONCE)
            killed = asyncio.create_task(kill_replica_1())
            await asyncio.gather(*(stream(http, i, slots) for i in range(STREAMS)))
            return await killed

    try:
        kill = asyncio.run(run())
        failed = {i for i, (_, error) in ended.items() if error is not None}
        in_flight = {i for i, t in started.items() if t < kill < ended[i][0]}
        assert failed <= in_flight, {i: ended[i][1] for i in failed - in_flight}
        # and none of replica 0's: it neither aborted nor failed a request
        assert [
            read_metrics(alive, server.headers).get(name, 0.0) for name in broken
        ] == broken_before
        print(f"{len(failed)} of the {len(in_flight)} streams in flight at the kill broke off")
        wait_for(lambda: _router_workers(server) == [alive], 30, "the router still has replica 1")
        assert server.proc.poll() is None and "minisgl: replica 1 stopped" in server.log()
    except BaseException:
        server.kill()
        raise
    server.stop()


def _router_workers(server: ServerProcess) -> list[str]:
    """The replicas the router routes to."""
    listing = httpx.get(server.url + "/workers", headers=server.headers, timeout=10).json()
    return [w["url"] for w in listing["workers"] if w["is_healthy"]]


class _StopAtEachEvent:
    """Called by the thread reading a stream: until `off`, each event stops the process `pid`
    (SIGSTOP) at once, so a stream that has begun moves no further. The stop comes from the
    reader, not from a loop that lets the process run in slices: a scheduler continued after a
    SIGSTOP has held its core for seconds on a VM, and its own API server, sharing that core,
    sent nothing meanwhile (1,900 tokens in one 20 ms slice)."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self._lock = threading.Lock()  # no stop once `off` has returned
        self._on = True
        self.stopped = threading.Event()

    def __call__(self) -> None:
        with self._lock:
            if self._on:
                os.kill(self._pid, signal.SIGSTOP)
                self.stopped.set()

    def off(self) -> None:
        with self._lock:
            self._on = False


def test_a_replica_that_dies_during_a_drain_cuts_only_its_own_streams(tmp_path: Path) -> None:
    """A stream to each replica, both begun; SIGTERM lets both replicas drain; replica 0's
    scheduler is then killed: its stream ends at once with an error, and replica 1's runs to its
    end (every replica's was cut: a process exiting during the drain had every API server answer
    what it had open)."""
    server = _start(tmp_path, "--max-kv-tokens", "8192", "--shutdown-timeout", "60")
    schedulers = [server.child(f"r{i}-scheduler-0") for i in range(2)]
    stops = [_StopAtEachEvent(pid) for pid in schedulers]
    body = {
        "model": MODEL, "prompt": "Once", "max_tokens": 1900, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    try:
        with ThreadPoolExecutor(2) as pool:
            streams = [
                pool.submit(read_stream, server, "/v1/completions", body, stop, url)
                for stop, url in zip(stops, _replica_urls(server), strict=True)
            ]
            for stop in stops:
                wait_for(stop.stopped.is_set, 60, "a stream never began")
                stop.off()
            server.proc.send_signal(signal.SIGTERM)
            wait_for(
                lambda: all(
                    httpx.get(url + "/health", timeout=5).status_code == 503
                    for url in _replica_urls(server)
                ),
                30,
                "the replicas are not draining",
            )
            os.kill(schedulers[0], signal.SIGKILL)
            os.kill(schedulers[1], signal.SIGCONT)
            cut, whole = (
                (s.completion_tokens, s.done, s.events[-1].get("error", {}).get("message", ""))
                for s in (f.result() for f in streams)
            )
    finally:
        for pid in schedulers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert cut[1] and "the engine stopped" in cut[2], cut
    assert whole[:2] == (1900, True), whole
    assert server.wait_exit(timeout=30) == 0
