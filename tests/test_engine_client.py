"""The API server's engine client on its own, fed through its ZMQ socket as the tokenizer process
feeds it."""

import asyncio
import time

import pytest
import zmq

from minisgl.core import SamplingParams
from minisgl.messages import Addresses, Heartbeat, Ready, TokenizeRequest, connect_push, send
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


def test_a_request_that_cannot_be_packed_holds_no_place_in_the_queue() -> None:
    """Template variables nested past msgpack's limit are a 400, and the queue's one place is
    still free for the next request (its routes were taken before the packing failed)."""
    client = EngineClient(Addresses.new(), Metrics(), max_queued=1)
    deep: object = 1
    for _ in range(1100):
        deep = {"a": deep}
    with pytest.raises(ApiError, match="nests too deep") as refused:
        client.submit(TokenizeRequest([0], [SamplingParams()], ["x"], template_kwargs={"d": deep}))
    assert refused.value.status == 400
    client.submit(TokenizeRequest([1], [SamplingParams()], ["x"]))
    with pytest.raises(ApiError, match="too many requests"):  # the one place is taken now
        client.submit(TokenizeRequest([2], [SamplingParams()], ["x"]))
