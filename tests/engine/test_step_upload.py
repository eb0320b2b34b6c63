"""A step's integer fields packed for the device: the page tables padded row by row, and every field
back as its own int64 tensor whatever container it came in."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.worker.step_upload import StepUploader, padded_rows

pages = st.lists(st.integers(0, 2**40), max_size=9)


@given(tables=st.lists(pages, min_size=1, max_size=6), extra=st.integers(0, 3))
def test_padded_rows_are_the_tables_padded_with_page_0(tables, extra):
    width = max(map(len, tables)) + extra
    assert list(padded_rows(tables, width)) == [p for t in tables for p in t + [0] * (width - len(t))]


def test_upload_gives_each_field_back_on_the_cpu():
    fields = {"ids": [3, 1, 4], "tables": padded_rows([[7], [8, 9]], 2), "none": [], "rows": (5, 6)}
    got = StepUploader().upload(fields, torch.device("cpu"))
    assert list(got) == list(fields)
    assert {name: t.tolist() for name, t in got.items()} == {"ids": [3, 1, 4], "tables": [7, 0, 8, 9], "none": [],
                                                              "rows": [5, 6]}
    assert all(t.dtype == torch.long for t in got.values())
