"""Paged KV block manager: fixed-size pages, a free list, per-sequence page tables, prefix caching.

Prefix caching keys a full page by a hash chain: the key of page p is (key of page p-1, the tokens
that determine page p's K/V). For causal models those are the page's own tokens. Under DLLM
block-causal attention a page's K/V also depend on the rest of the DLLM block its last token
belongs to, so its key extends to that block's end (`key_end`). A page is registered only once
those tokens are committed (their K/V final). Pages whose refcount drops to 0 keep their content
and sit in an LRU list, evicted only when the free list runs dry.

A table's entry may be `RELEASED`: a layer group with a sliding window keeps only the pages its
window still reads (`release_before`); registering walks the prefix chain past a released page
(its key is its tokens') without publishing it.

`flush` forgets every cached page (after a weight update their K/V belong to the old weights). A
sequence that was already holding pages keeps them for itself, but its table belongs to the old
cache epoch and never publishes a page again: its later pages sit on K/V computed before the flush.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from engine.kv.page_rows import PageRows

RELEASED = -1  # a page table entry given back (a sliding-window layer group's page before its window)


@dataclass
class _Page:
    page_id: int
    ref_count: int = 0
    key: tuple | None = None  # (parent key hash, tokens) once registered


@dataclass
class PageTable:
    """A sequence's pages, plus how many of them are registered in the prefix cache. A network whose
    layer groups keep their K/V in pools of their own (engine.kv.layer_group_pages) gives a sequence
    one table per group in `groups` instead."""

    pages: list[int] = field(default_factory=list)
    registered: int = 0
    parent_hash: int | None = None  # hash of the last registered page's key
    epoch: int = 0  # the cache epoch its first page was taken in; only the current epoch publishes
    groups: dict[str, PageTable] = field(default_factory=dict)
    row: int = -1  # its row of the manager's `PageRows` while it holds pages (-1: none)

    def holds(self, num_tokens: int, page_size: int) -> bool:
        """Whether its pages (every group's) reach `num_tokens` tokens already: nothing to allocate."""
        if self.groups:
            return all(len(t.pages) * page_size >= num_tokens for t in self.groups.values())
        return len(self.pages) * page_size >= num_tokens


class KVPageManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool,
                 dllm_block_length: int | None = None):
        self.page_size = page_size
        self.num_pages = num_pages
        self.enable_prefix_caching = enable_prefix_caching
        self.dllm_block_length = dllm_block_length
        self._pages = [_Page(i) for i in range(num_pages)]
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives low ids first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages with ref 0, LRU first
        self._by_hash: dict[int, int] = {}  # key hash -> page id
        self.prefix_hit_tokens = 0  # tokens found in the cache by every lookup (accounting for tests and metrics)
        self.prefix_query_tokens = 0  # tokens every lookup asked for (a preempted sequence asks again)
        self.epoch = 0  # bumped by every flush
        self.rows = PageRows()  # every table that holds pages, one row each: what a step's forward reads

    def new_table(self) -> PageTable:
        """An empty page table for a new sequence."""
        return PageTable()

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages a new allocation could take: never used, freed, or cached but unreferenced."""
        return len(self._free) + len(self._evictable)

    def pages_needed(self, table: PageTable, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(table.pages))

    # ---- allocation -------------------------------------------------------------------------
    def _take_page(self) -> int:
        if self._free:
            page_id = self._free.pop()
        else:
            page_id, _ = self._evictable.popitem(last=False)
            page = self._pages[page_id]
            del self._by_hash[hash(page.key)]
            page.key = None
        self._pages[page_id].ref_count = 1
        return page_id

    def allocate(self, table: PageTable, num_tokens: int) -> bool:
        """Grow `table` to hold `num_tokens` tokens; False (nothing taken) if pages run out."""
        need = self.pages_needed(table, num_tokens)
        if need > self.num_free_pages:
            return False
        if not table.pages:
            table.epoch = self.epoch
        if need:
            self._append(table, [self._take_page() for _ in range(need)])
        return True

    def _append(self, table: PageTable, pages: list[int]) -> None:
        """Add `pages` to the end of `table`, in its list and in its row."""
        if table.row < 0:
            table.row = self.rows.take()
        self.rows.write(table.row, len(table.pages), pages)
        table.pages += pages

    def release_before(self, table: PageTable, position: int) -> int:
        """Give back the pages of `table` that lie wholly before `position` (a sliding-window layer
        group never reads them again); their entries become `RELEASED`. Returns how many went."""
        released = 0
        for index in range(min(position // self.page_size, len(table.pages))):
            if table.pages[index] != RELEASED:
                self._unref(table.pages[index])
                table.pages[index] = RELEASED
                self.rows.write(table.row, index, [RELEASED])
                released += 1
        return released

    def _unref(self, page_id: int) -> None:
        page = self._pages[page_id]
        page.ref_count -= 1
        if page.ref_count == 0:
            if page.key is not None:
                self._evictable[page_id] = None
            else:
                self._free.append(page_id)

    def free(self, table: PageTable) -> None:
        for page_id in reversed(table.pages):
            if page_id != RELEASED:
                self._unref(page_id)
        if table.row >= 0:
            self.rows.give_back(table.row, len(table.pages))
            table.row = -1
        table.pages.clear()
        table.registered = 0
        table.parent_hash = None

    def held_pages(self, table: PageTable) -> int:
        """Pages `table` holds (released ones not counted)."""
        return sum(page != RELEASED for page in table.pages)

    # ---- prefix caching ---------------------------------------------------------------------
    def _key_end(self, page_index: int) -> int:
        end = (page_index + 1) * self.page_size
        b = self.dllm_block_length
        return end if b is None else -(-end // b) * b

    def _key(self, parent: int | None, tokens: list[int], page_index: int) -> tuple:
        start = page_index * self.page_size
        return (parent, tuple(tokens[start : self._key_end(page_index)]))

    def match_prefix(self, table: PageTable, tokens: list[int], max_tokens: int) -> int:
        """Attach cached pages covering at most `max_tokens` leading tokens; returns tokens reused."""
        if not self.enable_prefix_caching or table.pages:
            return 0
        self.prefix_query_tokens += max_tokens
        table.epoch = self.epoch
        hashes: list[int] = []  # of the attached pages' keys
        attached: list[int] = []
        p = 0
        while self._key_end(p) <= max_tokens and (p + 1) * self.page_size <= max_tokens:
            key = self._key(hashes[-1] if hashes else None, tokens, p)
            page_id = self._by_hash.get(hash(key))
            if page_id is None or self._pages[page_id].key != key:
                break
            page = self._pages[page_id]
            if page.ref_count == 0:
                del self._evictable[page_id]
            page.ref_count += 1
            attached.append(page_id)
            hashes.append(hash(key))
            p += 1
        # a hit covers whole DLLM blocks (its pages are at most one block's short of one when the page
        # after them was evicted): a forward then feeds whole blocks from it, as block routing needs
        b = self.dllm_block_length
        while b is not None and p and (p * self.page_size) % b:
            self._unref(attached.pop())
            hashes.pop()
            p -= 1
        if attached:
            self._append(table, attached)
        table.registered = p
        table.parent_hash = hashes[-1] if hashes else None
        reused = p * self.page_size
        self.prefix_hit_tokens += reused
        return reused

    def _keys(self, tokens: list[int], num_pages: int) -> list[tuple]:
        """The prefix-chain keys of the first `num_pages` pages of `tokens`."""
        keys, parent = [], None
        for p in range(num_pages):
            key = self._key(parent, tokens, p)
            keys.append(key)
            parent = hash(key)
        return keys

    def _cached(self, key: tuple) -> int | None:
        page_id = self._by_hash.get(hash(key))
        return page_id if page_id is not None and self._pages[page_id].key == key else None

    def cached_prefix(self, tokens: list[int], max_tokens: int) -> int:
        """How many leading tokens (whole pages, at most `max_tokens`) `match_prefix` would reuse."""
        if not self.enable_prefix_caching:
            return 0
        n = 0
        for key in self._keys(tokens, max_tokens // self.page_size):
            if self._cached(key) is None:
                break
            n += 1
        return n * self.page_size

    def window_cached(self, tokens: list[int], num_tokens: int, window: int) -> bool:
        """Whether the pages a sliding window of `window` still reads after `num_tokens` committed
        tokens (a multiple of the page size) are all cached."""
        first = max(0, num_tokens - (window - 1)) // self.page_size
        keys = self._keys(tokens, num_tokens // self.page_size)
        return self.enable_prefix_caching and all(self._cached(k) is not None for k in keys[first:])

    def match_window(self, table: PageTable, tokens: list[int], num_tokens: int, window: int) -> None:
        """Attach the cached pages a sliding window still reads after `num_tokens` committed tokens
        (`window_cached` said they are there); the pages before the window are `RELEASED` entries."""
        table.epoch = self.epoch
        first = max(0, num_tokens - (window - 1)) // self.page_size
        keys = self._keys(tokens, num_tokens // self.page_size)
        attached: list[int] = []
        for p, key in enumerate(keys):
            if p < first:
                attached.append(RELEASED)
                continue
            page_id = self._cached(key)
            page = self._pages[page_id]
            if page.ref_count == 0:
                del self._evictable[page_id]
            page.ref_count += 1
            attached.append(page_id)
        if attached:
            self._append(table, attached)
        table.registered = len(keys)
        table.parent_hash = hash(keys[-1]) if keys else None

    def undo_match(self, table: PageTable, reused: int, queried: int = 0) -> None:
        """Give back what `match_prefix` attached to a sequence that could not be admitted after all
        (`queried`: the tokens that lookup asked for, no longer counted either)."""
        self.prefix_hit_tokens -= reused
        self.prefix_query_tokens -= queried
        self.free(table)

    def register(self, table: PageTable, tokens: list[int], num_committed: int) -> None:
        """Publish the sequence's full pages whose K/V are final (tokens < num_committed)."""
        if not self.enable_prefix_caching or table.epoch != self.epoch:
            return
        while table.registered < len(table.pages) and self._key_end(table.registered) <= num_committed:
            p = table.registered
            key = self._key(table.parent_hash, tokens, p)
            h = hash(key)
            page = None if table.pages[p] == RELEASED else self._pages[table.pages[p]]
            if page is not None and h not in self._by_hash and page.key is None:
                page.key = key
                self._by_hash[h] = page.page_id
            table.parent_hash = h
            table.registered += 1

    def register_many(self, committed: list[tuple[PageTable, list[int], int]]) -> None:
        """`register` each (table, tokens, num_committed) of a step whose next page to publish is full
        and final (most steps publish nothing: the check is inline)."""
        if not self.enable_prefix_caching:
            return
        page_size, b = self.page_size, self.dllm_block_length
        for table, tokens, num_committed in committed:
            end = (table.registered + 1) * page_size
            if b is not None:
                end = -(-end // b) * b
            if end <= num_committed and table.registered < len(table.pages):
                self.register(table, tokens, num_committed)

    def flush(self) -> None:
        """Forget every cached page: unreferenced ones go back to the free list, referenced ones stay
        with their sequences, unpublished; tables from before the flush never publish again."""
        for page in self._pages:
            page.key = None
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        self._by_hash.clear()
        self.epoch += 1
