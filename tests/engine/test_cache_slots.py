"""`add_slots`, which lays out a step's cache slots a page at a time, against its definition: position
p of a sequence lives in slot pages[p // page_size] * page_size + p % page_size."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.batch import add_slots


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_slots_are_each_positions_page_and_offset(data):
    page_size = data.draw(st.sampled_from([1, 2, 4, 16]))
    pages = data.draw(st.lists(st.integers(0, 1000), min_size=1, max_size=12, unique=True))
    end = data.draw(st.integers(0, len(pages) * page_size))
    start = data.draw(st.integers(0, end))
    slots = [7]  # what the step laid out before: kept
    add_slots(slots, pages, start, end, page_size)
    assert slots == [7] + [pages[p // page_size] * page_size + p % page_size for p in range(start, end)]
