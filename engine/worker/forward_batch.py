"""What one forward takes and gives back: plain data, the same for every tensor-parallel rank.

A leaf module (torch only for the logits' type, numpy for the page tables, configs for the sampling
parameters of scored rows) so the scheduler side can build batches without importing the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from configs import GenerationConfig

if TYPE_CHECKING:
    import torch


@dataclass
class ForwardBatch:
    """One forward over the step's sequences, laid out flat: sequence after sequence, each one's query
    rows in position order (`engine.core.batch.build_batch` makes it from the step's plan)."""

    input_ids: list[int]  # the token fed at every query row
    # the absolute position of every query row (int64; `build_batch` derives it from q_lens and kv_lens)
    positions: np.ndarray | list[int]
    q_lens: list[int]  # per sequence: its query rows in this forward
    kv_lens: list[int]  # per sequence: the keys its queries see (its cached tokens plus its rows)
    # per query row: the flat cache slot its K/V are written to (int64; derived from the page tables;
    # empty for a network whose layer groups keep tables of their own)
    slot_mapping: np.ndarray | list[int]
    # [sequences, width] int64: per sequence its pages, read up to its kv_lens; `width` is the pages the
    # longest one reads, later entries 0 (`page_table_array` makes one from lists)
    page_tables: np.ndarray
    sample_rows: list[int] = field(default_factory=list)  # query rows whose logits pick tokens, in order
    score_rows: list[int] = field(default_factory=list)  # query rows whose logits score input tokens
    score_targets: list[int] = field(default_factory=list)  # per score row: the token it scores
    score_top_k: int = 0  # top logprobs per score row (the most any scoring request asked for)
    # processing of scored rows into the sampler's distribution (processed logprobs modes)
    score_penalties: list[RowPenalty] = field(default_factory=list)
    score_filters: list[RowFilter] = field(default_factory=list)
    score_entropy: bool = False  # also the entropy of each scored row's distribution
    # K/V slots copied (every layer) before the forward: src -> dst
    kv_copy_src: list[int] = field(default_factory=list)
    kv_copy_dst: list[int] = field(default_factory=list)
    # Encoder / canvas passes (a network with layer groups, e.g. sliding and full attention): per
    # sequence "encode" (causal, writes its K/V) or "canvas" (bidirectional over itself, reads the
    # kv_lens - q_lens committed tokens, writes nothing). Empty: every sequence is an ordinary pass.
    pass_kinds: list[str] = field(default_factory=list)
    # per layer group, per sequence: its page table in that group's pool (replaces `page_tables`)
    group_page_tables: dict[str, list[list[int]]] = field(default_factory=dict)
    # per sequence: the self-conditioning kept under this key that its canvas pass reads (None: none)
    conditioning_keys: list[str | None] = field(default_factory=list)
    # per sequence: keep (key, temperature): this canvas pass's logits / temperature, as next step's input
    keep_conditioning: list[tuple[str, float] | None] = field(default_factory=list)
    drop_conditioning: list[str] = field(default_factory=list)  # kept self-conditioning no longer needed
    # per sequence: the canvas rows whose self-conditioning input is zero (a template's pinned positions)
    zero_conditioning: list[list[int] | None] = field(default_factory=list)
    # Per sequence, for a strategy that names each sequence's attention (`MASK_KINDS`): "causal" (row p
    # sees the keys at positions <= p) or "bidirectional" (every row sees every key below its kv_lens,
    # unmasked: a block denoised over its causal prefix; the block's K/V this writes are not final, a
    # causal forward rewrites them before they are). Empty: every sequence has the engine's mask (causal,
    # or block-causal with the engine's block length); set: the engine's block length plays no part.
    mask_kinds: list[str] = field(default_factory=list)
    # per sequence: its rows run the network's draft adapter (self-speculation's draft passes; a network
    # with one). Empty, or no True: none do.
    draft_rows: list[bool] = field(default_factory=list)


NO_TABLES = np.zeros((0, 0), dtype=np.int64)  # a batch without page tables (or not built yet)


def page_table_array(tables: list[list[int]]) -> np.ndarray:
    """Page tables given as lists, as a batch's array: each padded with page 0 to the longest."""
    out = np.zeros((len(tables), max(map(len, tables), default=0)), dtype=np.int64)
    for row, pages in zip(out, tables):
        row[: len(pages)] = pages
    return out


MASK_CAUSAL, MASK_BIDIRECTIONAL = "causal", "bidirectional"
MASK_KINDS = (MASK_CAUSAL, MASK_BIDIRECTIONAL)


def bidirectional_rows(batch: ForwardBatch) -> list[bool] | None:
    """Per sequence whether its rows are bidirectional, when the batch names its sequences' masks (None:
    it does not); a ValueError names a kind that is none of `MASK_KINDS`."""
    if not batch.mask_kinds:
        return None
    unknown = set(batch.mask_kinds) - set(MASK_KINDS)
    if unknown:
        raise ValueError(f"mask kind {sorted(unknown)[0]!r} is none of {', '.join(MASK_KINDS)}")
    return [kind == MASK_BIDIRECTIONAL for kind in batch.mask_kinds]


@dataclass
class RowPenalty:
    """Scored rows [first, first + len(suppress)) get the repetition penalty over `penalty_ids` and,
    where `suppress` says so, the stop ids masked (as the sampler does before `min_new_tokens`)."""

    first: int
    repetition_penalty: float
    penalty_ids: list[int]
    suppress: list[bool]
    stop_ids: list[int]


@dataclass
class RowFilter:
    """Scored rows [first, first + count) are filtered for sampling under `params` (temperature,
    top-k, top-p, min-p), after any penalty."""

    first: int
    count: int
    params: GenerationConfig


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [len(sample_rows), vocab] float32
    score_values: list[float] = field(default_factory=list)
    score_top: list[list[tuple[float, int]]] | None = None
    score_entropy: list[float] | None = None
