"""The launcher: starts every process, waits until the server answers, then serves (or runs the
shell) until SIGINT/SIGTERM or until a child dies.

    launcher ─┬─ scheduler rank 0 .. tp-1   (minisgl.scheduler.worker)
              ├─ tokenizer + detokenizer    (minisgl.tokenizer.worker)
              └─ API server                 (minisgl.server.api_server)

Over several machines (--nnodes) each runs a launcher: node 0's starts all of the above but the
other nodes' ranks, which their own launchers start, and which follow rank 0 until it stops.

With --dp N it starts N such servers, the replicas (r0-scheduler-0, r0-tokenizer, r0-api-server,
r1-...), each on a free port of 127.0.0.1 and on GPUs and CPU cores of its own (placement.py),
then vllm-router in front of them on --host/--port (router.py). A replica that loses a process
is stopped whole and taken out of the router, and the others serve on; the launcher ends when the
router or the last replica does.

On SIGINT or SIGTERM it lets the API servers (and the router) drain (--shutdown-timeout), then
stops the rest; the other children ignore both, so a signal sent to the whole process group
(a terminal's Ctrl-C, systemd's stop) drains too. Once a process has died, no open request of its
server can finish: that API server answers each with a 503 at once (SIGUSR1), the launcher stops
the rest and exits 1; under --shell, a reply under way gets that error and the shell ends at the
next line. The children talk over abstract sockets (the TP ranks among themselves over
torch.distributed) and die with the launcher, however it ends: nothing is left behind. This
module imports nothing heavy: each child imports only its own entry point.
"""

import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
import socket
import sys
import threading
import time
import urllib.error
from collections.abc import Callable, Iterable
from dataclasses import replace
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from minisgl.messages import Addresses
from minisgl.utils import sampling_defaults
from minisgl.utils.process import local_init_method, start_child

from .args import ServerArgs
from .direct_http import open_direct
from .placement import Placement, placements
from .router import leave_out
from .shell import run_shell

_STOP_TIMEOUT_S = 5.0
_REPLICA_HOST = "127.0.0.1"  # --dp's replicas listen here, behind the router
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Stop(Exception):
    """Raised in the launcher by SIGTERM or SIGHUP (SIGINT raises KeyboardInterrupt), and by any of
    the three held while a child starts (`_start_into`)."""


def _say(text: str) -> None:
    print(f"minisgl: {text}", file=sys.stderr, flush=True)


