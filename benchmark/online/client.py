"""The client processes. Each runs an asyncio loop with one httpx.AsyncClient, sends its share of
the requests at their arrival times (while the processes together have fewer than the
concurrency cap in flight: one semaphore for all, as vLLM's one client has), times every streamed
event and reports how busy its CPU was, so a slow client shows.

    parent ── spawn ──▶ client 0 .. n-1 ── HTTP ──▶ server
      ▲  (queue: ready, one `done` a request, the report)  │
      └───────────────────────────────────────────────────┘

Times are `time.monotonic()`: one clock for every process of a machine (CLOCK_MONOTONIC on
Linux), so the parent merges what the processes measured and all start at the same instant.
"""

import asyncio
import json
import multiprocessing
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event, Semaphore
from typing import Any

import httpx

_POLL_S = 0.5


@dataclass
class RequestResult:
    index: int  # in the workload
    ok: bool = False
    start: float = 0.0  # when it was sent
    ttft: float | None = None  # to the first streamed event with a choice
    itl: list[float] = field(default_factory=list)  # between streamed events with a choice
    latency: float = 0.0  # to the last streamed event with a choice (or the failure)
    output_tokens: int = 0
    tokens_from_usage: bool = False  # else the text's tokens (`count_text_tokens`)
    text: str = ""  # the streamed output
    prompt_tokens: int | None = None  # as the usage chunk gives them
    cached_tokens: int | None = None  # the usage chunk's prompt_tokens_details.cached_tokens
    error: str | None = None


@dataclass(frozen=True)
class ClientJob:
    url: str
    headers: dict[str, str]
    requests: list[tuple[int, float, dict[str, Any]]]  # (index, arrival in s, body)


@dataclass(frozen=True)
class ClientReport:
    results: list[RequestResult]
    busy_share: float  # CPU time of the process over the wall time of its run


def split_jobs(
    url: str,
    headers: dict[str, str],
    requests: list[tuple[int, float, dict[str, Any]]],
    num_procs: int,
    max_concurrency: int | None,
) -> list[ClientJob]:
    """Deal the requests out round-robin to at most `num_procs` processes (no more than there are
    requests or concurrency slots)."""
    n = min(num_procs, len(requests), max_concurrency or num_procs)
    return [ClientJob(url, headers, requests[i::n]) for i in range(n)]


def new_client() -> httpx.AsyncClient:
    # no connection cap (httpx's default of 100 would queue requests in the client), no proxy
    # from the environment: a benchmark measures the server, not a proxy in between
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=None, limits=limits, trust_env=False)


async def stream_request(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], body: dict[str, Any], index: int
) -> RequestResult:
    """Send one streamed request and time its events; failures are results, not exceptions."""
    result = RequestResult(index, start=time.monotonic())
    last, usage = result.start, None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
            else:
                async for line in response.aiter_lines():
                    data = line.removeprefix("data:").strip()
                    if not line.startswith("data:") or data == "[DONE]":
                        continue
                    now, event = time.monotonic(), json.loads(data)
                    if event.get("error"):
                        result.error = f"error event: {event['error']}"
                    if choices := event.get("choices"):
                        result.text += _text_of(choices[0])
                        if result.ttft is None:
                            result.ttft = now - result.start
                        else:
                            result.itl.append(now - last)
                        last = now
                    usage = event.get("usage") or usage  # some servers put it in every chunk
    except Exception as e:  # any server's answer: a failed request, never a stopped run
        result.error = f"{type(e).__name__}: {e}"
    if result.error is None and result.ttft is None:
        result.error = "no streamed event with a choice"
    result.ok = result.error is None
    # a completed request ends at its last event, a failed one when it failed
    result.latency = (last if result.ok else time.monotonic()) - result.start
    if usage is not None and isinstance(usage.get("completion_tokens"), int):
        result.output_tokens, result.tokens_from_usage = usage["completion_tokens"], True
        result.prompt_tokens = usage.get("prompt_tokens")
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return result


def _text_of(choice: dict[str, Any]) -> str:
    """A streamed choice's text: a completion's, or a chat delta's content."""
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send_together(
    url: str, headers: dict[str, str], bodies: list[dict[str, Any]]
) -> list[RequestResult]:
    """All the requests at once, from this process (the warm-up)."""
    async with new_client() as client:
        sends = (stream_request(client, url, headers, body, i) for i, body in enumerate(bodies))
        return list(await asyncio.gather(*sends))


