"""Autoregressive decoding: feed everything not yet computed, sample one token from the last row."""

from __future__ import annotations

from configs import EngineConfig
from engine.core.decoding.base import DecodingStrategy, PickedRows
from engine.core.sequence import Sequence
from engine.model.spec import ModelSpec


class AutoregressiveDecoding(DecodingStrategy):
    needs_confidence = False

    @classmethod
    def from_config(cls, config: EngineConfig, spec: ModelSpec, mask_id: int | None) -> AutoregressiveDecoding:
        return cls()

    def start(self, seq: Sequence) -> None:
        """Nothing to prepare: the prompt is fed, the first token is sampled from its last row."""

    def feed_target(self, seq: Sequence) -> tuple[int, bool]:
        return len(seq.tokens), seq.params.max_new_tokens > 0

    def cacheable_prefix(self, seq: Sequence) -> int:
        limit = len(seq.tokens) - 1  # the newest token must be computed to get logits
        if seq.wants_input_logprobs:
            limit = min(limit, seq.params.logprob_start_len)  # every scored row is computed
        return limit

    def is_decoding(self, seq: Sequence) -> bool:
        return len(seq.tokens) - seq.num_computed <= 1

    def sample_positions(self, seq: Sequence, end: int) -> list[int]:
        return [end - 1]

    def token_index(self, seq: Sequence, position: int) -> int:
        return position + 1 - seq.prompt_len  # causal LM: logits at p predict token p + 1

    def computed_after(self, seq: Sequence, end: int, sampled: bool) -> int:
        return end

    def advance(self, seq: Sequence, rows: PickedRows) -> list[int]:
        token = rows.tokens[0]
        seq.tokens.append(token)
        seq.out_steps.append(None)
        seq.out_block_steps.append(None)
        seq.out_logprobs.append(rows.logprobs[0])
        seq.penalty_ids.add(token)
        return [seq.num_generated_positions - 1]

    def num_final(self, seq: Sequence) -> int:
        return seq.num_generated_positions

    def after_step(self, seq: Sequence) -> None:
        """Nothing to do: the next step feeds the token just sampled."""
