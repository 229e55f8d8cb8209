"""The stress scenarios' servers: an ordinary one shared by the package (only flags that exist
today), for the scenarios that describe behaviour which holds before and after any fix; and a
factory for a scenario's own server, killed at teardown whatever the test left it in."""

from collections.abc import Callable, Iterator

import pytest

from ..server_process import ServerProcess
from .checks import MODEL


@pytest.fixture(scope="package")
def ordinary_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess(
        tmp_path_factory.mktemp("ordinary"),
        "--max-kv-tokens",
        "16384",
        "--served-model-name",
        MODEL,
    )
    yield s
    s.stop()


@pytest.fixture
def start_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., ServerProcess]]:
    """start_server(*options, **ServerProcess keywords): a server serving MODEL; a test that
    checks how it stops calls stop() or wait_exit() itself."""
    started: list[ServerProcess] = []

    def start(*options: str, **kwargs) -> ServerProcess:
        path = tmp_path_factory.mktemp("server")
        started.append(ServerProcess(path, *options, "--served-model-name", MODEL, **kwargs))
        return started[-1]

    yield start
    for s in started:
        s.kill()  # a no-op for a server that has exited
