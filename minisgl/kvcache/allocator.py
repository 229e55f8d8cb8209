import numpy as np

from . import require


class PageAllocator:
    """The free list of KV pages. Pages are plain ints in [0, num_pages).

    A stack in a numpy array: the integrity check reads it as an array without a copy (a Python
    list of a million pages took ~30 ms to convert, twice per idle moment of the scheduler)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # reversed so that alloc hands out low page ids first (easier to read in a debugger)
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._num_free = num_pages  # the free pages are _stack[:_num_free]

    @property
    def num_free(self) -> int:
        return self._num_free

    def free_pages(self) -> np.ndarray:
        """The free pages: a read-only view, valid until the next alloc or free."""
        view = self._stack[: self._num_free]
        view.flags.writeable = False
        return view

    def alloc(self, n: int) -> list[int]:
        assert 0 <= n <= self._num_free, f"asked for {n} pages, {self._num_free} free"
        self._num_free -= n
        return self._stack[self._num_free : self._num_free + n].tolist()

    def free(self, pages: list[int]) -> None:
        end = self._num_free + len(pages)
        require(end <= self.num_pages, f"{end} pages free, more than the pool's {self.num_pages}")
        self._stack[self._num_free : end] = pages
        self._num_free = end
