"""The radix prefix cache and the KV cache manager's accounting."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl import LLM, SamplingParams
from minisgl.kvcache import IntegrityError
from minisgl.kvcache.manager import KVCacheManager
from minisgl.kvcache.radix_cache import RadixCache
from minisgl.messages import AddRequests
from minisgl.scheduler.worker import FULL_CHECK_MAX_PAGES, SchedulerWorker

from .conftest import DEVICE


def test_match_returns_only_whole_cached_pages() -> None:
    cache = RadixCache(page_size=2)
    _node, dup = cache.insert([1, 2, 3, 4], [10, 11])
    assert dup == []
    assert cache.match([1, 2, 3, 4, 5])[1] == [10, 11]
    assert cache.match([1, 2, 3])[1] == [10]  # the half page [3] is not a whole page
    assert cache.match([1, 9])[1] == []


def test_insert_splits_and_reports_duplicates() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [10, 11, 12])
    _, dup = cache.insert([1, 2, 4], [20, 21, 22])  # [1, 2] is already cached as 10, 11
    assert dup == [20, 21]
    assert cache.match([1, 2, 4])[1] == [10, 11, 22]
    assert cache.match([1, 2, 3])[1] == [10, 11, 12]
    assert sorted(cache.cached_pages()) == [10, 11, 12, 22]
    cache.check_integrity([])


def test_locked_prefixes_survive_eviction_and_lru_goes_first() -> None:
    cache = RadixCache(page_size=1)
    old, _ = cache.insert([1, 2], [10, 11])
    new, _ = cache.insert([5, 6], [50, 51])
    cache.match([5, 6])  # touch: [5, 6] is now the most recently used
    assert sorted(cache.evict(2)) == [10, 11]
    cache.lock(new)
    assert cache.num_evictable_pages == 0
    assert cache.evict(5) == []
    cache.check_integrity([new])
    cache.unlock(new)
    assert sorted(cache.evict(5)) == [50, 51]
    assert old is not None and cache.cached_pages() == []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["insert", "match", "lock", "unlock", "evict"]),
            st.lists(st.integers(0, 2), min_size=1, max_size=6),  # few ids: shared prefixes
        ),
        max_size=40,
    )
)
def test_eviction_takes_the_least_recently_used_leaf_without_a_walk(ops) -> None:
    """The heap of evictable leaves against a walk of the tree: each page evicted lies in an
    unlocked leaf of the oldest last use, and every evictable page can be evicted."""
    cache, locked, next_page = RadixCache(page_size=1), [], 0
    for op, ids in ops:
        if op == "insert":
            cache.insert(ids, list(range(next_page, next_page + len(ids))))
            next_page += len(ids)
        elif op == "match":
            cache.match(ids)
        elif op == "lock":
            handle, _ = cache.match(ids)
            cache.lock(handle)
            locked.append(handle)
        elif op == "unlock" and locked:
            cache.unlock(locked.pop(0))
        elif op == "evict":
            leaves = [n for n in cache._nodes() if not n.children and n.lock_ref == 0]
            oldest = min((n.last_access for n in leaves), default=None)
            freed = cache.evict(1)
            assert len(freed) == min(1, len(leaves))
            if freed:
                assert any(n.pages[-1] == freed[0] and n.last_access == oldest for n in leaves)
        cache.check_integrity(locked)
    evictable = cache.num_evictable_pages
    assert len(cache.evict(evictable + 1)) == evictable and cache.num_evictable_pages == 0


def test_integrity_check_detects_a_lock_nobody_holds() -> None:
    cache = RadixCache(page_size=1)
    node, _ = cache.insert([1, 2], [10, 11])
    cache.lock(node)
    with pytest.raises(IntegrityError, match="lock count"):
        cache.check_integrity([])


def make_manager(num_pages: int = 8, page_size: int = 2, cache: str = "radix") -> KVCacheManager:
    return KVCacheManager(num_pages, page_size, 32, cache)


def test_manager_hands_out_each_assigned_page_table_entry_once() -> None:
    kv = make_manager()
    kv.admit(1, [])
    assert kv.reserve(1, 5)  # 3 pages of 2
    entries, locs = kv.take_page_writes()
    assert entries.tolist() == [32 + i for i in range(6)]  # row 1, positions 0-5
    pages = [loc // 2 for loc in locs.tolist()]
    assert [loc % 2 for loc in locs.tolist()] == [0, 1] * 3 and len(set(pages)) == 3
    assert kv.reserve(1, 7)  # one more page, at positions 6-7
    entries, new_locs = kv.take_page_writes()
    assert entries.tolist() == [38, 39] and not set(new_locs.tolist()) & set(locs.tolist())
    assert all(len(a) == 0 for a in kv.take_page_writes())
    kv.check_integrity()


def test_a_released_slot_leaves_no_pending_page_table_write() -> None:
    # a slot given up before its entries went out is reused: only the new owner's entries count,
    # so the table never gets two writes to one entry in a step
    kv = make_manager()
    kv.admit(2, [])
    assert kv.reserve(2, 4)
    kv.release(2, [])
    kv.admit(2, [])
    assert kv.reserve(2, 2)
    entries, locs = kv.take_page_writes()
    assert entries.tolist() == [64, 65] and locs.tolist() == [
        kv._pages[2][0] * 2 + i for i in (0, 1)
    ]


def test_released_prefix_is_reused_and_accounting_holds() -> None:
    kv = make_manager()
    ids = [1, 2, 3, 4, 5]
    kv.admit(0, ids[:4])
    assert kv.reserve(0, 5)
    kv.release(0, ids)  # pages of [1,2] and [3,4] go to the cache, the half page is freed
    kv.check_integrity()
    assert len(kv.prefix_cache.cached_pages()) == 2 and kv.allocator.num_free == 6
    assert kv.admit(1, ids[:4]) == 4
    kv.check_integrity()
    assert kv.prefix_cache.num_evictable_pages == 0  # locked by slot 1
    assert not kv.reserve(1, 4 + 2 * 7)  # 7 more pages: only 6 are free
    assert kv.reserve(1, 4 + 2 * 6)
    with pytest.raises(IntegrityError, match="cover the prefix"):
        kv.release(1, [])  # the slot's first two pages belong to the cache: it must say which
    kv.check_integrity()  # and the failed release changed nothing
    kv.release(1, ids[:4])
    assert kv.allocator.num_free == 6 and len(kv.prefix_cache.cached_pages()) == 2


def test_release_after_reuse_frees_only_private_pages() -> None:
    kv = make_manager()
    ids = list(range(10))
    kv.admit(0, [])
    kv.reserve(0, 4)
    kv.release(0, ids[:4])
    assert kv.admit(1, ids[:4]) == 4
    kv.reserve(1, 9)
    kv.release(1, ids[:9])
    kv.check_integrity()
    assert len(kv.prefix_cache.cached_pages()) == 4 and kv.allocator.num_free == 4


def test_a_prompt_computed_twice_in_one_step_is_held_once_from_the_next() -> None:
    """Two slots compute one prompt in one batch: the second to publish it keeps its own pages
    until the next step, then moves to the cached copy and frees its own."""
    kv = make_manager()
    ids = [1, 2, 3, 4, 5]
    for slot in (0, 1):
        kv.admit(slot, [])
        assert kv.reserve(slot, 5)  # 3 pages each
    kv.take_page_writes()
    for slot in (0, 1):
        kv.cache_prefix(slot, ids)  # as the batch is built: two whole pages each
    first, second = list(kv._pages[0]), list(kv._pages[1])
    assert not set(first) & set(second) and kv.allocator.num_free == 2
    kv.check_integrity()
    kv.move_duplicates()
    assert kv._pages[1] == first[:2] + second[2:] and kv.allocator.num_free == 4
    entries, locs = kv.take_page_writes()  # the second slot's row points at the cached pages
    assert entries.tolist() == [32, 33, 34, 35]
    assert [loc // 2 for loc in locs.tolist()] == [first[0]] * 2 + [first[1]] * 2
    kv.check_integrity()
    for slot in (0, 1):
        kv.release(slot, ids)
    kv.check_idle_counts()
    assert kv.allocator.num_free == 6 and len(kv.prefix_cache.cached_pages()) == 2


def test_a_slot_released_before_the_move_frees_its_own_copy() -> None:
    kv = make_manager()
    ids = [1, 2, 3, 4]
    for slot in (0, 1):
        kv.admit(slot, [])
        assert kv.reserve(slot, 4)
        kv.cache_prefix(slot, ids)
    kv.release(1, ids)  # preempted or ended before the next step: its moves are void
    kv.move_duplicates()
    kv.check_integrity()
    kv.release(0, ids)
    kv.check_idle_counts()
    assert kv.allocator.num_free == 6


@pytest.mark.parametrize("overlap", [False, True])
def test_two_requests_with_one_prompt_fit_a_pool_of_one_copy(overlap: bool) -> None:
    """8 pages of 16: a 48-token prompt twice in one step, the second request growing to 118
    tokens. It had been preempted once: the first's copy of the prompt stayed locked beside
    its own until it ended."""
    llm = LLM(
        device=DEVICE, dtype="float32", max_kv_tokens=128, page_size=16, max_model_len=128,
        overlap=overlap,
    )  # fmt: skip
    prompt = list(range(1, 49))
    short, long = (SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 70))
    both = llm.generate([prompt, prompt], [short, long], use_tqdm=False)
    assert llm.scheduler.stats.num_preemptions == 0
    llm.scheduler.check_integrity()
    alone = llm.generate([prompt], long, use_tqdm=False)
    assert both[1]["token_ids"] == alone[0]["token_ids"]
    llm.scheduler.kv.flush_prefix_cache()
    llm.scheduler.kv.check_idle_counts()
    assert llm.scheduler.kv.allocator.num_free == 8


def test_reserve_evicts_unlocked_prefixes_when_short() -> None:
    kv = make_manager(num_pages=4)
    kv.admit(0, [])
    kv.reserve(0, 8)
    kv.release(0, list(range(8)))  # 4 pages cached, none free
    assert kv.allocator.num_free == 0 and kv.available_pages == 4
    kv.admit(1, [])
    assert kv.reserve(1, 6)
    assert kv.allocator.num_free == 0 and len(kv.prefix_cache.cached_pages()) == 1
    kv.check_integrity()


def test_integrity_check_detects_a_page_freed_while_in_use() -> None:
    kv = make_manager()
    kv.admit(0, [])
    kv.reserve(0, 2)
    kv.allocator.free(list(kv._pages[0]))  # a bug that frees a page still in use
    with pytest.raises(IntegrityError, match="both free and in use"):
        kv.check_integrity()


def test_a_page_freed_twice_fails_at_once_and_changes_nothing() -> None:
    kv = make_manager()
    kv.admit(0, [])
    kv.reserve(0, 8)  # 4 of the 8 pages
    free_page = int(np.flatnonzero(kv.allocator.is_free())[0])
    free_before = kv.allocator.num_free
    with pytest.raises(IntegrityError, match="freed twice"):
        kv.allocator.free([free_page])
    assert kv.allocator.num_free == free_before
    kv.check_integrity()
    held = kv._pages[0][0]
    with pytest.raises(IntegrityError, match="freed twice"):
        kv.allocator.free([held, kv._pages[0][1], held])  # twice in one call
    assert kv.allocator.num_free == free_before
    kv.check_integrity()


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["admit", "grow", "cache", "move", "release", "flush"]),
            st.integers(0, 3),  # the slot
            st.lists(st.integers(0, 2), min_size=1, max_size=10),  # few ids: shared prefixes
        ),
        max_size=40,
    )
)
def test_any_sequence_of_slot_operations_keeps_the_accounting(ops) -> None:
    """Four slots over 16 pages of 2: prefix hits, duplicate inserts and the moves to the
    cached copy, evictions under pressure and refused reservations; after every operation each page is exactly one of free, cached or
    held (a page freed twice would raise at once), and at the end nothing has leaked."""
    kv = make_manager(num_pages=16)
    computed: dict[int, list[int]] = {}  # slot -> the ids its pages cover
    for op, slot, ids in ops:
        if op == "admit" and slot not in computed:
            shared = kv.admit(slot, ids)
            if kv.reserve(slot, len(ids)):
                computed[slot] = list(ids)
            else:  # as the scheduler does with a request it cannot start
                kv.release(slot, ids[:shared])
        elif op == "grow" and slot in computed and kv.reserve(slot, len(computed[slot] + ids)):
            computed[slot] += ids
        elif op == "cache" and slot in computed:
            kv.cache_prefix(slot, computed[slot])
        elif op == "move":
            kv.move_duplicates()
        elif op == "release" and slot in computed:
            kv.release(slot, computed.pop(slot))
        elif op == "flush":
            kv.flush_prefix_cache()
        kv.check_integrity()
        entries, _ = kv.take_page_writes()  # as each batch takes them: one write an entry
        assert np.unique(entries).size == entries.size
    for slot in list(computed):
        kv.release(slot, computed.pop(slot))
    kv.flush_prefix_cache()  # nothing leaked: every page free again
    assert kv.allocator.num_free == kv.num_pages
    kv.check_integrity()


def test_idle_counts_catch_a_leaked_page_and_a_locked_one() -> None:
    kv = make_manager()
    kv.admit(0, [])
    kv.reserve(0, 8)
    with pytest.raises(IntegrityError, match="a slot is live"):
        kv.check_idle_counts()
    kv.release(0, list(range(6)))  # 3 pages cached, the 4th freed
    kv.check_idle_counts()
    kv.check_integrity()
    node, _ = kv.prefix_cache.match(list(range(6)))
    kv.prefix_cache.lock(node)  # a handle nobody holds any more
    with pytest.raises(IntegrityError, match="locked with no request running"):
        kv.check_idle_counts()
    kv.prefix_cache.unlock(node)
    kv.allocator.alloc(1)  # a page taken and never given to a slot
    with pytest.raises(IntegrityError, match=r"free 4 \+ cached 3 != 8"):
        kv.check_idle_counts()


def test_an_idle_scheduler_over_a_large_pool_checks_the_totals() -> None:
    big = LLM(device=DEVICE, dtype="float32", max_kv_tokens=FULL_CHECK_MAX_PAGES + 1024)
    worker = SchedulerWorker(big.scheduler, 0, None)
    params = SamplingParams(temperature=0, max_tokens=4)
    worker.step([AddRequests([[5, 6, 7]], [[0]], [[params]])])
    while worker.scheduler.has_work:
        worker.step([])
    assert worker.integrity_checks >= 1 and worker.integrity_failures == 0
    big.scheduler.kv.allocator.alloc(1)  # a leak
    worker.step([])
    assert worker.integrity_failures == 1
