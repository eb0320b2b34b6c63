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


def test_layer_group_pages_match_a_prefix_through_the_window_only():
    """Two groups: the full one must hold every page of the prefix, the sliding one (window 6) only the
    pages its window reads after it; pages the sliding group gave back after publishing them serve a
    later match, and the new table's earlier sliding entries are RELEASED."""
    from engine.kv.layer_group_pages import LayerGroupPages

    tokens = list(range(200, 224))  # 6 pages
    kv = LayerGroupPages({"full": (32, None), "sliding": (32, 6)}, PAGE, enable_prefix_caching=True)
    a = kv.new_table()
    assert kv.allocate(a, 24)
    kv.register(a, tokens, 24)  # published, then the sliding pages before 24 - 5 = 19 released
    assert kv.held_pages(a) == {"full": 6, "sliding": 2}
    kv.free(a)
    b = kv.new_table()
    assert kv.match_prefix(b, tokens, 23) == 20  # 5 whole pages; the window after 20 reads 15..19
    assert b.groups["sliding"].pages[:3] == [RELEASED] * 3 and RELEASED not in b.groups["sliding"].pages[3:]
    assert len(b.groups["full"].pages) == 5 and kv.prefix_hit_tokens == 20
    kv.undo_match(b, 20)
    assert kv.prefix_hit_tokens == 0
    # after a flush (a weight update) nothing is reused
    kv.flush()
    c = kv.new_table()
    assert kv.match_prefix(c, tokens, 23) == 0
