"""KV-cache pages: which are free, and how many holders each used page has.

Page 0 is the reserved dummy page that padding rows write to; it is never handed out, so a cache of
`num_pages` pages has `num_pages - 1` usable ones. Each used page has a reference count, so that a
page can later be shared by several requests (a common prefix): `share` adds a holder, `free` drops
one, and a page returns to the free list when its last holder lets go.

Invariants (asserted by `check`): every usable page is either free with no holders or used with at
least one; free + used == total. Allocation is all or nothing. Freeing a free page, or page 0, is a
bug and fails an assert.

This module is plain Python; it must not import jax or anything from meshserve's other packages.
"""

from __future__ import annotations

import collections
from typing import Iterable

DUMMY_PAGE = 0


def num_pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


class PageAllocator:
    def __init__(self, num_pages: int):
        assert num_pages >= 2, "page 0 is the dummy: a cache needs at least 2 pages"
        self._free: collections.deque[int] = collections.deque(range(1, num_pages))
        self._refs = [0] * num_pages
        self.num_peak_used = 0  # the most pages ever in use at once

    @property
    def num_total(self) -> int:
        """Usable pages (all but the dummy)."""
        return len(self._refs) - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_total - self.num_free

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free

    def allocate(self, num_pages: int) -> list[int] | None:
        """`num_pages` fresh pages, or None (and nothing taken) when fewer are free."""
        assert num_pages >= 0, num_pages
        if not self.can_allocate(num_pages):
            return None
        pages = [self._free.popleft() for _ in range(num_pages)]
        for page in pages:
            self._refs[page] = 1
        self.num_peak_used = max(self.num_peak_used, self.num_used)
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """Adds a holder to each of `pages`, which must be in use."""
        for page in pages:
            assert page != DUMMY_PAGE and self._refs[page] > 0, f"page {page} is not in use"
            self._refs[page] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drops a holder from each of `pages`; a page with no holders left becomes free."""
        for page in pages:
            assert page != DUMMY_PAGE, "page 0 is the dummy page and is never freed"
            assert self._refs[page] > 0, f"page {page} is already free"
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)

    def ref_count(self, page: int) -> int:
        return self._refs[page]

    def check(self) -> None:
        """Asserts the allocator's invariants; cheap enough to call after every step in tests."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert DUMMY_PAGE not in free and self._refs[DUMMY_PAGE] == 0
        assert all(self._refs[p] == 0 for p in free), "a free page has holders"
        used = [p for p in range(1, len(self._refs)) if self._refs[p] > 0]
        assert all(self._refs[p] >= 0 for p in range(len(self._refs)))
        assert len(used) + len(free) == self.num_total, (len(used), len(free), self.num_total)
