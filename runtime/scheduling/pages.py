"""KV page allocator shared by the target's cache and the drafter's context cache, with prefix caching. Pure Python.

Both caches are indexed by token position through one page table per request, so a page id names the same
slots in every layer of both models: a cached page carries the target's keys and values and the drafter's
captured context of its tokens alike.

Prefix caching (``caching=True``): a full page is keyed by a digest of its tokens and of every token before it
(``page_key`` chains them), so two requests share a page exactly when their first tokens up to its end are
equal. Invariant: every page is in exactly one state: held (reference count >= 1; a page several requests
share is never written, since requests only write positions past their computed prefix), evictable (count 0,
still holding a registered page's KV, reused by a later request with the same prefix or taken for new
allocations oldest first, LRU) or free (count 0, nothing worth keeping).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


def page_key(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The key of a full page holding ``tokens`` after the page keyed ``parent`` (None: the first page)."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, caching: bool = False):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.caching = caching
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self._key_of: dict[int, bytes] = {}  # registered page -> its key
        self._page_of: dict[bytes, int] = {}  # key -> the page holding it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # count-0 registered pages, least recently used first
        self.num_queried_tokens = 0  # prefix-cache lookups, in tokens (vLLM's prefix_cache_queries)
        self.num_hit_tokens = 0  # of those, tokens found in cached pages (vLLM's prefix_cache_hits)

    @property
    def num_free(self) -> int:
        """Pages a request can get now: free ones and evictable ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages holding a registered prefix (held or evictable)."""
        return len(self._key_of)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_grow(self, page_ids: list[int], num_tokens: int) -> bool:
        return self.pages_for(num_tokens) - len(page_ids) <= self.num_free

    def grow(self, page_ids: list[int], num_tokens: int) -> None:
        """Append pages to ``page_ids`` until they hold ``num_tokens``; the caller checked ``can_grow``."""
        missing = self.pages_for(num_tokens) - len(page_ids)
        if missing > self.num_free:
            raise RuntimeError(f"out of KV pages: need {missing}, {self.num_free} free")
        for _ in range(max(missing, 0)):
            page_ids.append(self._allocate())

    def release(self, page_ids: list[int]) -> None:
        """Drop one reference to each page (last page first, so a request's tail is reused before its prefix)."""
        for page in reversed(page_ids):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)
        page_ids.clear()

    def exclusive(self, page_ids: list[int]) -> list[int]:
        """The pages of ``page_ids`` no one else holds."""
        return [p for p in page_ids if self._refs[p] == 1]

    def forget(self, page_ids: list[int]) -> None:
        """Unregister these pages (their content must not be reused, e.g. it holds NaN)."""
        for page in page_ids:
            key = self._key_of.pop(page, None)
            if key is not None:
                del self._page_of[key]

    def forget_cached(self) -> None:
        """Drop every cached prefix no request holds (its pages become free) and zero the lookup counters: what
        an engine's own warm-up requests left behind."""
        idle = list(self._evictable)
        self.forget(idle)
        self._evictable.clear()
        self._free.extend(reversed(idle))
        self.num_queried_tokens = self.num_hit_tokens = 0

    # ---- prefix cache -------------------------------------------------------------------------

    def match(self, keys: list[bytes]) -> list[int]:
        """The cached pages of the longest prefix of ``keys`` (not taken yet: see ``take``)."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def cost(self, pages: list[int]) -> int:
        """How many of ``num_free`` taking ``pages`` would use up (the evictable ones)."""
        return sum(1 for p in pages if p in self._evictable)

    def take(self, pages: list[int]) -> None:
        """Hold matched ``pages`` (one more reference each)."""
        for page in pages:
            self._evictable.pop(page, None)
            self._refs[page] += 1

    def register(self, page: int, key: bytes) -> None:
        """Record that held ``page`` is full and holds the prefix ``key`` (a page or key already registered is
        left as it is: the same prefix computed twice stays one cache entry)."""
        if not self.caching or page in self._key_of or key in self._page_of:
            return
        self._key_of[page] = key
        self._page_of[key] = page

    def _allocate(self) -> int:
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self._evictable.popitem(last=False)
            self.forget([page])
        self._refs[page] = 1
        return page
