"""CUDA graphs for the steps whose shape repeats: block-diffusion denoising and AR decode.

A denoising step feeds every sequence one whole DLLM block (B query rows) or two (2B: a block's commit
fused with the next block's first step); an AR decode step feeds one row per sequence. Either way the
step is a list of *entries* of the same size -- blocks of B rows, or single rows -- and that is what
the flash backend attends over: one varlen entry per block (per sequence for AR), each reading its
sequence's pages. So a step is padded to a bucket of entries with dummy sequences of one entry each,
which write and read only a reserved null KV page, and replays a graph captured once per (entries,
rows per entry) from persistent input buffers its metadata is copied into: token rows = entries x
rows, page tables padded to one row per entry (at most one sequence per entry) and to the longest
sequence the cache holds, and the kernel's `max_seqlen_k` fixed at capture to that length (an upper
bound is what the kernel needs). Prefill chunks, scoring rows and steps that copy KV pages run eagerly,
and graphs run with the flash backend only (the others' metadata changes shape), on one GPU.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable

import torch

from engine.worker.forward_batch import ForwardBatch
from ops.attention import AttentionMetadata

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

# capture(fn) -> (replay, out): records `fn` (which returns one tensor) so that `replay()` recomputes
# `out` in place from whatever the inputs `fn` read hold then
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]
Forward = Callable[[dict[str, torch.Tensor], AttentionMetadata], torch.Tensor]


def batch_buckets(max_entries: int) -> list[int]:
    """The entry counts graphs are captured for: the fixed ladder below `max_entries`, and it."""
    return sorted({b for b in BATCH_BUCKETS if b < max_entries} | {max_entries})


def graph_entries(batch: ForwardBatch, block_length: int | None) -> tuple[int, int] | None:
    """(entries, rows per entry) when `batch` is a step a graph can replay, else None: AR decode (one row
    per sequence), or every sequence feeding one or two whole DLLM blocks from a block boundary; no
    scoring rows, no KV page copies."""
    if batch.score_rows or batch.kv_copy_src:
        return None
    if block_length is None:
        return (len(batch.q_lens), 1) if all(q == 1 for q in batch.q_lens) else None
    b = block_length
    if all(q in (b, 2 * b) and (kv - q) % b == 0 for q, kv in zip(batch.q_lens, batch.kv_lens, strict=True)):
        return sum(batch.q_lens) // b, b
    return None


def pad_batch(batch: ForwardBatch, dummies: int, rows: int, null_page: int, page_size: int) -> ForwardBatch:
    """`batch` with `dummies` sequences of `rows` rows appended, at positions 0.. in `null_page` alone
    (they write and read nothing else). The real rows keep their indices, so `sample_rows` is unchanged."""
    if rows > page_size:
        raise ValueError(f"a dummy sequence of {rows} rows does not fit the null page of {page_size} tokens")
    positions = list(range(rows))
    return dataclasses.replace(
        batch,
        input_ids=batch.input_ids + [0] * (rows * dummies),
        positions=batch.positions + positions * dummies,
        q_lens=batch.q_lens + [rows] * dummies,
        kv_lens=batch.kv_lens + [rows] * dummies,
        slot_mapping=batch.slot_mapping + [null_page * page_size + p for p in positions] * dummies,
        page_tables=batch.page_tables + [[null_page]] * dummies,
    )


def cuda_capture(pool: object) -> Capture:
    """Capture on the current CUDA device into the shared memory `pool`, after one warm-up run on a side
    stream (as torch.cuda.graph requires)."""

    def capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph.replay, out

    return capture


@dataclasses.dataclass
class _Graph:
    inputs: dict[str, torch.Tensor]  # the persistent buffers the captured forward reads
    replay: Callable[[], None]
    out: torch.Tensor  # the persistent output the replay writes


class StepGraphs:
    """Captured forwards per (entries, rows per entry) for one model and KV cache.

    `run` copies a padded step's uploaded metadata into the graph's persistent buffers and replays it,
    capturing on first use. A forward over another model object or KV cache (released and resumed)
    drops every graph first: they point into memory that is gone."""

    def __init__(self, max_entries: int, table_width: int, max_seqlen_k: int, capture: Capture):
        self.buckets = batch_buckets(max_entries)
        self.table_width = table_width  # page-table columns of a graphed step
        self.max_seqlen_k = max_seqlen_k
        self.capture = capture
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._owners: list[weakref.ref] = []  # the model and KV cache the graphs were captured over
        self.replays = 0

    def bucket(self, entries: int) -> int | None:
        return next((b for b in self.buckets if b >= entries), None)

    def clear(self) -> None:
        self._graphs.clear()

    def run(self, key: tuple[int, int], step: dict[str, torch.Tensor], meta: AttentionMetadata, forward: Forward,
            owners: tuple[object, ...]) -> torch.Tensor:
        """The hidden states of a padded step ([entries * rows, hidden], a persistent tensor the next
        replay overwrites). `step` holds the uploaded arrays `forward` reads, `meta` views of them;
        `owners` the objects whose memory the forward reads and writes (model, KV cache)."""
        if len(self._owners) != len(owners) or any(ref() is not o for ref, o in zip(self._owners, owners)):
            self.clear()
            self._owners = [weakref.ref(o) for o in owners]
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(key, step, meta, forward)
        else:
            for name, value in step.items():
                graph.inputs[name].copy_(value, non_blocking=True)
        graph.replay()
        self.replays += 1
        return graph.out

    def _capture(self, key: tuple[int, int], step: dict[str, torch.Tensor], meta: AttentionMetadata,
                 forward: Forward) -> _Graph:
        inputs = {name: value.clone() for name, value in step.items()}
        plan = dataclasses.replace(meta.plan, scalars={**meta.plan.scalars, "max_seqlen_k": self.max_seqlen_k})
        static = dataclasses.replace(
            meta, positions=inputs["positions"], slot_mapping=inputs["slot_mapping"],
            page_tables=inputs["page_tables"].view(meta.page_tables.shape), plan=plan, extra=None,
            planned={name: inputs[f"plan.{name}"] for name in plan.arrays})

        def captured() -> torch.Tensor:
            static.extra = None
            return forward(inputs, static)

        replay, out = self.capture(captured)
        log.info("captured a CUDA graph for %d entries of %d rows", *key)
        return _Graph(inputs, replay, out)