class _Slots:
    """The processes' shared concurrency slots, handed to this process's requests in the order
    they ask by a thread of its own that waits for each: the event loop never blocks, and the
    loop's executor, which httpx needs to look host names up, never waits behind a slot."""

    def __init__(self, slots: Semaphore, loop: asyncio.AbstractEventLoop) -> None:
        self._slots, self._loop = slots, loop
        self._asking: queue.SimpleQueue[asyncio.Future[None]] = queue.SimpleQueue()
        threading.Thread(target=self._hand_out, daemon=True).start()

    def _hand_out(self) -> None:
        while True:
            asker = self._asking.get()
            self._slots.acquire()
            self._loop.call_soon_threadsafe(self._give, asker)

    def _give(self, asker: asyncio.Future[None]) -> None:
        if asker.cancelled():  # its request was cancelled while it waited
            self._slots.release()
        else:
            asker.set_result(None)

    @asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        asker = self._loop.create_future()
        self._asking.put(asker)
        await asker
        try:
            yield
        finally:
            self._slots.release()


async def _run_job(
    job: ClientJob, slots: Semaphore | None, to_parent: Queue, go: Event, start_at: Synchronized
) -> ClientReport:
    async with new_client() as client:
        held = nullcontext if slots is None else _Slots(slots, asyncio.get_running_loop()).held
        to_parent.put(("ready", None))
        go.wait()  # nothing runs on the loop yet: blocking it here holds nothing up
        start, cpu_start = start_at.value, time.process_time()

        async def one(index: int, arrival_s: float, body: dict[str, Any]) -> RequestResult:
            await asyncio.sleep(max(0.0, start + arrival_s - time.monotonic()))
            async with held():
                result = await stream_request(client, job.url, job.headers, body, index)
            to_parent.put(("done", None))
            return result

        results = await asyncio.gather(*(one(*r) for r in job.requests))
        busy = (time.process_time() - cpu_start) / max(1e-9, time.monotonic() - start)
    return ClientReport(list(results), busy)


def _client_main(
    job: ClientJob, slots: Semaphore | None, to_parent: Queue, go: Event, start_at: Synchronized
) -> None:
    try:
        to_parent.put(("report", asyncio.run(_run_job(job, slots, to_parent, go, start_at))))
    except BaseException:
        to_parent.put(("error", traceback.format_exc()))


def _messages(inbox: Queue, procs: Sequence[BaseProcess]) -> Iterator[tuple[str, Any]]:
    """The children's messages; raises if one failed or died without saying so."""
    while True:
        try:
            kind, payload = inbox.get(timeout=_POLL_S)
        except queue.Empty:
            if dead := [p.exitcode for p in procs if p.exitcode not in (None, 0)]:
                raise RuntimeError(f"a client process died (exit codes {dead})") from None
            continue
        if kind == "error":
            raise RuntimeError(f"a client process failed:\n{payload}")
        yield kind, payload


def run_clients(
    jobs: list[ClientJob], max_concurrency: int | None, on_done: Callable[[], object]
) -> tuple[float, list[ClientReport]]:
    """(the instant the run started, each process's report), at most `max_concurrency` requests
    in flight over all the processes; `on_done` is called as each request finishes. Every
    process is ready before the common start, so none starts late."""
    ctx = multiprocessing.get_context("spawn")  # a fork would copy whatever the parent holds
    inbox, go, start_at = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    slots = None if max_concurrency is None else ctx.BoundedSemaphore(max_concurrency)
    procs = [
        ctx.Process(target=_client_main, args=(job, slots, inbox, go, start_at), daemon=True)
        for job in jobs
    ]
    for proc in procs:
        proc.start()
    try:
        messages = _messages(inbox, procs)
        for _ in procs:
            kind, _payload = next(messages)
            assert kind == "ready", kind
        start_at.value = time.monotonic()
        go.set()
        reports: list[ClientReport] = []
        while len(reports) < len(procs):
            kind, payload = next(messages)
            if kind == "done":
                on_done()
            else:
                reports.append(payload)
        return start_at.value, reports
    except BaseException:  # the others would send their requests on: stop them
        for proc in procs:
            proc.kill()
        raise
    finally:
        for proc in procs:
            proc.join()
