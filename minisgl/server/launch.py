"""The launcher: starts every process, waits until the server answers, then serves (or runs the
shell) until SIGINT/SIGTERM or until a child dies.

    launcher ─┬─ scheduler rank 0 .. tp-1   (minisgl.scheduler.worker)
              ├─ tokenizer + detokenizer    (minisgl.tokenizer.worker)
              └─ API server                 (minisgl.server.api_server)

Over several machines (--nnodes) each runs a launcher: node 0's starts all of the above but the
other nodes' ranks, which their own launchers start, and which follow rank 0 until it stops.

On SIGINT or SIGTERM it lets the API server drain (--shutdown-timeout), then stops the rest. The
children talk over abstract sockets (the TP ranks among themselves over torch.distributed) and die
with the launcher, however it ends: nothing is left behind. This module imports nothing heavy:
each child imports only its own entry point.
"""

import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from minisgl.messages import Addresses
from minisgl.utils.process import local_init_method, start_child

from .args import ServerArgs
from .shell import run_shell

_STOP_TIMEOUT_S = 5.0


class _Stop(Exception):
    """Raised in the launcher by SIGTERM or SIGHUP (SIGINT raises KeyboardInterrupt)."""


def _raise_open_file_limit() -> None:
    """Every connection holds a file: take the hard limit, as vLLM and SGLang do."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _base_url(args: ServerArgs) -> str:
    """Where this machine reaches the server."""
    host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(args.host, args.host)
    return f"http://{host}:{args.port}"


def _node_ranks(args: ServerArgs) -> range:
    """The TP ranks this node runs: an even share, in rank order (node 0 holds rank 0)."""
    per_node = args.engine.ranks_per_node
    return range(args.node_rank * per_node, (args.node_rank + 1) * per_node)


def _start(args: ServerArgs, addresses: Addresses, procs: list[BaseProcess]) -> None:
    """Start every child of this node, adding each to `procs` as it starts (a signal may cut this
    short)."""
    if args.dist_init_addr is not None:
        dist_init = f"tcp://{args.dist_init_addr}"
    else:
        dist_init = local_init_method() if args.engine.tp_size > 1 else None
    children: list[tuple[str, str, tuple[Any, ...]]] = []
    for rank in _node_ranks(args):
        engine = replace(args.engine, tp_rank=rank, dist_init_method=dist_init)
        if rank == 0:
            entry, entry_args = "run_scheduler", (engine, args.scheduler, addresses)
        else:
            entry, entry_args = "run_follower", (engine, args.scheduler)
        children.append((f"scheduler-{rank}", f"minisgl.scheduler.worker:{entry}", entry_args))
    if args.node_rank == 0:
        tokenizer_args = (args.engine.model_path, addresses, args.chat_template)
        children.append(("tokenizer", "minisgl.tokenizer.worker:run_tokenizer", tokenizer_args))
        api_args = (args, addresses)
        children.append(("api-server", "minisgl.server.api_server:run_api_server", api_args))
    for name, target, target_args in children:
        procs.append(start_child(name, target, *target_args))


def _follow(args: ServerArgs, procs: list[BaseProcess]) -> int:
    """A node past 0: its ranks follow rank 0's until rank 0 stops (0) or one of them fails (1)."""
    ranks = _node_ranks(args)
    print(
        f"minisgl: node {args.node_rank} of {args.engine.nnodes} runs TP ranks {ranks.start}-"
        f"{ranks.stop - 1}, led by rank 0 at {args.dist_init_addr}",
        file=sys.stderr,
        flush=True,
    )
    multiprocessing.connection.wait([p.sentinel for p in procs])
    dead = _dead(procs)
    if all(p.exitcode == 0 for p in procs if p.exitcode is not None):
        print("minisgl: rank 0 has stopped", file=sys.stderr)
        return 0
    print(f"minisgl: a process exited: {', '.join(dead)}", file=sys.stderr)
    return 1


def _dead(procs: list[BaseProcess]) -> list[str]:
    """The children that have exited, with their exit codes."""
    dead = []
    for proc in procs:
        proc.join(0)  # reaps it if it has exited: its exit code is then known
        if proc.exitcode is not None:
            dead.append(f"{proc.name} (exit code {proc.exitcode})")
    return dead


def _wait_ready(url: str, procs: list[BaseProcess]) -> None:
    """Until GET /health answers 200, which the API server does once the engine is ready."""
    while True:
        if dead := _dead(procs):
            raise RuntimeError(f"a process exited during start-up: {', '.join(dead)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)


def _drain(procs: list[BaseProcess], shutdown_timeout: float) -> None:
    """Let the API server answer what it has (SIGTERM: it drains, then exits)."""
    api = next((p for p in procs if p.name == "api-server"), None)
    if api is not None and api.is_alive():
        api.terminate()
        api.join(shutdown_timeout + _STOP_TIMEOUT_S)


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
    _raise_open_file_limit()  # the children inherit it
    os.environ["MINISGL_LOG_LEVEL"] = args.log_level  # read by the children's loggers
    procs: list[BaseProcess] = []
    url = _base_url(args)
    stopping = False
    start = time.monotonic()
    try:
        _start(args, Addresses.new(), procs)
        if args.node_rank > 0:
            return _follow(args, procs)
        _wait_ready(url, procs)
        if args.shell:
            run_shell(url, args.served_model_name, args.api_key)
            return 0
        ready = time.monotonic() - start
        print(
            f"minisgl: serving {args.served_model_name} at {url}/v1 (ready in {ready:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
        multiprocessing.connection.wait([p.sentinel for p in procs])
        print(f"minisgl: a process exited: {', '.join(_dead(procs))}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Stop):
        stopping = True
        return 0
    except RuntimeError as e:
        print(f"minisgl: {e}", file=sys.stderr)
        return 1
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        if stopping:
            _drain(procs, args.shutdown_timeout)
        _stop(procs)
