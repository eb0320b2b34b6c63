"""Block diffusion (SDAR): denoise one block of B positions at a time under block-causal attention.

Positions are absolute from 0 and blocks are [kB, (k+1)B); the prompt's last partial block is
completed by the first generated positions. Every generated position starts as the mask token.
A step is one forward whose logits at the block's masked positions propose a token each; the
request's unmasking rule (`engine.core.decoding.unmasking`) picks which of them to reveal. Revealed
tokens are never re-masked and are fed back as themselves.

A sequence always feeds `[num_computed, current block end)`: its prompt prefill's last chunk is
the first denoising step of the first block, and the forward that writes a finished block's final
K/V also runs the next block's first step (commit fusion), so a block costs exactly its denoising
steps. With fusion off, a separate forward commits the finished block first.

`step_map`: the request's step counter starts at 0 and grows by one on every step (each step
reveals at least one token); a token's value is the counter of the step that revealed it.
`block_step_map`: the 1-based index of that step within the token's own block.

Token editing (a rule of `engine.core.decoding.editing`, e.g. `joint_threshold`) generalises this:
every generated position of the block is sampled each step, a step may also rewrite revealed
tokens, and the block ends only on a step that writes nothing (or past its post-edit budget). So a
block's tokens are final only when it ends: `num_final` stops at the block's start until then, the
stop rule sees only final tokens, and a stop id written inside the block bounds nothing by itself.
`step_map` holds the step of each token's last write, its logprob that step's. The forward of a
step that writes nothing fed exactly the final tokens, so its K/V are kept: the block commits without
a forward of its own. A block that spends its post-edit budget ends with that step's writes (the next
step could only end it) and commits like a block after its last reveal, in the next block's first
forward: no block spends a forward only to end or to persist.
"""

from __future__ import annotations

from configs import GenerationConfig
from engine.core.decoding.base import DecodingStrategy, PickedRows
from engine.core.decoding.editing import EDITING_FIELDS, EDITING_RULES, BlockRows, budget_spent
from engine.core.decoding.unmasking import NEEDS_ENTROPY, RULES, UnmaskingSettings, choose_rows, tokens_this_step
from engine.core.sequence import DLLMBlock, Sequence
from engine.errors import RequestError


def step_seed(seq: Sequence) -> int:
    """The seed of a rule's draws at the sequence's current step: its seed mixed with its step counter."""
    return (seq.seed * 1_000_003 + seq.step_counter) & ((1 << 63) - 1)


