"""The API server's side of the wire: submits requests to the tokenizer process and routes what
comes back to the HTTP handler waiting for it. Records the per-request metrics, and knows whether
the engine is alive (its heartbeats) and how many requests wait for a first token."""

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from minisgl.messages import (
    AbortRequest,
    Addresses,
    Finished,
    Heartbeat,
    Ready,
    ReqError,
    TextLogprobs,
    TextOutputs,
    TokenizerAnswer,
    TokenizeRequest,
    TokenizerQuery,
    bind_pull,
    connect_push,
    decode,
    encode,
    send,
)

from .errors import ApiError
from .metrics import Metrics

SHUTTING_DOWN = "the server is shutting down"  # what a request meets once the server drains


@dataclass
class Delta:
    """New text of one choice (with its first, its prompt's logprobs where they were asked)."""

    text: str
    logprobs: TextLogprobs | None
    prompt_logprobs: list[TextLogprobs] | None = None


@dataclass
class Interrupted:
    """The server is shutting down: the request is answered with a 503 before it ended."""

    message: str


Item = Delta | Finished | ReqError | Interrupted


class ReqGroup:
    """The engine requests behind one API request. Their items arrive on one queue, as
    (index in the group, item); a request ends with its Finished, an error or an interruption."""

    def __init__(self, rids: list[int]) -> None:
        self.rids = rids
        self.queue: asyncio.Queue[tuple[int, Item]] = asyncio.Queue()
        self.unfinished = set(rids)  # updated by the client as final items arrive

    async def batches(self) -> AsyncIterator[list[tuple[int, Item]]]:
        """Every item, as lists of those that arrived together, until every request ended."""
        remaining = len(self.rids)
        while remaining:
            batch = [await self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            remaining -= sum(not isinstance(item, Delta) for _, item in batch)
            yield batch


@dataclass
class _Route:
    group: ReqGroup | None  # None once the handler gave up on it (the abort is on its way)
    index: int
    submitted: float
    last_token: float | None = None
    waiting: bool = True  # counted among the requests waiting for a first token


class EngineClient:
    def __init__(
        self, addresses: Addresses, metrics: Metrics, max_queued: int | None = None
    ) -> None:
        self.metrics = metrics
        self.limits: Ready | None = None  # set when the engine is ready
        self._last_heartbeat = 0.0
        self._loop_age = 0.0  # the scheduler loop's, as the last heartbeat said
        self.draining = False  # shutting down: no new requests
        self._max_queued = max_queued
        self._num_queued = 0  # submitted requests without a first token yet, not aborted
        self._to_tokenizer = connect_push(zmq.Context(), addresses.tokenizer)
        self._inbox = bind_pull(zmq.asyncio.Context(), addresses.api)
        self._routes: dict[int, _Route] = {}
        self._queries: dict[int, asyncio.Future[TokenizerAnswer]] = {}
        self._groups: set[ReqGroup] = set()
        self._rids = itertools.count()
        self._idle = asyncio.Event()

    def new_rids(self, n: int) -> list[int]:
        return [next(self._rids) for _ in range(n)]

    def check_open(self) -> None:
        """Raises ApiError(503) once the server drains."""
        if self.draining:
            raise ApiError(503, SHUTTING_DOWN)

    def submit(self, request: TokenizeRequest) -> ReqGroup:
        """Send the request on; raises ApiError(429) when the queue is full, 400 when it could
        never hold the request, 503 when draining."""
        self.check_open()
        n = len(request.rids)
        if self._max_queued is not None and n > self._max_queued:
            raise ApiError(
                400, f"{n} sequences (prompts x n) exceed the server's queue of {self._max_queued}"
            )
        if self._max_queued is not None and self._num_queued + n > self._max_queued:
            raise ApiError(
                429, "too many requests are waiting; try again later", headers={"Retry-After": "1"}
            )
        payload = encode(request)
        group = ReqGroup(request.rids)
        now = time.monotonic()
        for index, rid in enumerate(request.rids):
            self._routes[rid] = _Route(group, index, now)
        self._num_queued += n
        self._groups.add(group)
        self._idle.clear()
        self._to_tokenizer.send(payload, copy=False)
        return group

    async def ask(self, query: TokenizerQuery) -> TokenizerAnswer:
        """The tokenizer's answer to a query made with `new_rids(1)[0]` as its qid."""
        payload = encode(query)
        future = asyncio.get_running_loop().create_future()
        self._queries[query.qid] = future
        self._to_tokenizer.send(payload, copy=False)
        try:
            return await future
        except asyncio.CancelledError:  # its client left: the bulk thread skips it if not begun
            send(self._to_tokenizer, AbortRequest([query.qid]))
            raise
        finally:
            self._queries.pop(query.qid, None)

    def abort(self, group: ReqGroup) -> None:
        """Stop every request of the group that has not ended; their pages are freed."""
        if group.unfinished:
            for rid in group.unfinished:
                route = self._routes[rid]
                route.group = None
                self._stop_waiting(route)  # before the engine confirms: no 429 meanwhile
            send(self._to_tokenizer, AbortRequest(sorted(group.unfinished)))
            group.unfinished.clear()
        self._release(group)

    def close(self) -> None:
        """Close both sockets now, dropping what is unsent (after `run` has ended): a context
        left to the garbage collector blocks the collecting thread while a socket of it is open."""
        for socket in (self._inbox, self._to_tokenizer):
            socket.context.destroy(linger=0)

    def interrupt_all(self, message: str) -> None:
        """End every open request with Interrupted (their handlers answer it) and abort them;
        a tokenizer query waiting for its answer gets a 503 too."""
        for group in list(self._groups):
            for rid in group.unfinished:
                group.queue.put_nowait((self._routes[rid].index, Interrupted(message)))
            self.abort(group)
        for future in self._queries.values():
            if not future.done():
                future.set_exception(ApiError(503, message))

    async def wait_idle(self, timeout: float) -> None:
        """Until no request is open, or `timeout` seconds."""
        if self._groups:
            with contextlib.suppress(asyncio.TimeoutError):  # TimeoutError from Python 3.11 on
                await asyncio.wait_for(self._idle.wait(), timeout)

    def healthy(self, timeout: float) -> bool:
        """Ready, not draining, and the scheduler heard from and its loop turning within
        `timeout` seconds (a step that long shows as unhealthy)."""
        return (
            self.limits is not None
            and not self.draining
            and time.monotonic() - self._last_heartbeat < timeout
            and self._loop_age < timeout
        )

    def _release(self, group: ReqGroup) -> None:
        self._groups.discard(group)
        if not self._groups:
            self._idle.set()

    # ------------------------------------------------------------------ the way back
    async def run(self) -> None:
        """Route everything the tokenizer process sends; runs for the server's lifetime."""
        while True:
            msg = decode(await self._inbox.recv())
            if isinstance(msg, Heartbeat):
                self._last_heartbeat, self._loop_age = time.monotonic(), msg.loop_age
            elif isinstance(msg, Ready):
                self.limits, self._last_heartbeat = msg, time.monotonic()
            elif isinstance(msg, TokenizerAnswer):
                future = self._queries.pop(msg.qid, None)
                if future is not None and not future.done():
                    future.set_result(msg)
            else:
                assert isinstance(msg, TextOutputs)
                self._on_outputs(msg)
            # a queued message's recv returns without suspending: without this turn, a backlog
            # holds the loop, and every request handler with it, until it drains
            await asyncio.sleep(0)

    def _on_outputs(self, msg: TextOutputs) -> None:
        now = time.monotonic()
        for i, (rid, text, num_tokens) in enumerate(
            zip(msg.rids, msg.texts, msg.num_tokens, strict=True)
        ):
            route = self._routes.get(rid)
            if route is None:
                continue
            if num_tokens:
                first = route.last_token is None
                since = route.submitted if first else route.last_token
                self.metrics.tokens_arrived(num_tokens, now - since, first)
                self._stop_waiting(route)
                route.last_token = now
            logprobs = None if msg.logprobs is None else msg.logprobs[i]
            prompt = None if msg.prompt_logprobs is None else msg.prompt_logprobs[i]
            self._deliver(route, Delta(text, logprobs, prompt))
        for finish in msg.finished:
            route = self._routes.get(finish.rid)  # None: ended here already (interrupted)
            self.metrics.request_finished(finish, None if route is None else now - route.submitted)
            self._end(finish.rid, finish)
        for error in msg.errors:
            if error.queued:  # a refusal at admission is no finished request, as in vLLM
                self.metrics.request_failed()
            self._end(error.rid, error)
        if msg.load is not None:
            self.metrics.set_load(msg.load)

    def _end(self, rid: int, item: Finished | ReqError) -> None:
        route = self._routes.pop(rid, None)
        if route is None:
            return
        self._stop_waiting(route)
        self._deliver(route, item)
        group = route.group
        if group is not None:
            group.unfinished.discard(rid)
            if not group.unfinished:
                self._release(group)

    def _stop_waiting(self, route: _Route) -> None:
        """The route's request waits for a first token no more (it has one, ended, or was
        aborted): it leaves the count that the 429 limit reads, once."""
        if route.waiting:
            route.waiting = False
            self._num_queued -= 1

    @staticmethod
    def _deliver(route: _Route, item: Item) -> None:
        if route.group is not None:
            route.group.queue.put_nowait((route.index, item))
