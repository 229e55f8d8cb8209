"""A handler's wait that ends when its client goes away (a non-streaming one: Starlette cancels a
stream whose client went away, and tells no other handler)."""

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready (answered 499, which nobody reads)."""


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; raises ClientGone, and cancels it, if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finished = task.done()
    finally:  # also when this coroutine is cancelled: neither outlives it
        task.cancel()
        watcher.cancel()
    if not finished:
        raise ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
