"""The API server's engine client on its own, fed through its ZMQ socket as the tokenizer process
feeds it."""

import asyncio
import time

import zmq

from minisgl.messages import Addresses, Heartbeat, Ready, connect_push, send
from minisgl.server.engine_client import EngineClient
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
