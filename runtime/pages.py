"""KV page allocator shared by the target's cache and the drafter's context cache. Pure Python.

Both caches are indexed by token position through one page table per request, so a page id
names the same slots in every layer of both models.
"""

from __future__ import annotations


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_grow(self, page_ids: list[int], num_tokens: int) -> bool:
        return self.pages_for(num_tokens) - len(page_ids) <= len(self._free)

    def grow(self, page_ids: list[int], num_tokens: int) -> None:
        """Append pages to ``page_ids`` until they hold ``num_tokens``; the caller checked ``can_grow``."""
        missing = self.pages_for(num_tokens) - len(page_ids)
        if missing > len(self._free):
            raise RuntimeError(f"out of KV pages: need {missing}, {len(self._free)} free")
        for _ in range(max(missing, 0)):
            page_ids.append(self._free.pop())

    def release(self, page_ids: list[int]) -> None:
        self._free.extend(reversed(page_ids))
        page_ids.clear()
