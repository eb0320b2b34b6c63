"""What goes into one forward: the flat batch of scheduled token ranges, and which logits rows
belong to which sequence."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.decoding import DecodingStrategy
from engine.core.scheduler import ScheduledSeq
from engine.core.scoring import add_score_rows
from engine.core.sequence import Sequence
from engine.core.trajectory import add_view_rows
from engine.worker.forward_batch import ForwardBatch


@dataclass
class SampleSlice:
    """The logits rows [first, first + len(positions)) pick tokens for `positions` of `seq`."""

    seq: Sequence
    first: int
    positions: list[int]


def add_slots(slots: list[int], pages: list[int], start: int, end: int, page_size: int) -> None:
    """Append the flat cache slots of positions [start, end): one range per page they touch."""
    while start < end:
        offset = start % page_size
        stop = min(end, start - offset + page_size)
        first = pages[start // page_size] * page_size + offset
        slots += range(first, first + stop - start)
        start = stop


def build_batch(items: list[ScheduledSeq], decoding: DecodingStrategy, page_size: int
                ) -> tuple[ForwardBatch, list[SampleSlice]]:
    batch = ForwardBatch([], [], [], [], [], [])
    slices: list[SampleSlice] = []
    for it in items:
        if it.views is not None:
            add_view_rows(batch, it, page_size)
            continue
        seq, base = it.seq, len(batch.input_ids)
        batch.input_ids += seq.tokens[it.start : it.end]
        batch.positions += range(it.start, it.end)
        batch.q_lens.append(it.end - it.start)
        batch.kv_lens.append(it.end)
        if seq.table.groups:  # layer groups with pools of their own: a table per group, read in place
            for group, table in seq.table.groups.items():
                batch.group_page_tables.setdefault(group, []).append(list(table.pages))
        else:
            add_slots(batch.slot_mapping, seq.table.pages, it.start, it.end, page_size)
            batch.page_tables.append(seq.table.pages)  # read up to kv_lens; not copied (the runner pads its own)
        decoding.pass_fields(batch, seq, it.sample)
        if it.sample:
            positions = decoding.sample_positions(seq, it.end)
            slices.append(SampleSlice(seq, len(batch.sample_rows), positions))
            batch.sample_rows += [base + p - it.start for p in positions]
        add_score_rows(batch, it, base)
    return batch, slices
