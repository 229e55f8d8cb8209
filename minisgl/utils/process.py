"""How every child process of minisgl starts: the server's (one per scheduler rank, the tokenizer,
the API server) and the offline LLM's (one per TP rank past 0); where the TP ranks of one machine
meet."""

import ctypes
import importlib
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

from minisgl.config import ConfigError

_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


def start_child(
    name: str, target: str, *args: Any, setup: Callable[[], None] | None = None
) -> BaseProcess:
    """A new process (spawned: it may use CUDA) running `target` ("module:function") on `args`,
    after `setup()` (where it runs: a --dp replica's devices and cores) if given."""
    proc = multiprocessing.get_context("spawn").Process(
        target=_child_main, args=(name, os.getpid(), setup, target, *args), name=name, daemon=True
    )
    proc.start()
    return proc


def stop_on_sigterm() -> None:
    """For a child that drains on SIGTERM (the API server, the router), which start_child's
    ignore: the default again, until it installs its own handler."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def local_init_method() -> str:
    """A torch.distributed init URL for ranks on this machine, at a port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _child_main(
    name: str, parent: int, setup: Callable[[], None] | None, target: str, *args: Any
) -> None:
    """Every child: named `name` in `ps` and /proc (comm), ignoring the terminal's Ctrl-C and
    hang-up and a SIGTERM sent to the whole process group, as systemd's stop sends it (its
    parent stops it, after the API server has drained; an entry point that drains takes SIGTERM
    back), dying with its parent even if that is killed outright; then the entry point `target`.
    A bad setting only the child can find (ConfigError) ends it with one line; an error in any
    of its threads ends it."""
    if setup is not None:
        setup()
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    if sys.platform == "linux":
        libc = ctypes.CDLL(None)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        libc.prctl(_PR_SET_NAME, name.encode()[:15])
        if os.getppid() != parent:  # the parent died before the line above took effect
            os._exit(1)
    threading.excepthook = _exit_on_thread_error  # a dead thread must not leave a live process
    module, _, function = target.partition(":")
    try:
        getattr(importlib.import_module(module), function)(*args)
    except ConfigError as e:
        print(f"minisgl: {name}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


def exit_now(code: int) -> None:
    """Ends this process with `code` once its logs and output are written, without the
    interpreter's teardown: where a TP rank's gloo groups lived, that teardown aborted (SIGABRT) 3
    of 20 exits of a scratch repro, and one CI run even after the groups were destroyed."""
    try:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:  # a closed or broken stdout must not keep the process alive
        os._exit(code)


def _exit_on_thread_error(args: threading.ExceptHookArgs) -> None:
    traceback.print_exception(args.exc_type, args.exc_value, args.exc_traceback)
    exit_now(1)
