"""The machinery completions and chat share: fan an API request out into engine requests, wait
until each has started (so a rejected one still gets a 400), then stream or collect the choices."""

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response

from minisgl.messages import ReqChunk, ReqError, TokenizeRequest

from .engine_client import EngineClient, Item, ReqGroup
from .responses import ApiError, Choice, ResponseFormat, usage


async def generate(
    client: EngineClient,
    fmt: ResponseFormat,
    model: str,
    requests: list[TokenizeRequest],
    n: int,
    want_logprobs: bool,
    stream: bool,
    include_usage: bool,
) -> Response:
    """Run `requests` (n consecutive ones per prompt) and answer with one response."""
    group = client.submit(requests)
    items = group.items()
    try:
        started = await _wait_started(items, len(requests))
    except BaseException:
        client.abort(group)
        raise
    run = _Run(client, group, fmt, model, n, want_logprobs)
    if stream:
        body = run.stream(started, items, include_usage)
        return StreamingResponse(body, media_type="text/event-stream")
    return JSONResponse(await run.collect(started, items))


async def _wait_started(
    items: AsyncIterator[tuple[int, Item]], count: int
) -> list[tuple[int, ReqChunk]]:
    """The first chunk of every request; raises ApiError(400) if one was rejected."""
    started: list[tuple[int, ReqChunk]] = []
    while len(started) < count:
        index, item = await anext(items)
        if isinstance(item, ReqError):
            raise ApiError(400, item.message)
        started.append((index, item))
    return started


class _Run:
    def __init__(
        self,
        client: EngineClient,
        group: ReqGroup,
        fmt: ResponseFormat,
        model: str,
        n: int,
        want_logprobs: bool,
    ) -> None:
        self.client, self.group, self.fmt = client, group, fmt
        self.model, self.n, self.want_logprobs = model, n, want_logprobs
        self.id = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices = [Choice() for _ in group.rids]

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        return self.fmt.envelope(self.id, self.created, self.model, choices, chunk)

    async def _chunks(
        self, started: list[tuple[int, ReqChunk]], rest: AsyncIterator[tuple[int, Item]]
    ) -> AsyncIterator[tuple[int, ReqChunk]]:
        for index, chunk in started:
            yield index, chunk
        async for index, item in rest:
            assert isinstance(item, ReqChunk), "requests are rejected before they start"
            yield index, item

    async def collect(
        self, started: list[tuple[int, ReqChunk]], rest: AsyncIterator[tuple[int, Item]]
    ) -> dict[str, Any]:
        try:
            async for index, chunk in self._chunks(started, rest):
                self.choices[index].add(chunk)
        finally:
            self.client.abort(self.group)  # a no-op unless this handler was cancelled
        choices = [
            self.fmt.choice(i, c, 0, self.want_logprobs, delta=False, first=True)
            for i, c in enumerate(self.choices)
        ]
        return {**self._envelope(choices, chunk=False), "usage": usage(self.choices, self.n)}

    async def stream(
        self,
        started: list[tuple[int, ReqChunk]],
        rest: AsyncIterator[tuple[int, Item]],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """Server-sent events; a client that goes away cancels this, which aborts its requests."""
        try:
            async for index, chunk in self._chunks(started, rest):
                choice, piece = self.choices[index], Choice()
                piece.add(chunk)
                first, offset = not choice.completion_tokens, len(choice.text)
                choice.add(chunk)
                if first or chunk.text or chunk.logprob or chunk.finish_reason:
                    data = self.fmt.choice(index, piece, offset, self.want_logprobs, True, first)
                    yield _event(self._envelope([data], chunk=True))
            if include_usage:
                yield _event(
                    {**self._envelope([], chunk=True), "usage": usage(self.choices, self.n)}
                )
            yield "data: [DONE]\n\n"
        finally:
            self.client.abort(self.group)


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
