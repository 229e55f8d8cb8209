"""Clients the stress scenarios run beside the server: another client whose stream must keep
going, a stream read to its end, and a request on a raw socket that can leave at any moment."""

import json
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from ..server_process import ServerProcess
from .checks import MODEL


@contextmanager
def bystander(server: ServerProcess, max_tokens: int = 128) -> Iterator[None]:
    """Another client's stream (the `openai` client; top_p sampling, eos ignored) is under way
    when the block starts and must end with every one of its tokens: the server kept serving
    others while the block's hostile requests were handled."""
    started = threading.Event()
    outcome: dict[str, Any] = {}

    def stream() -> None:
        try:
            chunks = server.client(max_retries=0, timeout=120).completions.create(
                model=MODEL,
                prompt="Once upon a time",
                max_tokens=max_tokens,
                top_p=0.9,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in chunks:
                started.set()
                outcome["usage"] = chunk.usage or outcome.get("usage")
                if chunk.choices and chunk.choices[0].finish_reason:
                    outcome["finish_reason"] = chunk.choices[0].finish_reason
        except Exception as e:
            outcome["error"] = e
        finally:
            started.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    started.wait(60)
    yield
    thread.join(120)
    assert not thread.is_alive(), "the other client's stream hung"
    assert "error" not in outcome, f"the other client's stream failed: {outcome['error']!r}"
    assert outcome.get("finish_reason") == "length", outcome
    assert outcome["usage"].completion_tokens == max_tokens


@dataclass
class Streamed:
    """What a client read from a streaming request: the status, the data of every event but the
    last `[DONE]`, and whether `[DONE]` came."""

    status: int
    events: list[Any]
    done: bool

    @property
    def completion_tokens(self) -> int | None:
        usages = [e["usage"] for e in self.events if isinstance(e, dict) and e.get("usage")]
        return usages[-1]["completion_tokens"] if usages else None

    @property
    def finish_reasons(self) -> list[str]:
        return [
            c["finish_reason"]
            for e in self.events
            if isinstance(e, dict)
            for c in e.get("choices", [])
            if c.get("finish_reason")
        ]


def read_stream(
    server: ServerProcess,
    route: str,
    body: dict[str, Any],
    on_event: Callable[[], None] | None = None,
    url: str | None = None,
) -> Streamed:
    """POST `body` (with stream: true) to the server, or to `url` (a --dp replica's), and read
    the answer to its end, calling `on_event` as each event arrives."""
    with httpx.stream(
        "POST", (url or server.url) + route, json=body, headers=server.headers, timeout=120
    ) as response:
        if response.status_code != 200:
            return Streamed(response.status_code, [json.loads(response.read())], False)
        events, done = [], False
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                assert not done, "an event after [DONE]"
                events.append(json.loads(line.removeprefix("data: ")))
                if on_event is not None:
                    on_event()
        return Streamed(200, events, done)


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in server.headers.items())
        + "\r\n"
    )
    return head.encode() + data


class RawRequest:
    """A POST with a JSON body on a socket of its own: `leave()` is a client that goes away (its
    socket closed) at whatever point the test has reached; a small `receive_buffer` and no read,
    one that stops reading; `behind`, a second POST sent right after it on the connection
    (HTTP/1.1 pipelining)."""

    def __init__(
        self,
        server: ServerProcess,
        path: str,
        body: dict[str, Any],
        receive_buffer: int | None = None,
        behind: dict[str, Any] | None = None,
    ) -> None:
        self.sock = socket.socket()
        if receive_buffer is not None:  # before connecting: the window is agreed then
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.settimeout(60)
        self.sock.connect(("127.0.0.1", server.port))
        second = b"" if behind is None else _post(server, path, behind)
        self.sock.sendall(_post(server, path, body) + second)
        self.received = b""

    def answered(self) -> bool:
        """Whether any byte of the answer has arrived (without waiting for one)."""
        self.sock.setblocking(False)
        try:
            self.received += self.sock.recv(65536)
        except BlockingIOError:
            pass
        finally:
            self.sock.settimeout(60)
        return bool(self.received)

    def read_until(self, done: Callable[[bytes], bool]) -> bytes:
        """Read until `done(everything received)`; the server must not close first."""
        while not done(self.received):
            data = self.sock.recv(65536)
            assert data, "the server closed the connection"
            self.received += data
        return self.received

    def closed_by_server(self, timeout: float) -> bool:
        """Whether the server ends the connection within `timeout` seconds (what it still sends
        before that is read and dropped)."""
        return closed_by_server([self.sock], timeout)

    def leave(self) -> None:
        self.sock.close()


def closed_by_server(socks: list[socket.socket], timeout: float) -> bool:
    """Whether the server closes every socket within `timeout` seconds (each reads EOF; what it
    still sends before that is read and dropped)."""
    with selectors.DefaultSelector() as selector:  # epoll: select() stops at fd 1024
        for s in socks:
            selector.register(s, selectors.EVENT_READ)
        left, deadline = len(socks), time.monotonic() + timeout
        while left and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.5):
                try:
                    closed = key.fileobj.recv(65536) == b""
                except ConnectionError:
                    closed = True
                if closed:
                    selector.unregister(key.fileobj)
                    left -= 1
    return left == 0
