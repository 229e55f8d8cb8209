class PageAllocator:
    """The free list of KV pages. Pages are plain ints in [0, num_pages)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # reversed so that pop() hands out low page ids first (easier to read in a debugger)
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_pages(self) -> list[int]:
        return list(self._free)

    def alloc(self, n: int) -> list[int]:
        assert 0 <= n <= len(self._free), f"asked for {n} pages, {len(self._free)} free"
        start = len(self._free) - n  # not -n: a slice from -0 would be the whole list
        pages = self._free[start:]
        del self._free[start:]
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)
