"""The prefix cache: full KV pages found again by a chained hash of their tokens.

Page i of a sequence is keyed by `page_hash(key of page i - 1, its page_size token ids)`, so a key
names the whole prefix up to the end of its page: the same tokens after a different prefix get a
different key, and a lookup that walks a prompt's keys from the start finds exactly the pages whose
whole prefix matches. The hash is SHA-256, so two prefixes never share KV by a hash collision.
The chain starts from the root key of the request's LoRA adapter (`root_key`): the same tokens
under another adapter have other KV, so they get other keys.

Only full, computed pages are registered. New tokens always go to a request's own later pages,
so a shared page is never written again.

A registered page is in one of two states, and the allocator (`PageAllocator`) keeps the counts:
  * held by one or more requests (it is "used");
  * held by nobody, but still cached: "evictable". Evictable pages sit in least-recently-released
    order and are the first to be reused when no free page is left (LRU eviction).

This module is plain Python; it must not import jax or anything from meshserve's other packages.
"""

from __future__ import annotations

import array
import collections
import hashlib
from typing import Sequence

ROOT_HASH = b""  # the parent key of a sequence's first page


def root_key(adapter_id: int) -> bytes:
    """The parent key of the first page of a sequence run with LoRA adapter `adapter_id` (0: the
    base model, whose root is `ROOT_HASH`)."""
    if adapter_id == 0:
        return ROOT_HASH
    return hashlib.sha256(b"lora-adapter" + array.array("q", [adapter_id]).tobytes()).digest()


def page_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of a full page: its parent page's key and its own token ids."""
    return hashlib.sha256(parent + array.array("q", token_ids).tobytes()).digest()


class PrefixCache:
    """Which page holds each registered key, and the evictable pages in LRU order."""

    def __init__(self):
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_registered(self, page: int) -> bool:
        return page in self._key_of

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def register(self, page: int, key: bytes) -> None:
        """Keys a full, computed, held page. A key already held by another page keeps that page
        (two requests computed the same prefix at once); this one then stays private."""
        if key in self._page_of or page in self._key_of:
            return
        self._page_of[key] = page
        self._key_of[page] = key

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of the longest prefix of `keys` that is cached."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def release(self, page: int) -> None:
        """Its last holder let go: the page becomes evictable, most recently used."""
        assert page in self._key_of and page not in self._evictable, page
        self._evictable[page] = None

    def reclaim(self, page: int) -> None:
        """An evictable page gets a holder again (a cache hit)."""
        del self._evictable[page]

    def evict(self) -> int:
        """Forgets the least recently used evictable page and returns it."""
        page, _ = self._evictable.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        return page

    def clear(self) -> list[int]:
        """Forgets every key; returns the pages that were evictable (now holding nothing)."""
        pages = list(self._evictable)
        self._page_of.clear()
        self._key_of.clear()
        self._evictable.clear()
        return pages

    def check(self) -> None:
        assert len(self._page_of) == len(self._key_of)
        assert all(self._page_of[key] == page for page, key in self._key_of.items())
        assert all(page in self._key_of for page in self._evictable)
