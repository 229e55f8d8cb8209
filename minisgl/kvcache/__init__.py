"""The paged KV cache: the pool on the device (`pool`), and on the host the page allocator, the
prefix caches and the manager that decides each slot's pages (`manager`). The prefix cache is
chosen by name (`--cache`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.utils.registry import Registry

if TYPE_CHECKING:
    from .prefix_cache import PrefixCache


class IntegrityError(Exception):
    """The KV cache's accounting is inconsistent (a page lost, shared or double-counted)."""


def require(ok: bool, message: str) -> None:
    """An integrity check's condition: raises IntegrityError(message) unless ok."""
    if not ok:
        raise IntegrityError(message)


PREFIX_CACHES: Registry[PrefixCache] = Registry("prefix cache")
PREFIX_CACHES.register("radix", "minisgl.kvcache.radix_cache:RadixCache")
PREFIX_CACHES.register("naive", "minisgl.kvcache.radix_cache:NaiveCache")

__all__ = ["PREFIX_CACHES", "IntegrityError", "require"]
