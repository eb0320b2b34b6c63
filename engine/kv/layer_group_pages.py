"""Pages of a network whose layer groups keep their K/V in pools of their own (DiffusionGemma:
sliding-window and full attention layers, with different head sizes), behind the page manager's
surface the scheduler and the engine use.

A sequence's table holds one `PageTable` per group (`PageTable.groups`); an allocation takes pages
in every group or in none. A group with a sliding window of W keeps only what its layers read
again: once tokens up to c are committed, later queries attend to keys from c − (W − 1) on, so the
group's pages wholly before that are given back (`register`, called after every forward with the
committed count).

Prefix caching keys every group's pages by the same token chain (each committed token's K/V depend
on the tokens before it only). A prefix of n committed tokens is reused when the groups that keep
the whole context hold all its pages and each sliding group still holds the pages its window reads
after n tokens (released pages that were published stay cached until evicted); the earlier pages of
a sliding group are not needed and stay `RELEASED` in the new table.
"""

from __future__ import annotations

from engine.kv.page_manager import KVPageManager, PageTable


class LayerGroupPages:
    """One page manager per layer group; `groups` maps a group's name to (pages, sliding window or None)."""

    def __init__(self, groups: dict[str, tuple[int, int | None]], page_size: int, enable_prefix_caching: bool):
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.managers = {g: KVPageManager(n, page_size, enable_prefix_caching) for g, (n, _) in groups.items()}
        self.windows = {g: w for g, (_, w) in groups.items()}
        # the groups that keep the whole context bound how long a sequence can be
        self._whole = [m for g, m in self.managers.items() if self.windows[g] is None] or list(self.managers.values())
        self.prefix_query_tokens = 0  # tokens every lookup asked for
        self.rows = None  # no table of the whole network: a step reads each group's (`group_page_tables`)

    @property
    def prefix_hit_tokens(self) -> int:
        return self._whole[0].prefix_hit_tokens

    def new_table(self) -> PageTable:
        return PageTable(groups={g: PageTable() for g in self.managers})

    @property
    def num_pages(self) -> int:
        """Pages of the smallest pool that keeps the whole context (what a sequence's length needs)."""
        return min(m.num_pages for m in self._whole)

    @property
    def num_free_pages(self) -> int:
        return min(m.num_free_pages for m in self._whole)

    def allocate(self, table: PageTable, num_tokens: int) -> bool:
        """Grow every group's table to hold `num_tokens` tokens, or take nothing if one group runs out."""
        if any(m.pages_needed(table.groups[g], num_tokens) > m.num_free_pages for g, m in self.managers.items()):
            return False
        for g, m in self.managers.items():
            m.allocate(table.groups[g], num_tokens)
        return True

    def free(self, table: PageTable) -> None:
        for g, m in self.managers.items():
            m.free(table.groups[g])

    def register(self, table: PageTable, tokens: list[int], num_committed: int) -> None:
        """Publish every group's full committed pages, then give back each sliding group's pages that
        no later query reads."""
        for g, m in self.managers.items():
            m.register(table.groups[g], tokens, num_committed)
            window = self.windows[g]
            if window is not None:
                m.release_before(table.groups[g], num_committed - (window - 1))

    def register_many(self, committed: list[tuple[PageTable, list[int], int]]) -> None:
        """`register` each (table, tokens, num_committed) of a step (every one: sliding groups give pages
        back as the committed length grows)."""
        for table, tokens, num_committed in committed:
            self.register(table, tokens, num_committed)

    def held_pages(self, table: PageTable) -> dict[str, int]:
        """Pages `table` holds per group."""
        return {g: m.held_pages(table.groups[g]) for g, m in self.managers.items()}

    def match_prefix(self, table: PageTable, tokens: list[int], max_tokens: int) -> int:
        """Attach the longest cached prefix (whole pages, at most `max_tokens`) every group can serve;
        returns the tokens reused."""
        if not self.enable_prefix_caching or any(t.pages for t in table.groups.values()):
            return 0
        self.prefix_query_tokens += max_tokens
        n = min(m.cached_prefix(tokens, max_tokens) for m in self._whole)
        sliding = [(g, m, w) for g, m in self.managers.items() if (w := self.windows[g]) is not None]
        while n and not all(m.window_cached(tokens, n, w) for _, m, w in sliding):
            n -= self.page_size
        if not n:
            return 0
        for g, m in self.managers.items():
            if self.windows[g] is None:
                m.match_prefix(table.groups[g], tokens, n)
            else:
                m.match_window(table.groups[g], tokens, n, self.windows[g])
        return n

    def undo_match(self, table: PageTable, reused: int, queried: int = 0) -> None:
        self._whole[0].prefix_hit_tokens -= reused
        self.prefix_query_tokens -= queried
        self.free(table)

    def flush(self) -> None:
        """Forget every cached page of every group (tables from before never publish again)."""
        for m in self.managers.values():
            m.flush()