class BlockDiffusionDecoding(DecodingStrategy):
    def __init__(self, block_length: int, mask_id: int, commit_fusion: bool = True):
        self.block_length = block_length
        self.mask_id = mask_id
        self.commit_fusion = commit_fusion
        self.chunk_alignment = block_length

    def check_request(self, params: GenerationConfig, settings: UnmaskingSettings) -> None:
        if settings.strategy in EDITING_RULES:
            if params.dllm_trajectory is not None:
                raise RequestError(f"dllm_trajectory: a rollout decoded with token editing ({settings.strategy}) "
                                   "cannot be scored: its tokens' inputs changed after they were written; score "
                                   "rollouts decoded without edits", "dllm_trajectory")
            return
        if settings.strategy not in RULES:
            raise RequestError(f"dllm_unmasking_strategy={settings.strategy!r} does not apply to this model; "
                               f"use one of {', '.join([*RULES, *EDITING_RULES])}", "dllm_unmasking_strategy")
        for name in EDITING_FIELDS:
            if getattr(params, name) is not None:
                raise RequestError(f"{name} applies to token editing only: set dllm_unmasking_strategy to "
                                   f"{' or '.join(map(repr, EDITING_RULES))}, or leave {name} unset", name)

    @staticmethod
    def edits(seq: Sequence) -> bool:
        """Whether the sequence decodes with a token-editing rule."""
        return seq.unmasking.strategy in EDITING_RULES

    def start(self, seq: Sequence) -> None:
        seq.stop_bound = seq.params.max_new_tokens
        self._open_block(seq)

    def _open_block(self, seq: Sequence) -> None:
        """Append the next block's positions as masks (the first one completes the prompt's block)."""
        b = self.block_length
        start = len(seq.tokens)
        end = (start // b + 1) * b
        n = end - start
        seq.tokens += [self.mask_id] * n
        seq.out_steps += [None] * n
        seq.out_block_steps += [None] * n
        seq.out_logprobs += [None] * n
        seq.block = DLLMBlock(start=start - start % b, end=end, masked=list(range(start, end)), num_masked_at_start=n)

    def feed_target(self, seq: Sequence) -> tuple[int, bool]:
        block = seq.block
        if not self.commit_fusion and seq.num_computed < block.start and seq.step_counter > 0:
            return block.start, False  # unfused commit forward of the finished block
        return block.end, True

    def cacheable_prefix(self, seq: Sequence) -> int:
        return seq.block.start  # committed tokens only

    def is_decoding(self, seq: Sequence) -> bool:
        # a block being denoised, with at most the commit of the previous one
        return seq.block.end - seq.num_computed <= 2 * self.block_length

    def sample_positions(self, seq: Sequence, end: int) -> list[int]:
        if self.edits(seq):  # every generated position of the block: revealed ones may be rewritten
            return list(range(max(seq.block.start, seq.prompt_len), seq.block.end))
        return list(seq.block.masked)

    def lowered_logits(self, seq: Sequence, positions: list[int]) -> tuple[float, list[int]] | None:
        """Token editing's λ penalty: at each position but the block's first, the token now at the
        position before it."""
        amount = seq.unmasking.penalty_lambda
        if not amount or not self.edits(seq):
            return None
        return amount, [seq.tokens[p - 1] if p > seq.block.start else -1 for p in positions]

    def token_index(self, seq: Sequence, position: int) -> int:
        return position - seq.prompt_len  # logits at p decide token p (no shift)

    def computed_after(self, seq: Sequence, end: int, sampled: bool) -> int:
        return seq.block.start if sampled else end  # the block being denoised changes until revealed

    def wants_entropy(self, seq: Sequence) -> bool:
        return seq.unmasking.strategy in NEEDS_ENTROPY

    def provisional_writes(self, seq: Sequence) -> bool:
        return self.edits(seq)

    def advance(self, seq: Sequence, rows: PickedRows) -> list[int]:
        if self.edits(seq):
            return self._edit(seq, rows)
        block, settings = seq.block, seq.unmasking
        n = tokens_this_step(block.num_masked_at_start, settings.denoising_steps, block.step_index)
        positions = rows.positions
        chosen = choose_rows(rows.confidence, rows.entropy or [0.0] * len(positions), n, settings, step_seed(seq))
        seq.step_counter += 1
        block.step_index += 1
        revealed = [self.write(seq, positions[i], rows.tokens[i], rows.logprobs[i]) for i in chosen]
        if len(chosen) == len(positions):
            block.masked = []
        else:
            chosen_set = set(chosen)
            block.masked = [p for i, p in enumerate(positions) if i not in chosen_set]
        return revealed

    def _edit(self, seq: Sequence, rows: PickedRows) -> list[int]:
        """One step of a token-editing rule: write what it picks, or end the block."""
        block, positions = seq.block, rows.positions
        masked = [seq.tokens[p] == self.mask_id for p in positions]
        if not any(masked):
            block.post_edit_steps += 1
        view = BlockRows([seq.tokens[p] for p in positions], rows.tokens, rows.confidence, masked)
        writes = EDITING_RULES[seq.unmasking.strategy](view, block.post_edit_steps, seq.unmasking)
        if writes is None:  # this forward fed the final tokens: keep its K/V as the block's commit
            block.ended, block.masked = True, []
            seq.num_computed = max(seq.num_computed, block.end)
            return []
        seq.step_counter += 1
        block.step_index += 1
        written = [self.write(seq, positions[i], rows.tokens[i], rows.logprobs[i], final=False) for i in writes]
        block.masked = [p for p in positions if seq.tokens[p] == self.mask_id]
        if not block.masked and budget_spent(block.post_edit_steps, seq.unmasking):
            # the next step could only end the block: its tokens are final now, and their K/V ride on
            # the next block's first forward (as after a last reveal), which spares that step's forward
            block.ended = True
        return written

    @staticmethod
    def write(seq: Sequence, position: int, token: int, logprob: dict | None, final: bool = True) -> int:
        """Write `token` at `position` in the current step (the counters already advanced); returns its
        generated index. A `final` stop id outside `min_new_tokens` bounds the output (an editing
        rule's writes are not final: the stop rule reads them when their block ends)."""
        g = position - seq.prompt_len
        seq.tokens[position] = token
        seq.out_steps[g] = seq.step_counter
        seq.out_block_steps[g] = seq.block.step_index
        seq.out_logprobs[g] = logprob
        seq.penalty_ids.add(token)
        if final and token in seq.stop_ids and g >= seq.params.min_new_tokens:
            seq.stop_bound = min(seq.stop_bound, g + 1)
        return g

    def num_final(self, seq: Sequence) -> int:
        if self.edits(seq):  # a block's tokens are final when it ends
            block = seq.block
            return max(0, (block.end if block.ended else block.start) - seq.prompt_len)
        n, limit = seq.num_revealed, seq.num_generated_positions
        while n < limit and seq.out_steps[n] is not None:
            n += 1
        seq.num_revealed = n
        return n

    def after_step(self, seq: Sequence) -> None:
        if seq.block.ended if self.edits(seq) else not seq.block.masked:
            self._open_block(seq)
