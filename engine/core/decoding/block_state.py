"""A block-diffusion request's decoding state (its `Sequence.state`): the block being denoised and
the request's resolved knobs. Owned by the block strategies (`block_diffusion`, `sub_block`) and the
unmasking rules they run; nothing outside them reads it."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.decoding.unmasking import UnmaskingSettings


@dataclass(slots=True)  # one is made per block of every request
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
    # typed decisions: the block's pinned positions (absolute; pre-revealed, never candidates), and in a
    # read's last block, its steps left (its last step reveals every slot below `read_end` at once)
    pinned: frozenset[int] = frozenset()
    read_left: int | None = None
    read_end: int = 0

    def read_step(self) -> bool:
        """Count a denoising step of the block; True when it is the read's last (it reveals every slot)."""
        if self.read_left is None:
            return False
        self.read_left -= 1
        return self.read_left <= 0
