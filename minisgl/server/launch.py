"""The launcher: starts every process, waits until the server answers, then serves (or runs the
shell) until SIGINT/SIGTERM or until a child dies; then stops every child and removes the ipc files.

    launcher ─┬─ scheduler rank 0 .. tp-1   (minisgl.scheduler.worker)
              ├─ tokenizer + detokenizer    (minisgl.tokenizer.worker)
              └─ API server                 (minisgl.server.api_server)
"""

import ctypes
import multiprocessing
import multiprocessing.connection
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from minisgl.messages import Addresses
from minisgl.scheduler.worker import run_scheduler
from minisgl.tokenizer import run_tokenizer

from .api_server import run_api_server
from .args import ServerArgs
from .shell import run_shell

_STOP_TIMEOUT_S = 5.0
_PR_SET_PDEATHSIG = 1


class _Stop(Exception):
    """Raised in the launcher by SIGTERM or SIGHUP (SIGINT raises KeyboardInterrupt)."""


def _child_main(target: Callable[..., None], *args: Any) -> None:
    """Every child: ignore the terminal's Ctrl-C and hang-up (the launcher stops the children)
    and die with the launcher even if it is killed outright."""
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    target(*args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_port_free(host: str, port: int) -> None:
    """Fail before starting anything, rather than mistake another server's /health for ours."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise RuntimeError(f"cannot listen on {host}:{port}: {e.strerror}") from e


def _base_url(args: ServerArgs) -> str:
    """Where this machine reaches the server."""
    host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(args.host, args.host)
    return f"http://{host}:{args.port}"


def _start(args: ServerArgs, addresses: Addresses, procs: list[BaseProcess]) -> None:
    """Start every child, adding each to `procs` as it starts (a signal may cut this short)."""
    ctx = multiprocessing.get_context("spawn")
    dist_init = f"tcp://127.0.0.1:{_free_port()}" if args.engine.tp_size > 1 else None
    children: list[tuple[str, Callable[..., None], tuple[Any, ...]]] = [
        (
            f"scheduler-{rank}",
            run_scheduler,
            (
                replace(args.engine, tp_rank=rank, dist_init_method=dist_init),
                args.scheduler,
                addresses,
            ),
        )
        for rank in range(args.engine.tp_size)
    ]
    children.append(("tokenizer", run_tokenizer, (args.engine.model_path, addresses)))
    children.append(("api-server", run_api_server, (args, addresses)))
    for name, target, target_args in children:
        proc = ctx.Process(target=_child_main, args=(target, *target_args), name=name, daemon=True)
        proc.start()
        procs.append(proc)


def _dead(procs: list[BaseProcess]) -> list[str]:
    return [f"{p.name} (exit code {p.exitcode})" for p in procs if not p.is_alive()]


def _wait_ready(url: str, procs: list[BaseProcess]) -> None:
    """Until GET /health answers 200, which the API server does once the engine is ready."""
    while True:
        if dead := _dead(procs):
            raise RuntimeError(f"a process died during start-up: {', '.join(dead)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)


def _stop(procs: list[BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def launch(args: ServerArgs) -> int:
    """Run the server (or the shell) until stopped; returns the process exit code. Takes over
    the process's signals: the last thing a process should do."""

    def on_stop_signal(signum: int, frame: FrameType | None) -> None:
        raise _Stop

    for signum in (signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal was closed
        signal.signal(signum, on_stop_signal)
    ipc_dir = tempfile.mkdtemp(prefix="minisgl-")
    procs: list[BaseProcess] = []
    url = _base_url(args)
    try:
        _check_port_free(args.host, args.port)
        _start(args, Addresses.in_dir(ipc_dir, args.engine.tp_size), procs)
        _wait_ready(url, procs)
        if args.shell:
            run_shell(url, args.served_model_name, args.api_key)
            return 0
        print(f"minisgl: serving {args.served_model_name} at {url}/v1", file=sys.stderr, flush=True)
        multiprocessing.connection.wait([p.sentinel for p in procs])
        print(f"minisgl: a process died: {', '.join(_dead(procs))}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Stop):
        return 0
    except RuntimeError as e:
        print(f"minisgl: {e}", file=sys.stderr)
        return 1
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        _stop(procs)
        shutil.rmtree(ipc_dir, ignore_errors=True)
