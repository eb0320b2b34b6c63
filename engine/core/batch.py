"""What goes into one forward: the flat batch of scheduled token ranges, and which logits rows
belong to which sequence."""

from __future__ import annotations

import numpy as np

from engine.core.decoding.base import DecodingStrategy
from engine.core.scoring import add_score_rows
from engine.core.step_plan import SampleSlice, ScheduledSeq
from engine.core.trajectory import add_view_rows
from engine.kv.page_rows import PageRows, StepTables
from engine.worker.forward_batch import NO_TABLES, ForwardBatch


def row_positions(q_lens: list[int], kv_lens: list[int]) -> np.ndarray:
    """The absolute position of every query row: a sequence's q rows are the last q of its kv keys, so
    its rows sit at kv - q, kv - q + 1, ..., kv - 1 (prefill chunks, blocks, canvases and trajectory
    views alike)."""
    q = np.asarray(q_lens, dtype=np.int64)
    # row r of the batch belongs to sequence i: r - (rows before i) + (kv_i - q_i)
    shift = np.asarray(kv_lens, dtype=np.int64) - q - (np.cumsum(q) - q)
    return np.arange(int(q.sum()), dtype=np.int64) + np.repeat(shift, q)


def row_slots(page_tables: np.ndarray, positions: np.ndarray, q_lens: list[int], page_size: int) -> np.ndarray:
    """The flat cache slot of every query row: position p of a sequence lives in slot
    table[p // page_size] * page_size + p % page_size of its row of `page_tables`."""
    sequence = np.repeat(np.arange(len(q_lens)), q_lens)
    return page_tables[sequence, positions // page_size] * page_size + positions % page_size


def build_batch(items: list[ScheduledSeq], decoding: DecodingStrategy, page_size: int, page_rows: PageRows | None
                ) -> tuple[ForwardBatch, list[SampleSlice]]:
    """The step's forward; `page_rows`: the page manager's rows of the sequences' tables (None: a
    network whose layer groups keep tables of their own). Each sequence adds its tokens and lengths;
    the rows' positions and cache slots follow from those and the tables, a few array operations for
    the whole step."""
    batch = ForwardBatch([], [], [], [], [], NO_TABLES)
    tables = StepTables(page_rows)
    table_rows = tables.rows
    slices: list[SampleSlice] = []
    input_ids, q_lens, kv_lens, sample_rows = batch.input_ids, batch.q_lens, batch.kv_lens, batch.sample_rows
    pass_fields = decoding.pass_fields if decoding.has_pass_fields else None
    view_fields = decoding.view_fields if decoding.has_pass_fields else None
    num_rows = num_sampled = 0  # rows laid out so far, and sampled rows among them
    for it in items:
        if it.views is not None:
            add_view_rows(batch, tables, it, page_size, view_fields)
            num_rows, num_sampled = len(input_ids), len(sample_rows)
            continue
        seq, start, end, base = it.seq, it.start, it.end, num_rows
        num_rows += end - start
        input_ids += seq.tokens[start:end]
        q_lens += (end - start,)
        kv_lens += (end,)
        if seq.table.groups:  # layer groups with pools of their own: a table per group, read in place
            for group, table in seq.table.groups.items():
                batch.group_page_tables.setdefault(group, []).append(list(table.pages))
        else:
            table_rows += (seq.table.row,)
        if pass_fields is not None:
            pass_fields(batch, seq, it.sample)
        if it.sample:
            sampled = decoding.sample_positions(seq, end)
            first_row, num_sampled = num_sampled, num_sampled + len(sampled)
            slices += (SampleSlice(seq, first_row, num_sampled, sampled),)
            first = base - start
            sample_rows += map(first.__add__, sampled)
        if seq.params.logprob_start_len >= 0:  # the request scores its input tokens
            add_score_rows(batch, it, base)
    batch.positions = row_positions(q_lens, kv_lens)
    if tables.rows:  # every sequence has one: as wide as the longest one's keys need
        batch.page_tables = tables.array(-(-max(kv_lens) // page_size))
        batch.slot_mapping = row_slots(batch.page_tables, batch.positions, q_lens, page_size)
    return batch, slices
