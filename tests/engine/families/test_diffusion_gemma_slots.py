"""The cache slots a DiffusionGemma pass reads, worked out a page at a time, are the slots of its
positions one by one: page * page_size + offset through the group's table; a position on a freed
page (a sliding group's, before its window) is refused, naming the first such position."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.model.families.diffusion_gemma.attention import FREED, slots_of


def slot_by_slot(table: list[int], lo: int, hi: int, page_size: int) -> list[int]:
    out = []
    for pos in range(lo, hi):
        page = table[pos // page_size]
        if page == FREED:
            raise RuntimeError(f"position {pos} lies on a freed page: the sliding window no longer holds it")
        out.append(page * page_size + pos % page_size)
    return out


@given(data=st.data(), page_size=st.sampled_from([1, 4, 16]), freed=st.integers(0, 3))
def test_slots_are_the_positions_slots(data, page_size, freed):
    pages = data.draw(st.lists(st.integers(0, 10_000), min_size=1, max_size=12))
    table = [FREED] * min(freed, len(pages) - 1) + pages[min(freed, len(pages) - 1):]
    end = len(table) * page_size
    lo = data.draw(st.integers(0, end))
    hi = data.draw(st.integers(lo, end))
    try:
        want = slot_by_slot(table, lo, hi, page_size)
    except RuntimeError as e:
        with pytest.raises(RuntimeError, match=f"^{e}$"):
            slots_of(table, lo, hi, page_size)
        return
    got = slots_of(table, lo, hi, page_size)
    assert str(got.dtype) == "int64" and got.tolist() == want
