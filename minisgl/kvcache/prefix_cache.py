from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any


class PrefixCache(ABC):
    """Maps token-id prefixes (whole pages only) to the KV pages that hold them.

    A `handle` names a cached prefix; a locked handle's pages cannot be evicted.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    @abstractmethod
    def match(self, ids: Sequence[int]) -> tuple[Any, list[int]]:
        """(handle, pages) of the longest cached page-aligned prefix of `ids` (not yet locked)."""

    @abstractmethod
    def insert(self, ids: Sequence[int], pages: list[int]) -> tuple[Any, list[int]]:
        """Cache `pages` (one per page of `ids`). Returns the handle of the whole prefix and the
        pages the cache did not take because it already holds that prefix (the caller owns them)."""

    @abstractmethod
    def lock(self, handle: Any) -> None: ...

    @abstractmethod
    def unlock(self, handle: Any) -> None: ...

    @abstractmethod
    def evict(self, num_pages: int) -> list[int]:
        """Drop least-recently-used unlocked prefixes; returns at least `num_pages` pages if it can."""

    @property
    @abstractmethod
    def num_evictable_pages(self) -> int: ...

    @property
    @abstractmethod
    def num_cached_pages(self) -> int: ...

    @abstractmethod
    def cached_pages(self) -> list[int]: ...

    @abstractmethod
    def check_integrity(self, held_handles: list[Any]) -> None:
        """Raise IntegrityError unless the cache's own structure is consistent and its lock counts
        are exactly those of `held_handles` (every handle some request holds locked)."""
