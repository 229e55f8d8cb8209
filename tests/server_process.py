"""`python -m minisgl` as a real process for tests: started on a free port in its own session and
its own TMPDIR, stopped with a check that no child process and no ipc file is left."""

import contextlib
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai

from .conftest import DEVICE

START_TIMEOUT_S = 180
# a client that leaves while the scheduler is stopped (`scheduler_stopped`): time for its abort to
# reach the scheduler's inbox through the API server and the tokenizer, which run on
ABORT_ARRIVES_S = 2
# how long the scheduler runs between two looks at its metrics in scheduler_stopped
_SLICE_S = 0.01


def free_port() -> int:
    """A free port below the kernel's ephemeral range, which port 0 binds and outgoing connections
    draw from: no other process takes it before the server binds it (a --dp server binds its
    port once its replicas are ready, seconds later)."""
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    while True:
        port = random.randrange(10_000, ephemeral)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def wait_for(condition: Callable[[], bool], timeout: float = 30, what: str = "timed out") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def read_metrics(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Every sample of the server's GET /metrics, by name with labels."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def spawned_children(pid: int) -> list[int]:
    """`pid`'s children that multiprocessing spawned (minisgl's), not its resource tracker,
    which leaves a moment after its parent."""
    out = []
    for child in children(pid):
        with contextlib.suppress(OSError):  # exited since
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(child)
    return out


def process_name(pid: int) -> str:
    """The name a process goes by (its /proc/<pid>/comm): minisgl names each child."""
    return Path(f"/proc/{pid}/comm").read_text().strip()


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class ServerProcess:
    """`python -m minisgl ...` on a free port, in its own session and its own TMPDIR (where the
    launcher would put ipc files), so stopping it can be checked for leftovers.

    `api_key` is the key clients send, given as --api-key unless `env` (variables added to the
    server's environment) holds MINISGL_API_KEY; `open_files` sets the server's soft open-file limit."""

    def __init__(
        self,
        tmp: Path,
        *options: str,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        open_files: int | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.tmpdir = tmp / "ipc"
        self.tmpdir.mkdir()
        self.log_path = tmp / "server.log"
        # fp32 on the test device, like the offline engines the answers are compared with
        device = ["--device", DEVICE, "--dtype", "float32"] if "--device" not in options else []
        args = [sys.executable, "-m", "minisgl", "--port", str(self.port), *device, *options]
        if api_key is not None and "MINISGL_API_KEY" not in (env or {}):
            args += ["--api-key", api_key]

        def limit_open_files() -> None:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, hard))

        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "TMPDIR": str(self.tmpdir), **(env or {})},
                start_new_session=True,
                preexec_fn=limit_open_files if open_files is not None else None,
            )
        self._wait_ready()
        self.children = children(self.proc.pid)

    def _wait_ready(self) -> None:
        """Until the launcher says it serves: once /health answers 200 (with --dp, once the
        router routes to every replica)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited:\n{self.log()}"
            if "minisgl: serving " in self.log():
                return
            time.sleep(0.2)
        raise TimeoutError(f"server not ready:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key=self.api_key or "none", **kwargs
        )

    def post(self, path: str, headers: dict[str, str] | None = None, **kwargs) -> httpx.Response:
        headers = {**self.headers, **(headers or {})}
        return httpx.post(self.url + path, headers=headers, **{"timeout": 60, **kwargs})

    def metrics(self) -> dict[str, float]:
        return read_metrics(self.url, self.headers)

    def child(self, comm: str) -> int:
        """The pid of the child process named `comm` (as /proc/<pid>/comm has it)."""
        names = {}
        for pid in self.children:
            try:
                names[process_name(pid)] = pid
            except OSError:
                continue
        assert comm in names and alive(names[comm]), f"no child named {comm!r}: {sorted(names)}"
        return names[comm]

    @contextlib.contextmanager
    def scheduler_stopped(
        self, until: Callable[[dict[str, float]], bool] = lambda m: True, timeout: float = 30
    ) -> Iterator[dict[str, float]]:
        """The block runs with the scheduler (rank 0) stopped by SIGSTOP, from the first moment
        its /metrics meet `until` (those metrics are yielded): no request moves however slow the
        machine, and what is sent to the scheduler meanwhile waits in its inbox. Until then the
        scheduler runs a tenth of the time at most, in slices: a request that arrived first
        cannot run to its end while the machine is slow to send the others `until` waits for."""
        pid = self.child("scheduler-0")
        deadline = time.monotonic() + timeout
        try:
            while True:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(9 * _SLICE_S)  # for the slice's outputs to reach the API server
                metrics = self.metrics()
                if until(metrics):
                    break
                assert time.monotonic() < deadline, "metrics never met the condition"
                os.kill(pid, signal.SIGCONT)
                time.sleep(_SLICE_S)
            yield metrics
        finally:
            with contextlib.suppress(ProcessLookupError):  # the block may kill it
                os.kill(pid, signal.SIGCONT)

    def ipc_files(self) -> list[Path]:
        return sorted(self.tmpdir.glob("minisgl-*"))

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop the server as a terminal's Ctrl-C would (SIGINT to the whole session) or as a
        process manager would (SIGTERM to the launcher alone); check that it exits with 0 and
        leaves no child and no ipc file. A launcher that had already exited must have done so
        cleanly too."""
        if self.proc.poll() is None:
            if signum == signal.SIGINT:
                os.killpg(self.proc.pid, signum)
            else:
                self.proc.send_signal(signum)
        assert self.wait_exit(timeout=30) == 0, self.log()

    def wait_exit(self, timeout: float) -> int:
        """The launcher's exit code, once it has exited within `timeout` seconds and every child
        is gone; checks that no ipc file is left."""
        code = self.proc.wait(timeout=timeout)
        # multiprocessing's resource tracker leaves a moment after the launcher
        wait_for(lambda: not [pid for pid in self.children if alive(pid)], 10, "children left")
        assert not self.ipc_files(), f"leftover ipc files: {self.ipc_files()}"
        return code

    def kill(self) -> None:
        """SIGKILL the whole session: for a server a failed test left in an unknown state."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
