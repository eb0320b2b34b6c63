"""The step's typed plan: which sequences the next forward runs, which rows each feeds, and why.

The scheduler makes one `ScheduledSeq` per sequence of the step; `build_batch` lays their rows out in
the `ForwardBatch` and records a `SampleSlice` per sequence whose rows pick tokens. The decoding
strategy then sees the step as three calls over all its sequences (`engine.core.decoding.base`):
which positions each samples (`sample_positions_of`), how the sampler treats each one's rows
(`row_groups`) and what the picks change (`apply`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.sequence import Sequence
    from engine.core.trajectory_plan import View


#: A strategy's plan of one sequence's next forward: (end of the tokens to feed, whether the forward that
#: reaches it samples, whether the sequence is past its prefill, the leading tokens whose K/V are final
#: after that sampling forward -- a denoised block's or canvas' start, or the end for AR). A forward
#: cut short by the prefill budget samples nothing and leaves its K/V final up to its end.
Feed = tuple[int, bool, bool, int]


class RowKind(enum.Enum):
    """Why a sequence's rows are in the forward."""

    PREFILL = "prefill"  # a chunk of prompt (or recomputed) tokens; samples only when it reaches the target
    DECODE = "decode"  # autoregressive: the newest token, whose logits pick the next one
    DENOISE = "denoise"  # a diffusion block (or a canvas) refined: its positions' logits pick tokens
    COMMIT = "commit"  # the final K/V of a finished block or canvas, nothing sampled
    SCORE_VIEWS = "score_views"  # trajectory scoring: the denoising steps of a rollout replayed as views


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence of the step."""

    seq: Sequence
    start: int  # first token fed in this forward
    end: int  # one past the last token fed
    sample: bool  # whether this forward's logits pick tokens for the sequence
    decoding: bool = False  # past its prefill (the scheduler charged its rows to no prefill budget)
    kv_final: int = 0  # when it samples: the leading tokens whose K/V are final after this forward
    views: list[View] | None = None  # trajectory scoring: the views this forward runs (start == end)
    score_first: int = 0  # views: the first of their score rows in the batch

    @property
    def num_rows(self) -> int:
        """Query rows this item adds to the forward."""
        if self.views is None:
            return self.end - self.start
        return sum(len(v.tokens) for v in self.views)

    @property
    def kind(self) -> RowKind:
        """Why its rows are fed (for traces and debugging; the step itself reads the fields above)."""
        if self.views is not None:
            return RowKind.SCORE_VIEWS
        if not self.decoding:
            return RowKind.PREFILL
        if not self.sample:
            return RowKind.COMMIT
        return RowKind.DECODE if self.end - self.start == 1 else RowKind.DENOISE


@dataclass(slots=True)
class SampleSlice:
    """The logits rows [first, end) pick tokens for `positions` of `seq` (one row each)."""

    seq: Sequence
    first: int
    end: int
    positions: list[int]
