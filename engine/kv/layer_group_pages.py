"""Pages of a network whose layer groups keep their K/V in pools of their own (DiffusionGemma:
sliding-window and full attention layers, with different head sizes), behind the page manager's
surface the scheduler and the engine use.

A sequence's table holds one `PageTable` per group (`PageTable.groups`); an allocation takes pages
in every group or in none. A group with a sliding window of W keeps only what its layers read
again: once tokens up to c are committed, later queries attend to keys from c − (W − 1) on, so the
group's pages wholly before that are given back (`register`, called after every forward with the
committed count). Prefix caching is off: a cached page would have to be shared in every group at
once, and a sliding group has released the pages a later prompt would match.
"""

from __future__ import annotations

from engine.kv.page_manager import KVPageManager, PageTable


class LayerGroupPages:
    """One page manager per layer group; `groups` maps a group's name to (pages, sliding window or None)."""

    enable_prefix_caching = False
    prefix_hit_tokens = 0

    def __init__(self, groups: dict[str, tuple[int, int | None]], page_size: int):
        self.page_size = page_size
        self.managers = {g: KVPageManager(n, page_size, enable_prefix_caching=False) for g, (n, _) in groups.items()}
        self.windows = {g: w for g, (_, w) in groups.items()}
        # the groups that keep the whole context bound how long a sequence can be
        self._whole = [m for g, m in self.managers.items() if self.windows[g] is None] or list(self.managers.values())

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
        """Give back each sliding group's pages that no later query reads."""
        for g, m in self.managers.items():
            window = self.windows[g]
            if window is not None:
                m.release_before(table.groups[g], num_committed - (window - 1))

    def held_pages(self, table: PageTable) -> dict[str, int]:
        """Pages `table` holds per group."""
        return {g: m.held_pages(table.groups[g]) for g, m in self.managers.items()}

    def match_prefix(self, table: PageTable, tokens: list[int], max_tokens: int) -> int:
        return 0

    def undo_match(self, table: PageTable, reused: int) -> None:
        self.free(table)

    def flush(self) -> None:
        """Nothing is cached, so nothing to forget."""
