"""A block-diffusion request's decoding state (its `Sequence.state`): the block being denoised and
the request's resolved knobs. Owned by the block strategies (`block_diffusion`, `sub_block`) and the
unmasking rules they run; nothing outside them reads it."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.decoding.unmasking import UnmaskingSettings


@dataclass
class BlockState:
    """The block being denoised: absolute positions [start, end), and the knobs the request decodes with."""

    settings: UnmaskingSettings
    start: int
    end: int
    masked: list[int]  # absolute positions still masked, ascending
    num_masked_at_start: int
    step_index: int = 0  # the block's own step counter s (0-based)
    post_edit_steps: int = 0  # token editing: steps taken since the block's last mask was revealed
    ended: bool = False  # token editing: a step wrote nothing (or the post-edit budget ran out)
    rule_state: object | None = None  # a rule's own state of the block (insert/delete editing's)
