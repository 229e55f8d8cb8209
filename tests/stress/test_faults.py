"""Faults: clients that leave at random or at each stage of a request's life, a KV pool far too
small for its load, a full queue, SIGTERM under load, and a killed or a stopped scheduler."""

import asyncio
import contextlib
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import httpx
import pytest

from ..server_process import ABORT_ARRIVES_S, ServerProcess, wait_for
from .checks import (
    FIRST_TOKENS,
    GENERATED,
    MODEL,
    PREEMPTIONS,
    QUEUED,
    RUNNING,
    assert_clean,
    assert_openai_error,
    check_error_body,
    delta,
    ended,
    finished,
    wait_for_metrics,
)
from .clients import RawRequest, Streamed, read_stream
from .keeper import ServerKeeper

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
JSON_BODY = {"Content-Type": "application/json"}


def _stream_body(route: str, prompt: str | list[int], max_tokens: int) -> dict:
    """A streamed request of exactly `max_tokens` tokens (eos ignored) with a final usage chunk."""
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if route == CHAT:
        return {**body, "messages": [{"role": "user", "content": prompt}]}
    return {**body, "prompt": prompt}


def _random_ids(rng: random.Random, n: int) -> list[int]:
    """A prompt no earlier request shares a prefix with (ids 0-2 are the special tokens)."""
    return [rng.randrange(3, 512) for _ in range(n)]


def _has_an_event(received: bytes) -> bool:
    """Whether a streamed answer has begun, so its request runs (the running gauge, polled, can
    miss a request that ends within two seconds, as these do on the CPU)."""
    return b"data: " in received


def _assert_complete(s: Streamed, max_tokens: int) -> None:
    assert s.status == 200 and s.done, s
    assert s.completion_tokens == max_tokens and s.finish_reasons == ["length"]


# ------------------------------------------------------------------------ random disconnects
def test_random_stream_disconnects_abort_exactly_the_streams_that_left(
    ordinary_server: ServerProcess, size
) -> None:
    server = ordinary_server
    rng = random.Random(1)
    # None: read to the end; k: leave after k events, long before the end (900 tokens: the
    # server must not finish them before a client on a loaded machine reads its k events)
    plans = [rng.choice([None, rng.randint(1, 10)]) for _ in range(size(32, 128))]
    lengths = [rng.randint(8, 48) for _ in plans]

    async def one(client: httpx.AsyncClient, i: int) -> int | None:
        """The stream's completion tokens, or None if its client left."""
        route = CHAT if i % 2 else COMPLETIONS
        body = _stream_body(route, f"Once upon a time {i}", 900 if plans[i] else lengths[i])
        events, usage = 0, None
        async with client.stream("POST", route, json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    return usage
                if line.startswith("data: "):
                    events += 1
                    usage = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens")
                    if events == plans[i]:
                        return None  # leaving the block closes the connection
        raise AssertionError("the stream ended without [DONE]")

    async def all_clients() -> list[int | None]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(plans))))

    before = server.metrics()
    results = asyncio.run(all_clients())
    stayed = [i for i, plan in enumerate(plans) if plan is None]
    assert [results[i] for i in stayed] == [lengths[i] for i in stayed]
    m = wait_for_metrics(server, lambda m: ended(before, m) == len(plans))
    assert delta(before, m, finished("abort")) == len(plans) - len(stayed)
    assert delta(before, m, finished("length")) == len(stayed)
    assert_clean(server, before)


# ------------------------------------------------------------------------ aborts by stage
@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory: pytest.TempPathFactory):
    """One request runs at a time, one token per step: a request waits in the queue, or
    prefills for seconds, long enough for its client to leave at that stage."""
    k = ServerKeeper(
        lambda: ServerProcess(
            tmp_path_factory.mktemp("one-at-a-time"),
            "--max-running-requests",
            "1",
            "--chunk-size",
            "1",
            "--max-kv-tokens",
            "4096",
            "--served-model-name",
            MODEL,
        )
    )
    yield k
    k.stop()


