"""A step's integer metadata onto the device in one copy.

`upload_step` assembles what a forward reads from its `ForwardBatch` -- padded to a CUDA graph's
token bucket where one replays -- with the attention backend's plan, and uploads it: every list a
forward needs (token ids, positions, cache slots, the page tables' array, rows to sample, the
attention backend's planned arrays) is packed on the host into one int64 tensor and copied once.
On CUDA the host side is a persistent pinned buffer and the copy is non-blocking into a persistent
device buffer, so the host goes on to queue the forward while the copy runs; the arrays are views
of that device buffer. Before the pinned buffer is written again, the host waits for the event
recorded after the previous copy (it has long finished by then: it ran at the start of the
previous forward, which the overlap schedule may still be running).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np
import torch

from engine.worker.cuda_graphs import pad_tokens
from engine.worker.forward_batch import ForwardBatch, bidirectional_rows
from ops.attention import AttentionBackend, AttentionMetadata, table_lists


@dataclass(frozen=True)
class GraphPadding:
    """How a step that replays a CUDA graph is padded (engine.worker.cuda_graphs)."""

    tokens: int  # the graph's token bucket: the rows the step is padded to
    max_seqs: int  # the most sequences of a graphed step: the backend's tiles are padded for these
    null_page: int  # the KV page the padding rows alone read and write


def upload_step(batch: ForwardBatch, backend: AttentionBackend, uploader: StepUploader, device: torch.device,
                page_size: int, block_length: int | None, padding: GraphPadding | None
                ) -> tuple[dict[str, torch.Tensor], AttentionMetadata]:
    """The step's arrays on `device` (token ids, positions, slots, page tables, rows to sample and the
    backend's planned arrays, in one copy) and the attention metadata viewing them. Page tables travel
    at the width the step uses, whatever `max_model_len` is."""
    fed = batch if padding is None else pad_tokens(batch, padding.tokens, padding.null_page, page_size)
    tables, rows = batch.page_tables, len(fed.q_lens)
    width = tables.shape[1]
    # the padding sequence's table row ([null_page, 0, ...]) is uploaded right after the others, so
    # that the tables -- the step's largest field -- are never copied into a padded array on the host
    null_row = [padding.null_page] + [0] * (width - 1) if rows > len(batch.q_lens) else []
    bidirectional = bidirectional_rows(batch)
    if bidirectional is not None:  # the batch names every sequence's mask: the others are causal
        block_length = None
        bidirectional += [False] * (len(fed.q_lens) - len(bidirectional))  # the padding sequence
    pad_tiles = None if padding is None else backend.tiles_for(padding.tokens, padding.max_seqs)
    lists = None
    if backend.plans_from_page_tables:
        lists = table_lists(tables.tolist(), batch.kv_lens, page_size) + ([null_row[:1]] if null_row else [])
    plan = backend.plan(fed.q_lens, fed.kv_lens, lists or [], page_size, block_length, pad_tiles, bidirectional)
    step = uploader.upload({
        "input_ids": fed.input_ids, "positions": fed.positions, "slot_mapping": fed.slot_mapping,
        "page_tables": tables, "page_tables.padding": null_row,
        "sample_rows": batch.sample_rows, **{f"plan.{name}": values for name, values in plan.arrays.items()},
    }, device)
    meta = AttentionMetadata(
        q_lens=fed.q_lens,
        kv_lens=fed.kv_lens,
        positions=step["positions"],
        slot_mapping=step["slot_mapping"],
        page_tables=step["page_tables"].as_strided((rows, width), (width, 1)),  # with the padding's row after
        page_size=page_size,
        dllm_block_length=block_length,
        bidirectional=bidirectional,
        page_table_lists=lists,
        plan=plan,
        planned={name: step[f"plan.{name}"] for name in plan.arrays},
    )
    del step["page_tables.padding"]  # read through `meta.page_tables` only
    return step, meta


class StepUploader:
    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._device: torch.Tensor | None = None
        self._for: torch.device | None = None  # the device the buffers were made for
        self._copied: torch.cuda.Event | None = None
        self.uploads = 0  # host->device copies made, for tests and profiles

    def upload(self, fields: dict[str, list[int] | array | np.ndarray], device: torch.device
               ) -> dict[str, torch.Tensor]:
        """`fields` (lists of ints, int64 arrays, or int64 numpy arrays, flattened) as 1-D int64 tensors on
        `device`, in one host->device copy (none on the CPU)."""
        sizes = [values.size if values.__class__ is np.ndarray else len(values) for values in fields.values()]
        n = sum(sizes)
        if device.type == "cpu":
            packed = torch.from_numpy(pack(fields, np.empty(n, dtype=np.int64)))
            return dict(zip(fields, packed.split(sizes), strict=True))
        self.uploads += 1
        if not torch.cuda.is_available():  # a fake CUDA device (tests): no pinned memory, no events, and
            packed = pack(fields, np.empty(n, dtype=np.int64))  # fake mode takes a tensor made from a list
            return dict(zip(fields, torch.tensor(packed.tolist(), device=device).split(sizes), strict=True))
        if self._host is None or self._host.numel() < n or self._for != device:
            size = max(n, 2 * (0 if self._host is None else self._host.numel()), 4096)
            self._host = torch.empty(size, dtype=torch.long, pin_memory=True)
            self._device = torch.empty(size, dtype=torch.long, device=device)
            self._for = device
        elif self._copied is not None:
            self._copied.synchronize()
        pack(fields, self._host[:n].numpy())
        self._device[:n].copy_(self._host[:n], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return dict(zip(fields, self._device[:n].split(sizes), strict=True))


def pack(fields: dict[str, list[int] | array | np.ndarray], out: np.ndarray) -> np.ndarray:
    """Write `fields` one after another into the int64 array `out` (their total length); returns it.
    Consecutive lists are packed in C first (an int64 array, a list at a time: `torch.tensor(list)` took
    ~80 ns an element, `fromlist` is twice as fast as an iterator) and copied in one go; a numpy array
    (the page tables) is copied as it is."""
    run, run_at, offset = array("q"), 0, 0
    for field in fields.values():
        if field.__class__ is np.ndarray:
            if run:
                out[run_at: offset] = np.frombuffer(run, dtype=np.int64)
                run = array("q")
            end = offset + field.size
            out[offset: end] = field.reshape(-1)
            offset = run_at = end
            continue
        if field.__class__ is list:
            run.fromlist(field)
        else:
            run.extend(field)
        offset += len(field)
    if run:
        out[run_at: offset] = np.frombuffer(run, dtype=np.int64)
    return out
