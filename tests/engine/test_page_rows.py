"""The page manager's persistent rows of its tables: after any sequence of allocations, releases,
prefix matches and frees, every table's row holds its pages and nothing else; a step's gathered
array is its tables padded with page 0."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.page_manager import KVPageManager, PageTable
from engine.kv.page_rows import PageRows, StepTables

PAGE = 4


def assert_rows_mirror(kv: KVPageManager, tables: list[PageTable]) -> None:
    held = [t for t in tables if t.pages]
    assert sorted(t.row for t in held) == sorted({t.row for t in held}), "two tables share a row"
    for t in tables:
        if not t.pages:
            assert t.row == -1
            continue
        row = kv.rows.array[t.row]
        assert row[: len(t.pages)].tolist() == t.pages
        assert not row[len(t.pages):].any(), "entries past the table are page 0"
    assert kv.rows.in_use == len(held)


operations = st.lists(st.tuples(st.sampled_from(["grow", "release", "free", "match"]), st.integers(0, 5),
                                 st.integers(1, 40)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops=operations)
def test_every_table_row_mirrors_its_pages(ops):
    kv = KVPageManager(num_pages=48, page_size=PAGE, enable_prefix_caching=True)
    kv.rows = PageRows(rows=2, columns=2)  # small, so that rows and columns grow during the run
    tables = [PageTable() for _ in range(6)]
    tokens = list(range(200))
    for op, i, n in ops:
        t = tables[i]
        if op == "grow":
            kv.allocate(t, len(t.pages) * PAGE + n)
            kv.register(t, tokens, len(t.pages) * PAGE)
        elif op == "release" and t.pages:
            kv.release_before(t, n)
        elif op == "free":
            kv.free(t)
        elif op == "match" and not t.pages:
            kv.match_prefix(t, tokens, n)
        assert_rows_mirror(kv, tables)


def test_match_window_writes_released_entries():
    kv = KVPageManager(num_pages=16, page_size=PAGE, enable_prefix_caching=True)
    tokens = list(range(32))
    first = PageTable()
    kv.allocate(first, 24)
    kv.register(first, tokens, 24)
    again = PageTable()
    kv.match_window(again, tokens, 24, window=9)
    assert again.pages[:4] == [-1] * 4 and kv.rows.array[again.row, :6].tolist() == again.pages


def test_step_tables_gather_rows_and_the_steps_own_lists():
    store = PageRows(rows=2, columns=2)
    a, b = store.take(), store.take()
    store.write(a, 0, [5, 6, 7])
    store.write(b, 0, [9])
    tables = StepTables(store)
    tables.rows.append(b)
    tables.add_pages([1, 2, 3, 4])  # a view's table, cut to the step's width
    tables.rows.append(a)
    got = tables.array(3)
    assert got.dtype == np.int64 and got.tolist() == [[9, 0, 0], [1, 2, 3], [5, 6, 7]]
    store.give_back(a, 3)
    assert store.take() == a and not store.array[a].any()
