"""Prefix caching over the paged KV cache: full prompt pages shared between requests.

A request whose prompt starts like an earlier one (a system prompt, a few-shot preamble, the
turns of a chat so far) reuses that request's KV pages instead of prefilling them again. Only
*full prompt pages* are shared, and a request never writes into a shared page: at most
``(len(prompt) - 1) // page_size`` pages match, so at least one prompt token is always prefilled
(its forward produces the first token) and every later write lands at positions beyond the shared
pages. The target's and the drafter's KV pools use the same pages through the same block table,
so one page id shares both.

**Keys.** Page k of a prompt (tokens k*P .. (k+1)*P - 1) is keyed by

    (key of page k - 1, its P tokens, the token that follows it)      (page 0: a namespace root)

-- a hash chain, since page k's K/V depend on every earlier token. The following token is part of
the key because the drafter's step-0 entry at position t is fed x_{t+1}: the entry at a page's last
position depends on the first token of the next page. The chain link is the earlier page's entry
id (a counter never reused), not its page number (reused after eviction), and keys are compared
exactly (a dict), so two prompts share a page only if they agree on every token up to and
including the one after it. The namespace separates pages written with the drafter's entries from
pages written by plain decoding (no drafter entries).

**Lifetime.** A cached page is reference-counted by the sequences whose block tables hold it. When
the count drops to zero it stays cached (idle) and can be matched again; idle pages are evicted
least-recently-used first when the page allocator runs short (``PageAllocator(reclaim=evict)``),
and a referenced page is never evicted. Pages released together enter the idle list deepest
first, so a chain loses its tail before its head (a head without its tail still matches; a tail
without its head never would). After every request has finished, free + idle pages == capacity.

Hybrid (Gated DeltaNet) targets do not use it: their recurrent state is per slot, not paged, so a
shared page would not restore the state after it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

WITH_DRAFTER, TARGET_ONLY = -1, -2  # namespace roots of the chains (entry ids are >= 1)


@dataclass
class _Entry:
    id: int
    key: tuple
    page: int
    refs: int


class PrefixCache:
    """Host-side index of shareable prompt pages: ``match``, ``insert``, ``release``, ``evict``."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._by_key: dict[tuple, _Entry] = {}
        self._by_page: dict[int, _Entry] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # unreferenced pages, least recently used first
        self._next_id = 1
        self.matched_pages = 0  # pages reused so far (statistics)

    @property
    def cached_pages(self) -> int:
        return len(self._by_page)

    @property
    def idle_pages(self) -> int:
        """Cached pages no sequence holds: reusable by a match, or reclaimable by ``evict``."""
        return len(self._idle)

    def refs(self, page: int) -> int:
        return self._by_page[page].refs

    def shareable(self, prompt_len: int) -> int:
        """How many leading pages of a prompt may be shared (at least one token is left to prefill)."""
        return (prompt_len - 1) // self.page_size

    def _key(self, parent: int, prompt: list[int], k: int) -> tuple:
        p = self.page_size
        return parent, tuple(prompt[k * p:(k + 1) * p]), prompt[(k + 1) * p]

    def match(self, prompt: list[int], root: int = WITH_DRAFTER) -> tuple[list[int], int]:
        """The longest cached chain of the prompt's shareable pages -> (pages, entry id of the last,
        or ``root`` if none). The caller holds a reference to each page until ``release``."""
        pages, parent = [], root
        for k in range(self.shareable(len(prompt))):
            entry = self._by_key.get(self._key(parent, prompt, k))
            if entry is None:
                break
            if entry.refs == 0:
                del self._idle[entry.page]
            entry.refs += 1
            pages.append(entry.page)
            parent = entry.id
        self.matched_pages += len(pages)
        return pages, parent

    def insert(self, parent: int, prompt: list[int], k: int, page: int) -> int | None:
        """Register the caller's page holding prompt page k (its K/V fully written, the chain up to
        ``parent`` cached) with one reference, the caller's. Returns its entry id, or None when the key
        is cached already (another sequence wrote the same page first; the caller keeps its copy)."""
        assert k < self.shareable(len(prompt)) and page not in self._by_page
        key = self._key(parent, prompt, k)
        if key in self._by_key:
            return None
        entry = _Entry(self._next_id, key, page, refs=1)
        self._next_id += 1
        self._by_key[key] = self._by_page[page] = entry
        return entry.id

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each of a sequence's cached pages (given in chain order)."""
        for page in reversed(pages):  # deepest first into the idle list: evicted before their heads
            entry = self._by_page[page]
            assert entry.refs > 0, f"page {page} released more often than held"
            entry.refs -= 1
            if entry.refs == 0:
                self._idle[page] = None

    def evict(self, n: int) -> list[int]:
        """Forget up to n idle pages, least recently used first, and return them (to the allocator)."""
        out = []
        while self._idle and len(out) < n:
            page, _ = self._idle.popitem(last=False)
            entry = self._by_page.pop(page)
            del self._by_key[entry.key]
            out.append(page)
        return out


__all__ = ["PrefixCache", "TARGET_ONLY", "WITH_DRAFTER"]
