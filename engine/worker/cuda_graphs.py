"""CUDA graphs for every step, keyed by the step's padded token count.

A graph-safe attention backend (`triton`) launches a grid fixed by a step's token count once its plan
is padded, whatever rows the step carries: prefill chunks, denoising blocks, a commit fused with the
next block's first step, decode rows, scored rows, all mixed. So a step of T tokens is padded to the
next bucket of a fixed ladder: one dummy sequence takes the padding rows (all at position 0, one key
long, its only page the reserved null page, which nothing else reads or writes) and the backend pads
its tile list to the bucket's bound (`AttentionBackend.tiles_for`). The graph captured for a bucket on
its first step is replayed from then on: a step copies its uploaded arrays (token ids, positions,
slots, the backend's plan) into the graph's persistent buffers, and its page tables into the top-left
corner of one persistent [rows x columns] table that every graph reads. Only the columns the step uses
travel: the kernel reads no column past a sequence's keys, so what a step uploads does not grow with
`max_model_len`. A step over the largest bucket, with more sequences than the table has rows, or with a
table wider than its columns runs eagerly. KV page copies run before the replay and scored rows are
read from the graph's output, so neither keeps a step from its graph. Graphs run on one GPU.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable

import numpy as np
import torch

from engine.worker.forward_batch import ForwardBatch
from ops.attention import AttentionMetadata

log = logging.getLogger(__name__)

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
                 6144, 8192)

# capture(fn) -> (replay, out): records `fn` (which returns one tensor) so that `replay()` recomputes
# `out` in place from whatever the inputs `fn` read hold then
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]
Forward = Callable[[dict[str, torch.Tensor], AttentionMetadata], torch.Tensor]


def pad_tokens(batch: ForwardBatch, tokens: int, null_page: int, page_size: int) -> ForwardBatch:
    """`batch` padded to `tokens` rows by one dummy sequence (none when it has that many already): token 0
    at position 0 in every row, one key long, reading and writing slot 0 of `null_page` alone. The real
    rows keep their indices, so `sample_rows` and `score_rows` are unchanged. Its page table row
    (`null_page` alone) is not added to `page_tables`: the upload writes it after the others
    (`step_upload.upload_step`), which spares a copy of the step's largest field."""
    n = tokens - len(batch.input_ids)
    if n < 0:
        raise ValueError(f"a step of {len(batch.input_ids)} tokens does not fit a graph of {tokens}")
    if n == 0:
        return batch
    return dataclasses.replace(
        batch,
        input_ids=batch.input_ids + [0] * n,
        positions=np.concatenate([batch.positions, np.zeros(n, dtype=np.int64)]),
        q_lens=batch.q_lens + [n],
        kv_lens=batch.kv_lens + [1],
        slot_mapping=np.concatenate([batch.slot_mapping, np.full(n, null_page * page_size, dtype=np.int64)]),
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
    inputs: dict[str, torch.Tensor]  # the persistent buffers the captured forward reads, by uploaded array
    replay: Callable[[], None]
    out: torch.Tensor  # the persistent output the replay writes


class StepGraphs:
    """Captured forwards per token bucket for one model and KV cache.

    `run` copies a padded step's uploaded arrays into the graph's persistent buffers (and its page tables
    into the shared table) and replays it, capturing on first use. A forward over another model object
    or KV cache (released and resumed) drops every graph first: they point into memory that is gone."""

    def __init__(self, max_seqs: int, table_width: int, capture: Capture, max_tokens: int = TOKEN_BUCKETS[-1]):
        self.buckets = [b for b in TOKEN_BUCKETS if b < max_tokens] + [max_tokens]
        self.max_seqs = max_seqs  # rows of the shared page table: the most sequences of a graphed step
        self.table_width = table_width  # its columns: the most pages of one sequence
        self.capture = capture
        self._graphs: dict[int, _Graph] = {}
        self._tables: torch.Tensor | None = None  # [max_seqs, table_width] int64, read by every graph
        self._owners: list[weakref.ref] = []  # the model and KV cache the graphs were captured over
        self.replays = 0
        self.captures = 0

    def bucket(self, tokens: int, seqs: int, width: int) -> int | None:
        """The token bucket a step of `tokens` rows over `seqs` sequences, the widest with `width` pages,
        replays; None: it runs eagerly. A row of the table is kept for the padding sequence."""
        if seqs + 1 > self.max_seqs or width > self.table_width:
            return None
        return next((b for b in self.buckets if b >= tokens), None)

    def clear(self) -> None:
        self._graphs.clear()
        self._tables = None

    def run(self, bucket: int, step: dict[str, torch.Tensor], meta: AttentionMetadata, forward: Forward,
            owners: tuple[object, ...]) -> torch.Tensor:
        """The hidden states of a step padded to `bucket` tokens ([bucket, hidden], a persistent tensor the
        next replay overwrites). `step` holds the uploaded arrays `forward` reads (every one of a size
        fixed by the bucket), `meta` views of them and the step's page tables; `owners` the objects whose
        memory the forward reads and writes (model, KV cache)."""
        if len(self._owners) != len(owners) or any(ref() is not o for ref, o in zip(self._owners, owners)):
            self.clear()
            self._owners = [weakref.ref(o) for o in owners]
        if self._tables is None:
            self._tables = torch.zeros(self.max_seqs, self.table_width, dtype=torch.long,
                                       device=meta.page_tables.device)
        seqs, width = meta.page_tables.shape
        self._tables[:seqs, :width].copy_(meta.page_tables, non_blocking=True)
        graph = self._graphs.get(bucket)
        if graph is None:
            graph = self._graphs[bucket] = self._capture(bucket, step, meta, forward)
        else:
            for name, value in step.items():
                buffer = graph.inputs[name]
                if buffer.shape != value.shape:
                    raise RuntimeError(f"the graph of {bucket} tokens holds {name} of {tuple(buffer.shape)}, "
                                       f"this step uploaded {tuple(value.shape)}")
                buffer.copy_(value, non_blocking=True)
        graph.replay()
        self.replays += 1
        return graph.out

    def _capture(self, bucket: int, step: dict[str, torch.Tensor], meta: AttentionMetadata, forward: Forward
                 ) -> _Graph:
        inputs = {name: value.clone() for name, value in step.items()}
        static = dataclasses.replace(
            meta, positions=inputs["positions"], slot_mapping=inputs["slot_mapping"], page_tables=self._tables,
            extra=None, planned={name: inputs[f"plan.{name}"] for name in meta.plan.arrays})

        def captured() -> torch.Tensor:
            static.extra = None
            return forward(inputs, static)

        replay, out = self.capture(captured)
        self.captures += 1
        log.info("captured a CUDA graph for steps of up to %d tokens", bucket)
        return _Graph(inputs, replay, out)