def test_client_leaving_while_queued_is_aborted_before_it_runs(one_at_a_time) -> None:
    server = one_at_a_time.get()
    before = server.metrics()
    holder = RawRequest(server, COMPLETIONS, _stream_body(COMPLETIONS, "Once", 2000))
    holder.read_until(_has_an_event)  # running
    victim = RawRequest(server, COMPLETIONS, _stream_body(COMPLETIONS, "Once upon", 100))
    with server.scheduler_stopped(until=lambda m: m[QUEUED] == 1):
        victim.leave()
        time.sleep(ABORT_ARRIVES_S)
    m = wait_for_metrics(server, lambda m: ended(before, m) >= 1)
    assert delta(before, m, finished("abort")) == 1  # the victim's, the holder still runs
    holder.leave()
    m = wait_for_metrics(server, lambda m: ended(before, m) == 2 and m[QUEUED] == m[RUNNING] == 0)
    assert delta(before, m, FIRST_TOKENS) == 1  # the holder's: the victim never ran
    assert_clean(server, before)


def test_client_leaving_while_its_prompt_is_prefilled_is_aborted(one_at_a_time) -> None:
    server = one_at_a_time.get()
    before = server.metrics()
    prompt = _random_ids(random.Random(time.time_ns()), 1900)  # 1900 steps of one token
    victim = RawRequest(server, COMPLETIONS, _stream_body(COMPLETIONS, prompt, 100))
    with server.scheduler_stopped(until=lambda m: m[RUNNING] == 1):
        assert not victim.answered()  # no token yet: the prompt is being prefilled
        victim.leave()
        time.sleep(ABORT_ARRIVES_S)
    m = wait_for_metrics(server, lambda m: ended(before, m) >= 1)
    assert delta(before, m, finished("abort")) == 1
    assert delta(before, m, GENERATED) == 0
    assert_clean(server, before)


def test_client_leaving_while_decoding_is_aborted(one_at_a_time) -> None:
    server = one_at_a_time.get()
    before = server.metrics()
    victim = RawRequest(server, COMPLETIONS, _stream_body(COMPLETIONS, "Once", 2000))
    victim.read_until(lambda received: received.count(b"data: ") >= 5)
    with server.scheduler_stopped():
        victim.leave()
        time.sleep(ABORT_ARRIVES_S)
    m = wait_for_metrics(server, lambda m: ended(before, m) >= 1)
    assert delta(before, m, finished("abort")) == 1
    assert delta(before, m, GENERATED) < 2000
    assert_clean(server, before)


# ------------------------------------------------------------------------ a tiny KV pool
def _greedy_together(server: ServerProcess, prompts: list[str], max_tokens: int) -> list[dict]:
    """The prompts' choices, sent as one request: they reach the scheduler together."""
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = server.post(COMPLETIONS, json={**body, "prompt": prompts}, timeout=300)
    assert response.status_code == 200, response.text
    return sorted(response.json()["choices"], key=lambda c: c["index"])


def test_tiny_kv_pool_preempts_and_every_request_finishes_unchanged(start_server, size) -> None:
    # a pool of one context (2048 tokens) in pages of 4; three requests of ~510 tokens fit it
    server = start_server("--max-kv-tokens", "2048", "--page-size", "4")
    prompts = [f"Once upon a time {i}" for i in range(size(6, 48))]
    unhurried = [
        a
        for i in range(0, len(prompts), 3)
        for a in _greedy_together(server, prompts[i : i + 3], 500)
    ]
    before = server.metrics()
    crowded = _greedy_together(server, prompts, 500)
    assert delta(before, server.metrics(), PREEMPTIONS) > 0
    for want, got in zip(unhurried, crowded, strict=True):
        assert got["finish_reason"] == "length" and got["text"] == want["text"]
    assert_clean(server, before)
    server.stop()


# ------------------------------------------------------------------------ a full queue
def test_request_beyond_max_queued_is_a_429_with_retry_after(start_server) -> None:
    """A full queue is a 429 that clients retry; a request whose sequences could never fit the
    queue is a 400, idle server or not. The scheduler is stopped meanwhile, so that no request
    gets its first token whatever the machine's speed (a 2,000-token request holding the one
    running slot ended before two more were queued on a loaded CI machine)."""
    server = start_server("--max-queued-requests", "2", "--max-kv-tokens", "4096")
    before = server.metrics()
    never_fits = server.post(COMPLETIONS, json={"model": MODEL, "prompt": "Once", "n": 3})
    assert "queue of 2" in assert_openai_error(never_fits, 400)["message"]
    with ThreadPoolExecutor(3) as pool, server.scheduler_stopped():
        streams = [
            pool.submit(read_stream, server, COMPLETIONS, _stream_body(COMPLETIONS, p, 8))
            for p in ("The dog", "The cat", "The bird")
        ]
        # the one that came third, whichever it was, is refused at once
        refused, waiting = wait(streams, timeout=30, return_when=FIRST_COMPLETED)
        assert len(refused) == 1
        third = refused.pop().result()
        assert third.status == 429 and "try again" in check_error_body(third.events[0])["message"]
        response = server.post(COMPLETIONS, json={"model": MODEL, "prompt": "Once"})
        assert_openai_error(response, 429)
        assert int(response.headers["Retry-After"]) >= 0
    for stream in waiting:  # the queue moves on
        _assert_complete(stream.result(), 8)
    assert_clean(server, before)
    server.stop()


