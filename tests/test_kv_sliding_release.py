"""The page manager's release of a sliding-window layer group's pages: pages wholly before the
window go back (to the free list, or to the prefix cache when published), a released entry is never
freed twice, and registering walks the prefix chain past released pages so later pages publish
under the same keys a fresh sequence computes."""

from __future__ import annotations

from engine.kv.page_manager import RELEASED, KVPageManager, PageTable

PAGE = 4


def test_release_before_gives_back_whole_pages_only():
    m = KVPageManager(16, PAGE, enable_prefix_caching=False)
    t = PageTable()
    assert m.allocate(t, 18)  # 5 pages
    free = m.num_free_pages
    assert m.release_before(t, 9) == 2  # positions 0-7: pages 0 and 1; page 2 holds position 9
    assert t.pages[:2] == [RELEASED, RELEASED] and RELEASED not in t.pages[2:]
    assert m.num_free_pages == free + 2 and m.held_pages(t) == 3
    assert m.release_before(t, 9) == 0  # idempotent
    m.free(t)
    assert m.num_free_pages == 16


def test_registering_past_released_pages_keeps_the_prefix_chain():
    tokens = list(range(100, 124))  # 6 pages
    m = KVPageManager(32, PAGE, enable_prefix_caching=True)
    a = PageTable()
    assert m.allocate(a, 8)
    m.release_before(a, 8)  # both pages released before they were published
    assert m.allocate(a, 24)
    m.register(a, tokens, 24)
    assert a.registered == 6
    # a fresh sequence with the same tokens computes the same chain: pages 0-1 were never published,
    # so it matches nothing; a sequence registered without releases publishes all six
    b = PageTable()
    assert m.match_prefix(b, tokens, 24) == 0
    m.undo_match(b, 0)
    c = PageTable()
    assert m.allocate(c, 24)
    m.register(c, tokens, 24)
    d = PageTable()
    assert m.match_prefix(d, tokens, 24) == 24
    # `d` reuses `c`'s first two pages and `a`'s last four: `a` published them under the keys of the
    # full chain, so `c` found those keys taken
    assert d.pages[:2] == c.pages[:2] and d.pages[2:] == a.pages[2:]
