"""A module's shared server that a failed test cannot pass on to the next."""

from collections.abc import Callable

import httpx

from ..server_process import ServerProcess
from .checks import MODEL, QUEUED, RUNNING


class ServerKeeper:
    """A module's shared server, replaced by a fresh one when a test left it dead or not serving,
    so that one test's failure does not fail every test after it."""

    def __init__(self, start: Callable[[], ServerProcess]) -> None:
        self._start = start
        self._server: ServerProcess | None = None

    def get(self) -> ServerProcess:
        if self._server is not None and not _serving(self._server):
            self._server.kill()
            self._server = None
        if self._server is None:
            self._server = self._start()
        return self._server

    def stop(self) -> None:
        """Stop a server still serving (checking that it leaves nothing behind); kill a broken
        one, whose test has failed already."""
        if self._server is not None and _serving(self._server):
            self._server.stop()
        elif self._server is not None:
            self._server.kill()


def _serving(server: ServerProcess) -> bool:
    """Alive, answering a small completion, and nothing left running or waiting."""
    if server.proc.poll() is not None:
        return False
    try:
        small = server.post(
            "/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 1}, timeout=10
        )
        m = server.metrics()
    except httpx.HTTPError:
        return False
    return small.status_code == 200 and m[RUNNING] == m[QUEUED] == 0