# ------------------------------------------------------------------------ a request timeout
REQUEST_TIMEOUT_S = 1


def test_request_past_its_timeout_is_a_400_that_nothing_retries_and_frees_its_pages(
    start_server,
) -> None:
    """Streamed or not, a request that runs past --request-timeout is aborted and answered with
    an error whose code says so (a 400: a 408 or 5xx would be sent again by routers and
    OpenAI's client); the server serves on. The scheduler is held once each runs: on an H100
    its 1,900 tokens took less than the timeout."""
    server = start_server("--request-timeout", str(REQUEST_TIMEOUT_S), "--max-kv-tokens", "4096")
    before = server.metrics()
    long = {**_stream_body(COMPLETIONS, "Once", 1900), "stream": False, "stream_options": None}
    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        posted = pool.submit(server.post, COMPLETIONS, json=long)
        with server.scheduler_stopped(until=lambda m: m[RUNNING] >= 1 or posted.done()):
            error = assert_openai_error(posted.result(), 400)
        assert REQUEST_TIMEOUT_S <= time.monotonic() - start < REQUEST_TIMEOUT_S + 10
        assert error["code"] == "request_timeout" and "--request-timeout" in error["message"]
        began = threading.Event()
        stream = pool.submit(read_stream, server, CHAT, _stream_body(CHAT, "Once", 1900), began.set)
        assert began.wait(60)
        with server.scheduler_stopped():
            streamed = stream.result()
    assert streamed.status == 200 and streamed.done, streamed
    assert check_error_body(streamed.events[-1])["code"] == "request_timeout"
    assert streamed.completion_tokens is None  # no usage: it did not finish
    after = wait_for_metrics(server, lambda m: delta(before, m, finished("abort")) == 2)
    assert delta(before, after, GENERATED) < 2 * 1900
    assert_clean(server, before)
    server.stop()


def _unread_stream(server: ServerProcess) -> RawRequest:
    """A stream of 16 choices of 1,400 tokens whose first write is megabytes (echoed prompt
    logprobs), to a client that reads none of it."""
    body = {
        "model": MODEL, "prompt": "Once upon a time " * 150, "n": 16, "max_tokens": 1400,
        "ignore_eos": True, "stream": True, "echo": True, "logprobs": 5,
    }  # fmt: skip
    return RawRequest(server, COMPLETIONS, body, receive_buffer=2048)


def test_a_stream_whose_client_stops_reading_is_aborted_at_its_timeout(start_server) -> None:
    """The deadline was checked only between events: a client that kept its socket open and read
    nothing held the stream's first write (echoed prompt logprobs, megabytes), and its 16 choices
    ran on to their 1,400 tokens ("length") well past the limit."""
    timeout_s = 5
    server = start_server("--request-timeout", str(timeout_s), "--max-kv-tokens", "32768")
    before = server.metrics()
    stalled = _unread_stream(server)
    start = time.monotonic()
    try:
        # every choice began (its first event is being written) before the limit
        wait_for_metrics(server, lambda m: delta(before, m, FIRST_TOKENS) == 16, timeout_s)
        after = wait_for_metrics(server, lambda m: m[RUNNING] == 0, 60)
        assert time.monotonic() - start < timeout_s + 5
        assert delta(before, after, finished("abort")) == 16
        assert delta(before, after, finished("length")) == 0
    finally:
        stalled.sock.close()
    assert_clean(server, before)


def test_a_stream_whose_client_stops_reading_is_cut_off_after_the_idle_timeout(
    start_server,
) -> None:
    """No --request-timeout: the connection was held for as long as the client kept it, and
    the 16 choices ran on to their max_tokens (19,434 KV pages at 1,900 for a client reading
    nothing). A client that takes none of its response for --timeout-keep-alive is cut off."""
    idle_s = 2
    server = start_server("--timeout-keep-alive", str(idle_s), "--max-kv-tokens", "65536")
    before = server.metrics()
    stalled = _unread_stream(server)
    ended = [finished(reason) for reason in ("abort", "length")]
    try:  # read nothing until the requests end
        after = wait_for_metrics(
            server, lambda m: sum(delta(before, m, e) for e in ended) == 16, 60
        )
        assert delta(before, after, finished("abort")) == 16
        assert stalled.closed_by_server(timeout=5)  # after what the kernel still held for it
    finally:
        stalled.sock.close()
    assert_clean(server, before)


