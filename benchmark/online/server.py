"""--launch: our server (`python -m minisgl`) as a child process for the benchmark's lifetime,
from the first GET /health that answers 200 until it has exited after SIGTERM."""

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

_STOP_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """`python -m minisgl *argv`, its output in `log_path`; argv sets the port of `base_url`."""

    def __init__(self, argv: list[str], base_url: str, log_path: Path, timeout_s: float) -> None:
        self.command = [sys.executable, "-m", "minisgl", *argv]
        self.base_url = base_url
        self.log_path = log_path
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> "LaunchedServer":
        with open(self.log_path, "wb") as log:
            # a session of its own: the terminal's Ctrl-C reaches the benchmark, which stops it
            self._proc = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_ready(self._proc)
        except BaseException:
            self._stop(self._proc)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._proc is not None:
            self._stop(self._proc)

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}):\n{self._log_tail()}")
            try:
                response = httpx.get(self.base_url + "/health", timeout=1, trust_env=False)
                if response.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server was not ready in {self.timeout_s} s:\n{self._log_tail()}")

    def _stop(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGTERM, as a process manager stops it; killed only if it does not exit in time."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
