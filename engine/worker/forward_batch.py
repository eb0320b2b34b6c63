"""What one forward takes and gives back: plain data, the same for every tensor-parallel rank.

A leaf module (torch only for the logits' type) so the scheduler side can build batches without
importing the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class ForwardBatch:
    input_ids: list[int]
    positions: list[int]
    q_lens: list[int]
    kv_lens: list[int]
    slot_mapping: list[int]
    page_tables: list[list[int]]
    sample_rows: list[int] = field(default_factory=list)
    score_rows: list[int] = field(default_factory=list)
    score_targets: list[int] = field(default_factory=list)
    score_top_k: int = 0


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [len(sample_rows), vocab] float32
    score_values: list[float] = field(default_factory=list)
    score_top: list[list[tuple[float, int]]] | None = None