# ------------------------------------------------------------------------ SIGTERM under load
SHUTDOWN_TIMEOUT_S = 10


def test_sigterm_under_load_ends_every_request_and_exits_0(start_server, size) -> None:
    """Running requests may finish within --shutdown-timeout; those that cannot (the scheduler
    is stopped once the short ones have, whatever the machine's speed) get a 503."""
    server = start_server("--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--max-kv-tokens", "16384")
    long_clients = size(8, 32)
    non_streamed = {"stream": False, "stream_options": None}
    before = server.metrics()
    with ThreadPoolExecutor(2 * long_clients + 2) as pool:
        long_streams = [
            pool.submit(read_stream, server, r, _stream_body(r, f"Once {i}", 1900))
            for i, r in enumerate([COMPLETIONS, CHAT] * (long_clients // 2))
        ]
        long_posts = [
            pool.submit(server.post, r, json={**_stream_body(r, f"A {i}", 1900), **non_streamed})
            for i, r in enumerate([COMPLETIONS, CHAT] * (long_clients // 2))
        ]
        started = [threading.Event() for _ in range(2)]

        def every_long_one_runs(m: dict[str, float]) -> bool:
            return delta(before, m, FIRST_TOKENS) >= 2 * long_clients

        with server.scheduler_stopped(until=every_long_one_runs):
            short = [
                pool.submit(
                    read_stream,
                    server,
                    COMPLETIONS,
                    _stream_body(COMPLETIONS, f"B {i}", 8),
                    event.set,
                )
                for i, event in enumerate(started)
            ]
        assert all(event.wait(60) for event in started)
        server.proc.send_signal(signal.SIGTERM)
        for s in short:  # running requests may finish within the shutdown timeout
            _assert_complete(s.result(), 8)
        with server.scheduler_stopped():  # and those that cannot get an error

            def refusing() -> bool:
                try:
                    return httpx.get(server.url + "/health", timeout=5).status_code == 503
                except httpx.TransportError:
                    return True

            wait_for(refusing, SHUTDOWN_TIMEOUT_S, "/health still answers 200")
            try:
                late = server.post(COMPLETIONS, json={"model": MODEL, "prompt": "Once"}, timeout=10)
                assert_openai_error(late, 503)
            except httpx.TransportError:
                pass  # the port is closed already
            for s in (f.result() for f in long_streams):
                assert s.status == 200 and s.done, s
                check_error_body(s.events[-1])  # the last event before [DONE] is an error
            for r in (f.result() for f in long_posts):
                assert_openai_error(r, 503)
    assert server.wait_exit(timeout=SHUTDOWN_TIMEOUT_S + 20) == 0, server.log()


def test_sigterm_while_long_bodies_are_parsed_answers_each_with_a_503(start_server) -> None:
    """The body being parsed when the drain begins is answered, and the one queued behind it is
    not read: both get a 503 in OpenAI's shape. The exit cut them off with a plain 500 before."""
    server = start_server("--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    long = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}] * 300_000})
    with ThreadPoolExecutor(2) as pool:
        posts = []
        for _ in range(2):  # ~2 s each to parse here
            posts.append(pool.submit(server.post, CHAT, content=long, headers=JSON_BODY))
            time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        for post in posts:
            assert_openai_error(post.result(), 503)
    assert server.wait_exit(timeout=SHUTDOWN_TIMEOUT_S + 20) == 0, server.log()


# ------------------------------------------------------------------------ a killed scheduler
def test_killed_scheduler_answers_every_open_request_with_a_503_and_exits_promptly(
    start_server,
) -> None:
    """No open request can finish: each is answered at once (a stream: an error event, then
    [DONE]), not after the drain a SIGTERM gets (--shutdown-timeout 60) or a closed socket; so
    is a /tokenize that waits on the (stopped) tokenizer."""
    server = start_server("--max-kv-tokens", "4096", "--shutdown-timeout", "60")
    before = server.metrics()
    tokenizer = server.child("tokenizer")
    with ThreadPoolExecutor(5) as pool:
        streams = [
            pool.submit(
                read_stream, server, COMPLETIONS, _stream_body(COMPLETIONS, f"Once {i}", 1900)
            )
            for i in range(3)
        ]
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 1900, "ignore_eos": True}
        post = pool.submit(server.post, COMPLETIONS, json=body)
        # all four running
        with server.scheduler_stopped(until=lambda m: delta(before, m, FIRST_TOKENS) == 4):
            os.kill(tokenizer, signal.SIGSTOP)
            try:
                query = pool.submit(server.post, "/tokenize", json={"prompt": "Once"})
                time.sleep(1)  # for the query to reach the API server
                os.kill(server.child("scheduler-0"), signal.SIGKILL)
                killed = time.monotonic()
                assert "the engine stopped" in assert_openai_error(query.result(), 503)["message"]
            finally:
                with contextlib.suppress(ProcessLookupError):  # the launcher may have killed it
                    os.kill(tokenizer, signal.SIGCONT)
        for s in (f.result() for f in streams):
            assert s.status == 200 and s.done, s
            assert "the engine stopped" in check_error_body(s.events[-1])["message"]
        assert "the engine stopped" in assert_openai_error(post.result(), 503)["message"]
    assert server.wait_exit(timeout=15) == 1  # no child and no ipc file left either
    assert time.monotonic() - killed < 30


@contextlib.contextmanager
def _draining(server: ServerProcess, stop: Callable[[], None]) -> Iterator[Future[Streamed]]:
    """A 1,900-token stream begins, then `stop()` (a SIGTERM) and the server drains; the block
    runs with the scheduler stopped, and the stream has been read to its end after it."""
    before = server.metrics()
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(
            read_stream, server, COMPLETIONS, _stream_body(COMPLETIONS, "Once", 1900)
        )
        with server.scheduler_stopped(until=lambda m: delta(before, m, FIRST_TOKENS) == 1):
            stop()
            wait_for(lambda: httpx.get(server.url + "/health").status_code == 503)  # draining
            yield stream


def test_sigterm_to_the_whole_process_group_drains_too(start_server) -> None:
    """systemd's stop (KillMode=control-group) and timeout(1) send SIGTERM to every process of
    the server: the scheduler and the tokenizer died of it at once, and the running streams
    were cut ("a server process exited") with the drain's time unused."""
    server = start_server("--max-kv-tokens", "4096", "--shutdown-timeout", "60")
    with _draining(server, lambda: os.killpg(server.proc.pid, signal.SIGTERM)) as stream:
        pass
    _assert_complete(stream.result(), 1900)
    assert server.wait_exit(timeout=30) == 0


def test_scheduler_dying_during_a_drain_ends_it_at_once(start_server) -> None:
    """SIGTERM lets running requests finish within --shutdown-timeout (60 s here); once the
    scheduler has died, none can, and each is answered at once."""
    server = start_server("--max-kv-tokens", "4096", "--shutdown-timeout", "60")
    with _draining(server, lambda: server.proc.send_signal(signal.SIGTERM)) as stream:
        os.kill(server.child("scheduler-0"), signal.SIGKILL)
        killed = time.monotonic()
    answer = stream.result()
    assert answer.status == 200 and answer.done, answer
    assert "the engine stopped" in check_error_body(answer.events[-1])["message"]
    assert server.wait_exit(timeout=15) == 0  # it was asked to stop
    assert time.monotonic() - killed < 20


# ------------------------------------------------------------------------ a stopped scheduler
HEALTH_TIMEOUT_S = 2


def test_stopped_scheduler_makes_health_503_until_it_resumes(start_server) -> None:
    server = start_server(
        "--health-timeout", str(HEALTH_TIMEOUT_S), "--max-kv-tokens", "4096",
        api_key="stopped-key",
    )  # fmt: skip
    time.sleep(HEALTH_TIMEOUT_S + 1)  # idle for longer than the timeout: it heartbeats idle too
    assert httpx.get(server.url + "/health").status_code == 200  # never behind the API key
    before = server.metrics()
    with ThreadPoolExecutor(1) as pool:
        running = threading.Event()
        body = _stream_body(COMPLETIONS, "Once", 1900)
        stream = pool.submit(read_stream, server, COMPLETIONS, body, running.set)
        assert running.wait(30)
        with server.scheduler_stopped():
            wait_for(
                lambda: httpx.get(server.url + "/health").status_code == 503,
                HEALTH_TIMEOUT_S + 10,
                "/health still 200 with the scheduler stopped",
            )
            assert_openai_error(httpx.get(server.url + "/health"), 503)
        wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, 10)
        _assert_complete(stream.result(), 1900)  # the stream goes on where it stopped
    assert_clean(server, before)
    server.stop()
