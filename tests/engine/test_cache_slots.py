"""A step's row positions and cache slots, which `build_batch` derives for the whole step from the
sequences' lengths and page tables, against their definitions: a sequence's q rows are the last q of
its kv keys, and position p of a sequence lives in slot pages[p // page_size] * page_size + p % page_size."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.batch import row_positions, row_slots
from engine.worker.forward_batch import page_table_array


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_each_rows_position_and_slot(data):
    page_size = data.draw(st.sampled_from([1, 2, 4, 16]))
    num_seqs = data.draw(st.integers(1, 6))
    pool = data.draw(st.permutations(range(200)))  # distinct pages, shared out among the sequences
    tables, q_lens, kv_lens = [], [], []
    for _ in range(num_seqs):
        num_pages = data.draw(st.integers(1, 6))
        tables.append([pool.pop() for _ in range(num_pages)])
        kv = data.draw(st.integers(1, num_pages * page_size))
        kv_lens.append(kv)
        q_lens.append(data.draw(st.integers(1, kv)))
    expected = [(p, pages[p // page_size] * page_size + p % page_size)
                for pages, q, kv in zip(tables, q_lens, kv_lens) for p in range(kv - q, kv)]
    positions = row_positions(q_lens, kv_lens)
    slots = row_slots(page_table_array(tables), positions, q_lens, page_size)
    assert list(zip(positions.tolist(), slots.tolist())) == expected
