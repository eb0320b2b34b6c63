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
"""

from __future__ import annotations

from configs import GenerationConfig
from engine.core.decoding.base import DecodingStrategy, PickedRows
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
        if settings.strategy not in RULES:
            raise RequestError(f"dllm_unmasking_strategy={settings.strategy!r} does not apply to this model; "
                               f"use one of {', '.join(RULES)}", "dllm_unmasking_strategy")

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
        return list(seq.block.masked)

    def token_index(self, seq: Sequence, position: int) -> int:
        return position - seq.prompt_len  # logits at p decide token p (no shift)

    def computed_after(self, seq: Sequence, end: int, sampled: bool) -> int:
        return seq.block.start if sampled else end  # the block being denoised changes until revealed

    def wants_entropy(self, seq: Sequence) -> bool:
        return seq.unmasking.strategy in NEEDS_ENTROPY

    def advance(self, seq: Sequence, rows: PickedRows) -> list[int]:
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

    @staticmethod
    def write(seq: Sequence, position: int, token: int, logprob: dict | None) -> int:
        """Write `token` at `position` in the current step (the counters already advanced); returns its
        generated index. A stop id outside `min_new_tokens` bounds the output."""
        g = position - seq.prompt_len
        seq.tokens[position] = token
        seq.out_steps[g] = seq.step_counter
        seq.out_block_steps[g] = seq.block.step_index
        seq.out_logprobs[g] = logprob
        seq.penalty_ids.add(token)
        if token in seq.stop_ids and g >= seq.params.min_new_tokens:
            seq.stop_bound = min(seq.stop_bound, g + 1)
        return g

    def num_final(self, seq: Sequence) -> int:
        n, limit = seq.num_revealed, seq.num_generated_positions
        while n < limit and seq.out_steps[n] is not None:
            n += 1
        seq.num_revealed = n
        return n

    def after_step(self, seq: Sequence) -> None:
        if not seq.block.masked:
            self._open_block(seq)
