"""KV-cache pages: which are free, which are cached, and how many holders each used page has.

Page 0 is the reserved dummy page that padding rows write to; it is never handed out, so a cache of
`num_pages` pages has `num_pages - 1` usable ones. Every usable page is in exactly one state:
  * free: no holders, no content worth keeping; on the free list;
  * used: one or more holders (requests). `share` adds a holder, `free` drops one;
  * cached: no holders, but it holds a full page registered in the prefix cache
    (`batching/prefix_cache.py`), so a later request with the same prefix can take it back
    (`share`). Cached pages are evictable: when no free page is left, `allocate` evicts the least
    recently used one.

Invariants (asserted by `check`): free + used + cached == total; a free page has no holders and no
key, a cached page has no holders and a key, a used page has holders. Allocation is all or
nothing. Freeing a page with no holders, or page 0, is a bug and fails an assert.

This module is plain Python; it must not import jax or anything from meshserve's other packages.
"""

from __future__ import annotations

import collections
from typing import Iterable, Sequence

from meshserve.batching.prefix_cache import PrefixCache

DUMMY_PAGE = 0


def num_pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


class PageAllocator:
    def __init__(self, num_pages: int):
        assert num_pages >= 2, "page 0 is the dummy: a cache needs at least 2 pages"
        self._free: collections.deque[int] = collections.deque(range(1, num_pages))
        self._refs = [0] * num_pages
        self._cache = PrefixCache()
        self.num_peak_used = 0  # the most pages ever in use at once
        self.num_evictions = 0  # cached pages reused for new content

    @property
    def num_total(self) -> int:
        """Usable pages (all but the dummy)."""
        return len(self._refs) - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Pages with no holder that keep a reusable prefix page; evictable."""
        return self._cache.num_evictable

    @property
    def num_used(self) -> int:
        return self.num_total - self.num_free - self.num_cached

    @property
    def num_available(self) -> int:
        """Pages an allocation can take: the free ones, then cached ones by eviction."""
        return self.num_free + self.num_cached

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_available

    def allocate(self, num_pages: int) -> list[int] | None:
        """`num_pages` pages for new content, or None (and nothing taken) when fewer are
        available. Free pages go first; then the least recently used cached pages are evicted."""
        assert num_pages >= 0, num_pages
        if not self.can_allocate(num_pages):
            return None
        pages = [self._take_page() for _ in range(num_pages)]
        for page in pages:
            self._refs[page] = 1
        self.num_peak_used = max(self.num_peak_used, self.num_used)
        return pages

    def _take_page(self) -> int:
        if self._free:
            return self._free.popleft()
        self.num_evictions += 1
        return self._cache.evict()

    def share(self, pages: Iterable[int]) -> None:
        """Adds a holder to each of `pages`, which must be used or cached (a cache hit)."""
        for page in pages:
            assert page != DUMMY_PAGE, "page 0 is the dummy page and is never shared"
            if self._cache.is_evictable(page):
                self._cache.reclaim(page)
            else:
                assert self._refs[page] > 0, f"page {page} is not in use"
            self._refs[page] += 1
        self.num_peak_used = max(self.num_peak_used, self.num_used)

    def free(self, pages: Iterable[int]) -> None:
        """Drops a holder from each of `pages`, in order. A page with no holders left is cached
        if it holds a registered prefix page (most recently used last), else free."""
        for page in pages:
            assert page != DUMMY_PAGE, "page 0 is the dummy page and is never freed"
            assert self._refs[page] > 0, f"page {page} is already free"
            self._refs[page] -= 1
            if self._refs[page] > 0:
                continue
            if self._cache.is_registered(page):
                self._cache.release(page)
            else:
                self._free.append(page)

    def ref_count(self, page: int) -> int:
        return self._refs[page]

    def is_free(self, page: int) -> bool:
        """Whether the page is free: no holders and nothing cached in it."""
        return self._refs[page] == 0 and not self._cache.is_evictable(page)

    # The prefix cache.

    def register(self, page: int, key: bytes) -> None:
        """Keys a held, full, computed page in the prefix cache (see `PrefixCache.register`)."""
        assert self._refs[page] > 0, f"page {page} has no holder"
        self._cache.register(page, key)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest prefix of `keys`; nothing is held or touched."""
        return self._cache.lookup(keys)

    def forget_prefixes(self) -> None:
        """Drops the whole prefix cache, when the pages' contents can no longer be trusted (an
        engine sharing the device cache wrote them). Cached pages become free."""
        self._free.extend(self._cache.clear())

    def num_cached_among(self, pages: Iterable[int]) -> int:
        """How many of `pages` are cached (holding them takes them out of the available ones)."""
        return sum(self._cache.is_evictable(page) for page in pages)

    def check(self) -> None:
        """Asserts the allocator's invariants; cheap enough to call after every step in tests."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert DUMMY_PAGE not in free and self._refs[DUMMY_PAGE] == 0
        assert all(self._refs[p] == 0 for p in free), "a free page has holders"
        assert not any(self._cache.is_registered(p) for p in free), "a free page has a key"
        pages = range(1, len(self._refs))
        cached = [p for p in pages if self._cache.is_evictable(p)]
        assert all(self._refs[p] == 0 for p in cached), "a cached page has holders"
        used = [p for p in pages if self._refs[p] > 0]
        assert all(self._refs[p] >= 0 for p in range(len(self._refs)))
        assert len(used) + len(free) + len(cached) == self.num_total, (
            len(used), len(free), len(cached), self.num_total)
        self._cache.check()
