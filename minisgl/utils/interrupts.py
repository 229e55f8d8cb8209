"""Ctrl-C at the end of a turn, not inside one. Under TP the offline LLM is rank 0: a
KeyboardInterrupt that cut its turn short (inside a collective, or between two) would leave the
other ranks in a collective it never joins, and its next turn's broadcast would meet their
all-reduce: every rank waits for good."""

import contextlib
import signal
import threading
from collections.abc import Iterator

_pending = threading.Event()


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
    signal.signal(signal.SIGINT, lambda signum, frame: _pending.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if _pending.is_set():
        raise KeyboardInterrupt


def interrupt_pending() -> bool:
    """A SIGINT came while interrupts are held: a wait that can end early should."""
    return _pending.is_set()