def _raise_open_file_limit() -> None:
    """Every connection holds a file: take the hard limit, as vLLM and SGLang do."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _free_ports(n: int) -> list[int]:
    """n distinct free ports of 127.0.0.1 (each held until all are found)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _base_url(args: ServerArgs) -> str:
    """Where this machine reaches the server."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(args.host, args.host)
    return f"http://[{host}]:{args.port}" if ":" in host else f"http://{host}:{args.port}"


def _router_bypasses_proxies() -> None:
    """Have vllm-router, started after this, reach the replicas directly: it honours
    `http_proxy`, and `no_proxy` (which this adds the replicas' host to)."""
    for name in ("no_proxy", "NO_PROXY"):
        given = [entry for entry in os.environ.get(name, "").split(",") if entry]
        os.environ[name] = ",".join(dict.fromkeys([*given, _REPLICA_HOST]))


def _node_ranks(args: ServerArgs) -> range:
    """The TP ranks this node runs: an even share, in rank order (node 0 holds rank 0)."""
    per_node = args.engine.ranks_per_node
    return range(args.node_rank * per_node, (args.node_rank + 1) * per_node)


def _start(
    args: ServerArgs,
    procs: list[BaseProcess],
    prefix: str = "",
    placement: Placement | None = None,
) -> None:
    """Start one server's children of this node, their names prefixed with `prefix` and on
    `placement` (a --dp replica's), adding each to `procs` as it starts (a signal may cut this
    short)."""
    addresses = Addresses.new()
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
            entry, entry_args = "run_follower", (engine, args.scheduler, False)
        children.append((f"scheduler-{rank}", f"minisgl.scheduler.worker:{entry}", entry_args))
    if args.node_rank == 0:
        tokenizer_args = (args.engine.model_path, addresses, args.chat_template)
        children.append(("tokenizer", "minisgl.tokenizer.worker:run_tokenizer", tokenizer_args))
        api_args = (args, addresses)
        children.append(("api-server", "minisgl.server.api_server:run_api_server", api_args))
    setup = None if placement is None else placement.apply
    for name, target, target_args in children:
        _start_into(procs, prefix + name, target, *target_args, setup=setup)


def _start_into(
    procs: list[BaseProcess],
    name: str,
    target: str,
    *args: Any,
    setup: Callable[[], None] | None = None,
) -> None:
    """Start a child and add it to `procs`, holding a stop signal meanwhile: one that landed
    between the two left a child no stop joined (CI: alive after the launcher had exited), and
    one multiprocessing knew of would hang the launcher's exit (its exit handler joins a daemonic
    child after a SIGTERM that ours ignore)."""
    held: list[int] = []
    handlers = {s: signal.signal(s, lambda signum, _: held.append(signum)) for s in _STOP_SIGNALS}
    try:
        procs.append(start_child(name, target, *args, setup=setup))
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    if held:
        raise _Stop


def _follow(args: ServerArgs, procs: list[BaseProcess]) -> int:
    """A node past 0: its ranks follow rank 0's until rank 0 stops (0) or one of them fails (1)."""
    ranks = _node_ranks(args)
    _say(
        f"node {args.node_rank} of {args.engine.nnodes} runs TP ranks {ranks.start}-"
        f"{ranks.stop - 1}, led by rank 0 at {args.dist_init_addr}"
    )
    multiprocessing.connection.wait([p.sentinel for p in procs])
    dead = _dead(procs)
    if all(p.exitcode == 0 for p in procs if p.exitcode is not None):
        _say("rank 0 has stopped")
        return 0
    _say(f"a process exited: {', '.join(dead)}")
    return 1


def _start_replicas(
    args: ServerArgs, replicas: list[list[BaseProcess]], ports: list[int]
) -> list[str]:
    """Start the --dp replicas, each on its port and placement, adding each one's processes to
    `replicas`; their URLs."""
    urls = []
    where = placements(args.dp_size, args.engine.tp_size)
    for i, (port, placement) in enumerate(zip(ports, where, strict=True)):
        # on 127.0.0.1: only the router (and a local metrics scraper) reaches a replica
        replica = replace(args, host=_REPLICA_HOST, port=port, dp_size=1)
        replicas.append([])
        _start(replica, replicas[i], f"r{i}-", placement)
        urls.append(_base_url(replica))
    return urls


def _start_data_parallel(
    args: ServerArgs, replicas: list[list[BaseProcess]], router: list[BaseProcess]
) -> tuple[list[str], str]:
    """Start the replicas, then, once each is ready, the router in front of them (adding its
    process to `router`), until it routes to them all; the replicas' URLs and the router's
    metrics URL."""
    *ports, metrics_port = _free_ports(args.dp_size + 1)
    urls = _start_replicas(args, replicas, ports)
    for url in urls:
        _wait_ready(url + "/health", _flat(replicas))
    _router_bypasses_proxies()
    _start_into(router, "router", "minisgl.server.router:run_router", args, urls, metrics_port)

    def all_healthy(body: bytes) -> bool:  # vllm-router's /readiness
        return json.loads(body)["healthy_workers"] == args.dp_size

    _wait_ready(_base_url(args) + "/readiness", [*_flat(replicas), *router], all_healthy)
    return urls, _base_url(replace(args, port=metrics_port)) + "/metrics"


def _take_out(router_url: str, replica_url: str, api_key: str | None) -> None:
    try:
        leave_out(router_url, replica_url, api_key)
    except OSError as e:  # an HTTP error too
        _say(f"the router did not take {replica_url} out ({e}); its health checks will")


def _flat(groups: Iterable[list[BaseProcess]]) -> list[BaseProcess]:
    return [proc for group in groups for proc in group]


def _dead(procs: list[BaseProcess]) -> list[str]:
    """The children that have exited, with their exit codes."""
    ended = set(multiprocessing.connection.wait([p.sentinel for p in procs], timeout=0))
    dead = []
    for proc in procs:
        if proc.sentinel in ended:
            # the sentinel fires as the child exits, a moment before its exit code can be reaped:
            # join(0) missed it for 4 of 8 killed children of 64 threads
            proc.join(_STOP_TIMEOUT_S)
            dead.append(f"{proc.name} (exit code {proc.exitcode})")
    return dead


def _wait_ready(
    url: str, procs: list[BaseProcess], ready: Callable[[bytes], bool] = lambda body: True
) -> None:
    """Until GET `url` answers 200 with a body that `ready` accepts (an API server's /health
    answers 200 once its engine is ready); raises if one of `procs` exits first."""
    while True:
        if dead := _dead(procs):
            raise RuntimeError(f"a process exited during start-up: {', '.join(dead)}")
        try:
            with open_direct(url, timeout=1) as response:
                if response.status == 200 and ready(response.read()):
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)


