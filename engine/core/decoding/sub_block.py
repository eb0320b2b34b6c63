"""Shifted sub-block decoding (Fast-dLLM v2): the logits of row i-1 propose token i, and a block is
decoded sub-block by sub-block, left to right.

Blocks are [kB, (k+1)B) as for block diffusion; sub-blocks of a block are [kB + sS, kB + (s+1)S).
Two kinds of step:

- *Inherit*: when a block's first position kB is generated, it is the argmax of row kB-1 of the
  forward over x[:kB]. That forward is the prompt prefill (P % B == 0) or the forward that commits
  the previous block's final tokens, so the inherited token costs no forward of its own: the commit
  forward is the step that reveals it (argmax even when sampling; its logprob comes from row kB-1).
- *Sub-block step*: a forward over x[:(k+1)B] (the block with its masks; a partial prompt block
  attends to its own masks). Each still-masked position i of the current sub-block (the first one
  that holds a mask) proposes the pick of row i-1; every candidate with probability strictly above
  the threshold is revealed, else the single most confident one (ties: the lower position).

Every step reveals at least one token, so the step counter behind `step_map` rises on every step;
an inherited token has its own value, below the rest of its block. The block bookkeeping (opening
blocks, writing tokens, finality) is block diffusion's.
"""

from __future__ import annotations

from configs import EngineConfig, GenerationConfig
from engine.core.decoding.base import PickedRows
from engine.core.decoding.block_diffusion import BlockDiffusionDecoding
from engine.core.decoding.rules import DecodingRule, StepResult, write_tokens
from engine.core.decoding.unmasking import above_threshold_or_best
from engine.core.sequence import Sequence
from engine.core.step_plan import Feed
from engine.model.spec import ModelSpec


class SubBlockDecoding(BlockDiffusionDecoding):
    """Decodes with `low_confidence_dynamic` only (the knob table's `sub_block` rules): its own reveal
    step replaces the rule's choice; the rule's finality and block end (reveal-only) are kept."""

    paradigm = "sub_block"
    row_shift = 1  # row p proposes token p + 1

    def __init__(self, block_length: int, sub_block_length: int, mask_id: int):
        if sub_block_length < 1 or block_length % sub_block_length:
            raise ValueError(f"dllm_sub_block_length={sub_block_length} must be >= 1 and divide the block "
                             f"length {block_length}")
        super().__init__(block_length, mask_id, commit_fusion=False)
        self.sub_block_length = sub_block_length

    @classmethod
    def from_config(cls, config: EngineConfig, spec: ModelSpec, mask_id: int) -> SubBlockDecoding:
        """The strategy of an engine config whose `dllm_block_length` is resolved (its knobs were checked
        against the paradigm when the engine was built)."""
        return cls(config.dllm_block_length, config.dllm_sub_block_length, mask_id)

    @staticmethod
    def _inheriting(seq: Sequence) -> bool:
        """The block's first position is generated and not revealed yet (its token is inherited)."""
        block = seq.state
        return bool(block.masked) and block.masked[0] == block.start

    def _current_sub_block(self, seq: Sequence) -> list[int]:
        """The masked positions of the leftmost sub-block that still holds a mask."""
        masked, s = seq.state.masked, self.sub_block_length
        first = masked[0] - (masked[0] - seq.state.start) % s
        return [p for p in masked if p < first + s]

    def plan_feeds(self, seqs: list[Sequence]) -> list[Feed]:
        """The block with its masks, or -- when its first token is inherited -- the tokens before it (the
        prefill, or the commit of the previous block, whose last row picks that token)."""
        window = 2 * self.block_length
        return [(seq.state.start if self._inheriting(seq) else seq.state.end, True,
                 seq.state.end - seq.num_computed <= window, seq.state.start) for seq in seqs]

    def cacheable_prefix(self, seq: Sequence) -> int:
        # an inherited token needs row kB-1 computed in this forward
        return seq.state.start - 1 if self._inheriting(seq) else seq.state.start

    def sample_positions(self, seq: Sequence, end: int) -> list[int]:
        if self._inheriting(seq):
            return [seq.state.start - 1]
        block = seq.state
        current = self._current_sub_block(seq)
        if block.read_left == 1:  # a read's last step reveals every template slot of the block too
            current = [p for p in block.masked if p <= current[-1] or p < block.read_end]
        return [p - 1 for p in current]

    def row_params(self, seq: Sequence) -> GenerationConfig:
        params = seq.params
        if self._inheriting(seq) and not params.is_greedy:  # the inherited token is the argmax
            return params.model_copy(update={"do_sample": False})
        return params

    def write_step(self, seq: Sequence, rows: PickedRows, rule: DecodingRule) -> StepResult:
        """The inherited token, or the current sub-block's candidates above the threshold (else its most
        confident one); the rule is `low_confidence_dynamic`, whose threshold this reads, and whose finality
        and block end (reveal-only) the step keeps."""
        block = seq.state
        if self._inheriting(seq):
            chosen = [0]
        elif block.read_step():  # a read's last step: every position sampled (its template slots)
            chosen = list(range(len(rows.positions)))
        else:
            chosen = above_threshold_or_best(rows.confidence, seq.state.settings.confidence_threshold)
        seq.step_counter += 1
        block.step_index += 1
        revealed = write_tokens(seq, rows.positions, rows, chosen, shift=1)
        written = {seq.prompt_len + g for g in revealed}
        block.masked = [p for p in block.masked if p not in written]
        return revealed, rule.num_final(seq), rule.block_done(seq)
