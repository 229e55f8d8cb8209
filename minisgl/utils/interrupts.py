"""Ctrl-C at the end of a turn, not inside one. A KeyboardInterrupt inside the scheduler's
bookkeeping would leave it half done (a slot given its prefix but no pages: every later generate
failed). Under TP the offline LLM is rank 0, and one that cut its turn short (inside a
collective, or between two) would leave the other ranks in a collective it never joins, and its
next turn's broadcast would meet their all-reduce: every rank waits for good. On one rank the
model's forward, the long part of a turn, may still be cut (`interruptible`)."""

import contextlib
import signal
import threading
from collections.abc import Iterator

_pending = threading.Event()


def _hold(signum: int, frame: object) -> None:
    _pending.set()


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT while the block runs, then raise KeyboardInterrupt if one came. Only where
    Python's own handler is installed (in the main thread): any other is left as it is."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    _pending.clear()
    signal.signal(signal.SIGINT, _hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if _pending.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Inside deferred_interrupts: SIGINT raises at once in this block, and one held from before
    raises as it starts; for work that leaves nothing half done where it is cut. Elsewhere:
    nothing changes."""
    holding = signal.getsignal(signal.SIGINT) is _hold  # inside deferred_interrupts
    if not holding or threading.current_thread() is not threading.main_thread():
        yield
        return
    if _pending.is_set():
        _pending.clear()
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, _hold)


def interrupt_pending() -> bool:
    """A SIGINT came while interrupts are held: a wait that can end early should."""
    return _pending.is_set()