def _drains(proc: BaseProcess) -> bool:
    """An API server or the router: it drains on SIGTERM (the others ignore it)."""
    return proc.name.endswith("api-server") or proc.name == "router"


def _stop(procs: list[BaseProcess], timeout: float = _STOP_TIMEOUT_S) -> None:
    """SIGTERM for the API servers and the router, then SIGKILL for those still running
    `timeout` seconds later; SIGKILL at once for the others, which ignore SIGTERM (and which
    SIGTERM's default action ended as abruptly)."""
    for proc in procs:
        if proc.is_alive():
            if _drains(proc):
                proc.terminate()
            else:
                proc.kill()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _answer_open_requests(procs: list[BaseProcess]) -> None:
    """A server that lost a process can finish none of its open requests: its API server, if
    still running, answers each with a 503 at once (SIGUSR1) and exits."""
    for proc in procs:
        if proc.name.endswith("api-server") and proc.is_alive():
            with contextlib.suppress(ProcessLookupError):  # it exited since
                os.kill(proc.pid, signal.SIGUSR1)


def _drain(servers: list[list[BaseProcess]], router: list[BaseProcess], timeout: float) -> None:
    """SIGTERM the API servers and the router, which drain, and wait until they have exited or
    `timeout` seconds; should another process of a server exit meanwhile, none of that server's
    open requests can finish (the other --dp replicas' still may)."""
    fronts = [proc for proc in [*_flat(servers), *router] if _drains(proc)]
    for proc in fronts:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + timeout
    server_of = {proc.sentinel: procs for procs in servers for proc in procs}
    waiting = {proc.sentinel: proc for proc in [*_flat(servers), *router]}
    while any(proc in waiting.values() for proc in fronts):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        for sentinel in multiprocessing.connection.wait(list(waiting), left):
            if not _drains(waiting.pop(sentinel)):
                _answer_open_requests(server_of[sentinel])


class _ShellWatcher(threading.Thread):
    """Under the shell: once a process exits, a reply under way gets its error at once, and the
    shell learns which process it was at the next line."""

    def __init__(self, procs: list[BaseProcess]) -> None:
        super().__init__(daemon=True)
        self._procs = procs
        self._fired: list[int] = []  # the sentinels that woke it
        self.closed = threading.Event()  # the shell ended: what exits next is stopped by us

    def run(self) -> None:
        self._fired = multiprocessing.connection.wait([p.sentinel for p in self._procs])
        if not self.closed.is_set():
            _answer_open_requests([p for p in self._procs if p.sentinel not in self._fired])

    def exited(self) -> list[str]:
        """The processes that had exited when it woke (none before), with their exit codes."""
        return _dead([p for p in self._procs if p.sentinel in self._fired])


