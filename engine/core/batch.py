"""What goes into one forward: the flat batch of scheduled token ranges, and which logits rows
belong to which sequence."""

from __future__ import annotations

from engine.core.decoding.base import DecodingStrategy
from engine.core.scoring import add_score_rows
from engine.core.step_plan import SampleSlice, ScheduledSeq
from engine.core.trajectory import add_view_rows
from engine.kv.page_rows import PageRows, StepTables
from engine.worker.forward_batch import NO_TABLES, ForwardBatch


def add_slots(slots: list[int], pages: list[int], start: int, end: int, page_size: int) -> None:
    """Append the flat cache slots of positions [start, end): one range per page they touch."""
    while start < end:
        offset = start % page_size
        stop = start - offset + page_size  # the page's end, or `end` within it
        if stop > end:
            stop = end
        first = pages[start // page_size] * page_size + offset
        slots += range(first, first + stop - start)
        start = stop


def build_batch(items: list[ScheduledSeq], decoding: DecodingStrategy, page_size: int, page_rows: PageRows | None
                ) -> tuple[ForwardBatch, list[SampleSlice]]:
    """The step's forward; `page_rows`: the page manager's rows of the sequences' tables (None: a
    network whose layer groups keep tables of their own)."""
    batch = ForwardBatch([], [], [], [], [], NO_TABLES)
    tables = StepTables(page_rows)
    table_rows = tables.rows
    slices: list[SampleSlice] = []
    input_ids, positions, q_lens, kv_lens, sample_rows = (batch.input_ids, batch.positions, batch.q_lens,
                                                          batch.kv_lens, batch.sample_rows)
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
        positions += range(start, end)
        q_lens += (end - start,)
        kv_lens += (end,)
        if seq.table.groups:  # layer groups with pools of their own: a table per group, read in place
            for group, table in seq.table.groups.items():
                batch.group_page_tables.setdefault(group, []).append(list(table.pages))
        else:
            add_slots(batch.slot_mapping, seq.table.pages, start, end, page_size)
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
    if tables.rows:  # every sequence has one: as wide as the longest one's keys need
        batch.page_tables = tables.array(-(-max(kv_lens) // page_size))
    return batch, slices
