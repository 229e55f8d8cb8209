import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from minisgl.utils.arrays import ragged_arange

from . import PREFIX_CACHES, require
from .allocator import PageAllocator


class KVCacheManager:
    """Which KV pages each request slot holds, and the page-table entries that say so.

    The page table ([slots + 1, table_width] on the device) maps a slot's token positions to pool
    locations. This class decides every entry; the entries assigned since the last step travel to
    the device with the step's batch (`take_page_writes`), in its one transfer.
    """

    def __init__(self, num_pages: int, page_size: int, table_width: int, cache: str) -> None:
        self.page_size = page_size
        self.table_width = table_width
        self.allocator = PageAllocator(num_pages)
        self.prefix_cache = PREFIX_CACHES.get(cache)(page_size)
        self._pages: dict[int, list[int]] = {}  # slot -> its pages, in position order
        self._handles: dict[int, Any] = {}  # slot -> locked prefix-cache handle
        self._shared: dict[int, int] = {}  # slot -> leading pages it got from the prefix cache
        # assigned since the last take_page_writes: (slot, index of the first page in the slot,
        # the pages)
        self._pending: list[tuple[int, int, list[int]]] = []
        # (slot, page index) -> the cached page: a slot's page that another slot published
        # first, to be replaced by the cached copy once the batch computing it has gone out
        self._moves: dict[tuple[int, int], int] = {}
        self._offsets = np.arange(page_size)  # a page's token offsets

    # ------------------------------------------------------------------ capacity
    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def available_pages(self) -> int:
        """Pages a new allocation can get: free ones plus evictable cached ones."""
        return self.allocator.num_free + self.prefix_cache.num_evictable_pages

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.allocator.num_free

    def pages_needed(self, slot: int, new_len: int) -> int:
        return max(0, -(-new_len // self.page_size) - len(self._pages.get(slot, ())))

    def capacity(self, slot: int) -> int:
        """The longest the slot's sequence can grow to with the pages it has and can get."""
        return (len(self._pages.get(slot, ())) + self.available_pages) * self.page_size

    # ------------------------------------------------------------------ request life cycle
    def admit(self, slot: int, ids: Sequence[int]) -> int:
        """Start a slot from the longest cached prefix of `ids`; returns its length in tokens."""
        assert slot not in self._pages
        handle, pages = self.prefix_cache.match(ids)
        self.prefix_cache.lock(handle)
        self._handles[slot] = handle
        self._shared[slot] = len(pages)
        self._pages[slot] = []
        self._assign(slot, pages)
        return len(pages) * self.page_size

    def reserve(self, slot: int, new_len: int) -> bool:
        """Make the slot's pages cover positions [0, new_len), evicting cached prefixes if needed.
        Allocates nothing and returns False when there are not enough pages."""
        return self.reserve_all([(slot, new_len)])

    def reserve_all(self, slot_lens: list[tuple[int, int]]) -> bool:
        """reserve() for many (slot, new_len) at once, all or nothing: the decode fast path."""
        needs = [(slot, self.pages_needed(slot, new_len)) for slot, new_len in slot_lens]
        total = sum(need for _, need in needs)
        if total > self.available_pages:
            return False
        short = total - self.allocator.num_free
        if short > 0:
            self.allocator.free(self.prefix_cache.evict(short))
        pages, start = self.allocator.alloc(total), 0
        for slot, need in needs:
            if need:
                self._assign(slot, pages[start : start + need])
                start += need
        return True

    def cache_prefix(self, slot: int, ids: Sequence[int]) -> None:
        """Publish the slot's whole pages of `ids` to the prefix cache as the batch that computes
        them is built (so later requests can share them). Pages that the cache holds already
        (requests with one prompt computed together: a request's n choices) are moved to the
        cached copy by the next `move_duplicates`: until this batch has gone out, its own copy
        is the one it writes."""
        num = len(ids) // self.page_size
        prefix = ids[: num * self.page_size]
        handle, duplicates = self.prefix_cache.insert(prefix, self._pages[slot][:num])
        self.prefix_cache.lock(handle)
        self.prefix_cache.unlock(self._handles[slot])
        self._handles[slot] = handle
        if duplicates:
            _, cached = self.prefix_cache.match(prefix)  # locked by the handle until release
            own = self._pages[slot]
            self._moves |= {(slot, i): page for i, page in enumerate(cached) if own[i] != page}

    def move_duplicates(self) -> None:
        """Before a step's first allocation: each slot's pages that `cache_prefix` found cached
        already now point at the cached copy (the same KV), and its own copy is free. Its old
        entries were read by batches already launched; a later one that reuses the page runs
        after them."""
        own: list[int] = []
        runs: list[tuple[int, int, list[int]]] = []
        for (slot, i), page in self._moves.items():  # a slot's in ascending order
            own.append(self._pages[slot][i])
            self._pages[slot][i] = page
            if runs and runs[-1][0] == slot and runs[-1][1] + len(runs[-1][2]) == i:
                runs[-1][2].append(page)  # the next page of the run
            else:
                runs.append((slot, i, [page]))
        # one call and a run per stretch: a long prompt at page size 1 moves thousands of pages
        self.allocator.free(own)
        self._pending += runs
        self._moves = {}

    def release(self, slot: int, ids: Sequence[int]) -> None:
        """Give up every page of the slot; whole pages of `ids` (tokens with computed KV) stay in
        the prefix cache for later requests."""
        num = len(ids) // self.page_size
        require(num >= self._shared[slot], "ids must cover the prefix the slot got from the cache")
        pages = self._pages.pop(slot)
        del self._shared[slot]
        _, duplicates = self.prefix_cache.insert(ids[: num * self.page_size], pages[:num])
        self.prefix_cache.unlock(self._handles.pop(slot))
        self.allocator.free(duplicates + pages[num:])
        # entries not yet written are void, and the slot's next owner assigns the same positions
        self._pending = [run for run in self._pending if run[0] != slot]
        self._moves = {key: page for key, page in self._moves.items() if key[0] != slot}

    def flush_prefix_cache(self) -> None:
        """Evict every cached page no live request holds."""
        self.allocator.free(self.prefix_cache.evict(self.prefix_cache.num_evictable_pages))

    def _assign(self, slot: int, pages: list[int]) -> None:
        """Append pages to the slot; their page-table entries go out with the next batch."""
        self._pending.append((slot, len(self._pages[slot]), pages))
        self._pages[slot] += pages

    def take_page_writes(self) -> tuple[np.ndarray, np.ndarray]:
        """The page-table writes for every page assigned since the last call: (flat entry of
        the [slots + 1, table_width] table, pool location), int64 arrays. No entry appears twice:
        a slot only grows until it is released, which drops its pending entries, and a move
        rewrites only entries that an earlier batch took."""
        runs, self._pending = self._pending, []
        ps, width = self.page_size, self.table_width
        # a run's pages cover consecutive positions of one row: a range of the flattened table
        starts = [slot * width + first * ps for slot, first, _ in runs]
        entries = ragged_arange(starts, [len(pages) * ps for _, _, pages in runs])
        all_pages = list(itertools.chain.from_iterable(pages for _, _, pages in runs))
        locs = np.array(all_pages, dtype=np.int64)[:, None] * ps + self._offsets
        return entries, locs.ravel()

    # ------------------------------------------------------------------ checks
    def check_idle_counts(self) -> None:
        """With no slot live: raise IntegrityError unless every page is free or cached and no
        cached page is locked. check_integrity's totals alone, in constant time: the whole check
        walks every cached page (~0.1 ms per thousand on a 2-core CPU)."""
        require(not self._pages, "a slot is live: only check_integrity applies")
        num_free, cached = self.allocator.num_free, self.prefix_cache.num_cached_pages
        require(
            num_free + cached == self.num_pages,
            f"free {num_free} + cached {cached} != {self.num_pages} with no request running",
        )
        require(
            self.prefix_cache.num_evictable_pages == cached,
            "a cached page is locked with no request running",
        )

    def check_integrity(self) -> None:
        """Raise IntegrityError unless every page is exactly one of: free, cached, or held
        privately by one slot, and the prefix cache's locks are exactly the slots' handles.
        Read from the allocator's bitmap of free pages: a pool of a million pages is checked in
        well under a millisecond, between steps."""
        is_free = self.allocator.is_free()
        cached = np.array(self.prefix_cache.cached_pages(), dtype=np.int64)
        held = np.fromiter(itertools.chain.from_iterable(self._pages.values()), np.int64)
        private = held[~np.isin(held, cached)]
        num_free = self.allocator.num_free
        # free more often than once: the free stack holds more entries than the bitmap marks
        require(np.count_nonzero(is_free) == num_free, "a page is free twice")
        require(not is_free[cached].any(), "a page is both free and cached")
        require(not is_free[private].any(), "a page is both free and in use")
        require(np.unique(private).size == private.size, "a page is held by two slots")
        require(
            num_free + len(cached) + len(private) == self.num_pages,
            f"free {num_free} + cached {len(cached)} + in use {len(private)} != {self.num_pages}",
        )
        require(self.prefix_cache.num_cached_pages == len(cached), "the cached-page count is off")
        self.prefix_cache.check_integrity(list(self._handles.values()))