def launch(args: ServerArgs) -> int:
    """Run the server (or the shell) until stopped; returns the process exit code. Takes over
    the process's signals: the last thing a process should do."""

    def on_stop_signal(signum: int, frame: FrameType | None) -> None:
        raise _Stop

    for signum in (signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal was closed
        signal.signal(signum, on_stop_signal)
    _raise_open_file_limit()  # the children inherit it
    os.environ["MINISGL_LOG_LEVEL"] = args.log_level  # read by the children's loggers
    servers: list[list[BaseProcess]] = []  # the server's processes; with --dp, each replica's
    router: list[BaseProcess] = []  # with --dp
    url = _base_url(args)
    stopping = broken = serving = False
    start = time.monotonic()
    try:
        if args.dp_size == 1:
            servers.append([])
            _start(args, servers[0])
            if args.node_rank > 0:
                return _follow(args, servers[0])
            if args.engine.nnodes > 1:  # its start waits for them: say so, not nothing
                ranks = _node_ranks(args)
                _say(
                    f"node 0 of {args.engine.nnodes} runs TP ranks 0-{ranks.stop - 1}; waiting "
                    f"for the other nodes at {args.dist_init_addr}"
                )
            _wait_ready(url + "/health", servers[0])
            behind, replica_urls = "", []
        else:
            replica_urls, metrics = _start_data_parallel(args, servers, router)
            behind = (
                f" through vllm-router ({args.router_policy}; its metrics at {metrics}) in "
                f"front of replicas at {', '.join(replica_urls)}"
            )
        serving = True
        if defaults := sampling_defaults(args.generation_config, args.engine.model_path):
            _say(
                f"requests that leave them out sample with {defaults} (--generation-config "
                f"{args.generation_config}: generation_config.json's; vllm: none)"
            )
        if args.shell:
            watcher = _ShellWatcher([*_flat(servers), *router])
            watcher.start()
            run_shell(url, args.served_model_name, args.api_key, watcher.exited)
            watcher.closed.set()
            if dead := watcher.exited():  # before the shell's /exit or Ctrl-D
                raise RuntimeError(f"a process exited: {', '.join(dead)}")
            return 0
        ready = time.monotonic() - start
        _say(f"serving {args.served_model_name} at {url}/v1{behind} (ready in {ready:.1f} s)")
        _serve(servers, router, lambda i: _take_out(url, replica_urls[i], args.api_key))
        broken = True
        return 1
    except (KeyboardInterrupt, _Stop):
        stopping = True
        return 0
    except RuntimeError as e:  # a process exited during start-up or under the shell
        _say(str(e))
        broken = True
        return 1
    finally:
        for signum in _STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        procs = [*_flat(servers), *router]
        if stopping and serving:  # the API servers and the router drain on SIGTERM: they answer
            _drain(servers, router, args.shutdown_timeout + _STOP_TIMEOUT_S)  # what they have
        elif broken:
            _answer_open_requests(procs)
        # still starting, nothing to answer, and an API server may not yet take SIGTERM (a stop
        # then waited for the drain's 15 s)
        _stop(procs, _STOP_TIMEOUT_S if serving else 0.0)


def _serve(
    servers: list[list[BaseProcess]], router: list[BaseProcess], lost: Callable[[int], None]
) -> None:
    """Until a process exits; with the router, until it exits or the last replica has. A replica
    that loses a process is stopped whole, then `lost(its index)`."""
    live = dict(enumerate(servers))
    while live:
        multiprocessing.connection.wait([p.sentinel for p in [*router, *_flat(live.values())]])
        if not router or _dead(router):
            _say(f"a process exited: {', '.join(_dead([*router, *_flat(live.values())]))}")
            return
        for i, procs in list(live.items()):
            if dead := _dead(procs):
                _answer_open_requests(procs)
                lost(i)
                _stop(procs)
                del live[i]
                _say(f"replica {i} stopped ({', '.join(dead)}); {len(live)} left")
