import numpy as np

from . import require


class PageAllocator:
    """The free list of KV pages. Pages are plain ints in [0, num_pages).

    A stack in a numpy array, and a bitmap of which pages are free, kept with it: a page freed
    twice (again, or twice in one call) fails at once, and the integrity check reads the bitmap
    as it is (building it from the stack, ~1M pages on an H200, took 2-7 ms, twice per prefill
    of prefill.py's timed run)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # reversed so that alloc hands out low page ids first (easier to read in a debugger)
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._num_free = num_pages  # the free pages are _stack[:_num_free]
        self._is_free = np.ones(num_pages, dtype=bool)
        self._last_seen = np.zeros(num_pages, dtype=np.int32)  # free's scratch, see there

    @property
    def num_free(self) -> int:
        return self._num_free

    def is_free(self) -> np.ndarray:
        """[num_pages] bool, True where a page is free: a read-only view, live."""
        view = self._is_free[:]
        view.flags.writeable = False
        return view

    def alloc(self, n: int) -> list[int]:
        assert 0 <= n <= self._num_free, f"asked for {n} pages, {self._num_free} free"
        self._num_free -= n
        pages = self._stack[self._num_free : self._num_free + n]
        self._is_free[pages] = False
        return pages.tolist()

    def free(self, pages: list[int]) -> None:
        end = self._num_free + len(pages)
        require(end <= self.num_pages, f"{end} pages free, more than the pool's {self.num_pages}")
        freed = np.asarray(pages, dtype=np.int64)
        require(not self._is_free[freed].any(), "a page is freed twice")
        # a page listed twice keeps one of its positions, so the other reads back unequal: O(n),
        # where np.unique took 0.6 ms for 8k pages
        order = np.arange(len(freed), dtype=np.int32)
        self._last_seen[freed] = order
        require(np.array_equal(self._last_seen[freed], order), "a page is freed twice")
        self._stack[self._num_free : end] = freed
        self._is_free[freed] = True
        self._num_free = end
