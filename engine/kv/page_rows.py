"""Every live page table as one row of a persistent int64 array, so that a step gathers its sequences'
tables in one copy, whatever their length.

A sequence's `PageTable.pages` list is the page manager's own record (it allocates, releases and
matches through it); `PageRows` mirrors each table that holds a page in a row of its own, written as
pages come and go (a few entries a step at most), never rebuilt. Packing the tables of a step from
the lists instead costs a Python step per entry, and grows with the context: 4 ms a step for 128
sequences at 32k tokens (16-token pages), against a tenth of a millisecond for the gather.

Entries past a table's length are 0 (page 0, as the step's padding has always been); a `RELEASED`
entry stays -1. Rows and columns grow by doubling, so a long context costs a few copies in all.
"""

from __future__ import annotations

import numpy as np


class PageRows:
    """The rows: `array` [rows, columns] int64, one row per table that holds pages, the rest zeros."""

    def __init__(self, rows: int = 64, columns: int = 64):
        self.array = np.zeros((rows, columns), dtype=np.int64)
        self._free = list(range(rows - 1, -1, -1))  # pop() gives low rows first

    @property
    def in_use(self) -> int:
        """Rows held by a table."""
        return self.array.shape[0] - len(self._free)

    def take(self) -> int:
        """A free row (all zeros) for a table that gets its first page."""
        if not self._free:
            rows = self.array.shape[0]
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        return self._free.pop()

    def give_back(self, row: int, length: int) -> None:
        """Zero the row's first `length` entries and make it free again."""
        self.array[row, :length] = 0
        self._free.append(row)

    def write(self, row: int, start: int, pages: list[int]) -> None:
        """Write `pages` into `row` from column `start` (widening the array when they run past it)."""
        end = start + len(pages)
        columns = self.array.shape[1]
        if end > columns:
            while columns < end:
                columns *= 2
            wider = np.zeros((self.array.shape[0], columns), dtype=np.int64)
            wider[:, : self.array.shape[1]] = self.array
            self.array = wider
        self.array[row, start:end] = pages

    def gather(self, rows: list[int], width: int) -> np.ndarray:
        """The tables of `rows`, in their order, as a new [len(rows), width] array (one copy)."""
        columns = self.array.shape[1]
        if width <= columns:
            return self.array[rows, :width]
        out = np.zeros((len(rows), width), dtype=np.int64)
        out[:, :columns] = self.array[rows]
        return out


class StepTables:
    """The page tables of one forward, a sequence at a time in the batch's order: a sequence's own table
    by its row of the page manager's `PageRows`, a table made for the step alone (a trajectory view's
    context and scratch pages) by its pages. `array(width)` is the step's [sequences, width] int64
    table; `width` is the pages its longest sequence reads."""

    def __init__(self, page_rows: PageRows | None):
        """`page_rows` None: a network whose layer groups keep tables of their own, for which a step
        adds no table here (and makes no array)."""
        self.page_rows = page_rows
        self.rows: list[int] = []  # per sequence its row (a table of the step's own: any, overwritten)
        self.listed: list[tuple[int, list[int]]] = []  # (index in the step, pages) of the step's own tables

    def add_pages(self, pages: list[int]) -> None:
        self.listed.append((len(self.rows), pages))
        self.rows.append(0)

    def array(self, width: int) -> np.ndarray:
        out = self.page_rows.gather(self.rows, width)
        for i, pages in self.listed:
            n = min(len(pages), width)
            out[i, :n] = pages[:n]
            out[i, n:] = 0
        return out
