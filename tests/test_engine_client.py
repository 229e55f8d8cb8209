"""The API server's engine client on its own, fed through its ZMQ socket as the tokenizer process
feeds it."""

import asyncio
import contextlib
import time

import pytest
import zmq

from minisgl.core import SamplingParams
from minisgl.messages import (
    Addresses,
    Finished,
    Heartbeat,
    Ready,
    TextOutputs,
    TokenizeRequest,
    connect_push,
    send,
)
from minisgl.server.engine_client import EngineClient
from minisgl.server.errors import ApiError
from minisgl.server.metrics import Metrics


def test_a_backlog_of_messages_lets_the_other_handlers_run_between_them() -> None:
    """Ready, 2,000 heartbeats of a turning loop, then one of a loop stuck for 100 s: a handler
    that runs while the backlog drains still finds the server healthy, and once it has drained,
    not (the client read the last one)."""

    async def scenario() -> tuple[bool, bool]:
        addresses = Addresses.new()
        client = EngineClient(addresses, Metrics())
        push = connect_push(zmq.Context(), addresses.api)
        send(push, Ready(512, 512))
        for _ in range(2000):
            send(push, Heartbeat(0.0))
        send(push, Heartbeat(100.0))
        await asyncio.sleep(0.5)  # every message queued at the client's socket
        reader = asyncio.create_task(client.run())
        await asyncio.sleep(0)  # the reader starts and takes its first message
        await asyncio.sleep(0)
        while_draining = client.healthy(10)
        deadline = time.monotonic() + 30  # a loaded machine may be slow to drain it
        while client.healthy(10) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        drained = not client.healthy(10)
        reader.cancel()
        return while_draining, drained

    while_draining, drained = asyncio.run(scenario())
    assert while_draining and drained


def test_an_aborted_request_leaves_the_queue_at_once_and_only_once() -> None:
    """A queue of 2: a request of two choices is aborted (its client left, or its
    --request-timeout passed) before any first token, and another of two is taken at once, not
    refused until the engine confirms the abort. That confirmation, arriving later, does not
    count the first request out a second time: a third request of one is still a 429."""

    def request(client: EngineClient, n: int) -> TokenizeRequest:
        return TokenizeRequest(client.new_rids(n), [SamplingParams()], prompts=["hi"])

    async def scenario() -> None:
        addresses = Addresses.new()
        client = EngineClient(addresses, Metrics(), max_queued=2)
        push = connect_push(zmq.Context(), addresses.api)
        reader = asyncio.create_task(client.run())
        first = request(client, 2)
        client.abort(client.submit(first))
        client.submit(request(client, 2))
        aborted = [Finished(rid, "abort", None, 1, 0, 0) for rid in first.rids]
        send(push, TextOutputs(finished=aborted))
        await asyncio.sleep(0.5)  # the confirmation routed
        with pytest.raises(ApiError) as refused:
            client.submit(request(client, 1))
        assert refused.value.status == 429
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        client.close()
        push.context.destroy(linger=0)

    asyncio.run(scenario())
