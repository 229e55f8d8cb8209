"""The API server's side of the wire: submits requests to the tokenizer process and routes the text
chunks that come back to the HTTP handler waiting for them. Records the per-request metrics."""

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from minisgl.messages import (
    AbortRequest,
    Addresses,
    ReqChunk,
    ReqError,
    SchedulerLimits,
    TextOutputs,
    TokenizeRequest,
    bind_pull,
    connect_push,
    decode,
    send,
)

from .metrics import Metrics

Item = ReqChunk | ReqError


class ReqGroup:
    """The engine requests behind one API request. Their items arrive on one queue, as
    (index in the group, item); a request ends with a finishing chunk or an error."""

    def __init__(self, rids: list[int]) -> None:
        self.rids = rids
        self.queue: asyncio.Queue[tuple[int, Item]] = asyncio.Queue()
        self.unfinished = set(rids)  # updated by the client as final items arrive

    async def items(self) -> AsyncIterator[tuple[int, Item]]:
        """Every item, until every request has ended."""
        remaining = len(self.rids)
        while remaining:
            index, item = await self.queue.get()
            remaining -= isinstance(item, ReqError) or item.finish_reason is not None
            yield index, item


@dataclass
class _Route:
    group: ReqGroup | None  # None once the handler gave up on it (the abort is on its way)
    index: int
    submitted: float
    last_token: float | None = None


class EngineClient:
    def __init__(self, addresses: Addresses, metrics: Metrics) -> None:
        self.metrics = metrics
        self.limits: SchedulerLimits | None = None  # set when the engine is ready
        self._to_tokenizer = connect_push(zmq.Context(), addresses.tokenizer)
        self._inbox = bind_pull(zmq.asyncio.Context(), addresses.api)
        self._routes: dict[int, _Route] = {}
        self._rids = itertools.count()

    def new_rid(self) -> int:
        return next(self._rids)

    def submit(self, requests: list[TokenizeRequest]) -> ReqGroup:
        group = ReqGroup([r.rid for r in requests])
        now = time.monotonic()
        for index, request in enumerate(requests):
            self._routes[request.rid] = _Route(group, index, now)
            send(self._to_tokenizer, request)
        return group

    def abort(self, group: ReqGroup) -> None:
        """Stop every request of the group that has not ended; their pages are freed."""
        for rid in group.unfinished:
            self._routes[rid].group = None
            send(self._to_tokenizer, AbortRequest(rid))
        group.unfinished.clear()

    async def run(self) -> None:
        """Route everything the tokenizer process sends; runs for the server's lifetime."""
        while True:
            msg = decode(await self._inbox.recv())
            if isinstance(msg, SchedulerLimits):
                self.limits = msg
                continue
            assert isinstance(msg, TextOutputs)
            now = time.monotonic()
            for chunk in msg.chunks:
                self._on_chunk(chunk, now)
            for error in msg.errors:
                self.metrics.request_finished("error", 0)
                self._deliver(self._routes.pop(error.rid), error)
            if msg.load is not None:
                self.metrics.set_load(msg.load)

    def _on_chunk(self, chunk: ReqChunk, now: float) -> None:
        route = self._routes[chunk.rid]
        if chunk.token_id is not None:
            since = route.submitted if route.last_token is None else route.last_token
            self.metrics.token_arrived(now - since, first=route.last_token is None)
            route.last_token = now
        if chunk.finish_reason is not None:
            self.metrics.request_finished(chunk.finish_reason, chunk.prompt_tokens)
            del self._routes[chunk.rid]
        self._deliver(route, chunk)

    @staticmethod
    def _deliver(route: _Route, item: Item) -> None:
        if route.group is None:
            return
        if isinstance(item, ReqError) or item.finish_reason is not None:
            route.group.unfinished.discard(route.group.rids[route.index])
        route.group.queue.put_nowait((route.index, item))
