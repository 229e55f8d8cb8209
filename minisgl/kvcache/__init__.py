from .allocator import PageAllocator
from .manager import PREFIX_CACHES, KVCacheManager
from .pool import KVPool
from .prefix_cache import NaiveCache, PrefixCache
from .radix_cache import RadixCache

__all__ = [
    "PREFIX_CACHES",
    "KVCacheManager",
    "KVPool",
    "NaiveCache",
    "PageAllocator",
    "PrefixCache",
    "RadixCache",
]
