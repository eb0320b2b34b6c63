"""A step's integer fields packed for the device: every field back as its own int64 tensor, whatever
container it came in (lists, arrays, the page tables' numpy array), in its order."""

from __future__ import annotations

from array import array

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.worker.forward_batch import ForwardBatch, page_table_array
from engine.worker.step_upload import GraphPadding, StepUploader, upload_step
from ops.attention.triton_backend import TritonAttention

values = st.lists(st.integers(-(2**40), 2**40), max_size=9)
containers = st.sampled_from([list, lambda v: array("q", v), lambda v: np.array(v, dtype=np.int64).reshape(1, -1)])


@given(fields=st.lists(st.tuples(values, containers), max_size=6))
def test_upload_gives_each_field_back_in_order(fields):
    given_fields = {f"f{i}": make(v) for i, (v, make) in enumerate(fields)}
    got = StepUploader().upload(given_fields, torch.device("cpu"))
    assert list(got) == list(given_fields)
    assert [t.tolist() for t in got.values()] == [v for v, _ in fields]
    assert all(t.dtype == torch.long for t in got.values())


def test_a_tables_array_between_lists():
    tables = np.array([[7, 0], [8, 9]], dtype=np.int64)
    got = StepUploader().upload({"ids": [3, 1, 4], "tables": tables, "none": [], "rows": (5, 6)}, torch.device("cpu"))
    assert {name: t.tolist() for name, t in got.items()} == {"ids": [3, 1, 4], "tables": [7, 0, 8, 9], "none": [],
                                                              "rows": [5, 6]}


def test_a_padded_step_reads_the_null_page_after_its_tables():
    """A step padded to a graph's token bucket: the padding sequence's table row ([null page, 0, ...])
    follows the real ones in the metadata, though the batch's own array is never copied to hold it."""
    tables = page_table_array([[4], [7, 8, 9]])
    batch = ForwardBatch(input_ids=[1, 2, 3], positions=[0, 40, 41], q_lens=[1, 2], kv_lens=[1, 42],
                         slot_mapping=[64, 9 * 16 + 8, 9 * 16 + 9], page_tables=tables, sample_rows=[0, 2])
    padding = GraphPadding(tokens=8, max_seqs=4, null_page=11)
    step, meta = upload_step(batch, TritonAttention(query_group=1), StepUploader(), torch.device("cpu"), 16, None,
                             padding)
    assert meta.page_tables.tolist() == [[4, 0, 0], [7, 8, 9], [11, 0, 0]]
    assert meta.q_lens == [1, 2, 5] and meta.kv_lens == [1, 42, 1]
    assert step["positions"].tolist() == [0, 40, 41, 0, 0, 0, 0, 0]
    assert batch.page_tables.shape == (2, 3)
    unpadded, _ = upload_step(batch, TritonAttention(query_group=1), StepUploader(), torch.device("cpu"), 16, None,
                              None)
    assert unpadded["page_tables"].tolist() == [4, 0, 0, 7, 8, 9]
