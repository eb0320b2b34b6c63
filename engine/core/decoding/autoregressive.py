"""Autoregressive decoding: feed everything not yet computed, sample one token from the last row."""

from __future__ import annotations

from configs import EngineConfig
from engine.core.decoding.base import DecodingStrategy, Finalize, PickedRows
from engine.core.sampler import RowGroup
from engine.core.sequence import Sequence
from engine.core.step_plan import Feed, SampleSlice
from engine.model.spec import ModelSpec


class AutoregressiveDecoding(DecodingStrategy):
    needs_confidence = False

    @classmethod
    def from_config(cls, config: EngineConfig, spec: ModelSpec, mask_id: int | None) -> AutoregressiveDecoding:
        return cls()

    def start(self, seq: Sequence, settings: None) -> None:
        """Nothing to prepare: the prompt is fed, the first token is sampled from its last row."""

    def cacheable_prefix(self, seq: Sequence) -> int:
        limit = len(seq.tokens) - 1  # the newest token must be computed to get logits
        if seq.wants_input_logprobs:
            limit = min(limit, seq.params.logprob_start_len)  # every scored row is computed
        return limit

    def sample_positions(self, seq: Sequence, end: int) -> list[int]:
        return [end - 1]

    # ---- the step, over all its sequences ------------------------------------------------------
    def plan_feeds(self, seqs: list[Sequence]) -> list[Feed]:
        """Every token not computed yet; the forward that reaches the newest one samples the next."""
        feeds = []
        for seq in seqs:
            n = len(seq.tokens)
            feeds.append((n, seq.params.max_new_tokens > 0, n - seq.num_computed <= 1, n))
        return feeds

    def row_groups(self, slices: list[SampleSlice]) -> list[RowGroup]:
        groups = []
        for sl in slices:
            seq = sl.seq
            params = seq.params
            floor = params.min_new_tokens  # a causal LM's logits at p decide generated token p + 1 - prompt_len
            groups.append(RowGroup(params, seq.seed, seq.num_draws,
                                   sorted(seq.penalty_ids) if params.repetition_penalty != 1.0 else [],
                                   [sl.positions[0] + 1 - seq.prompt_len < floor] if floor else [], seq.stop_ids))
        return groups

    def apply(self, picked: list[tuple[Sequence, PickedRows]], finalize: Finalize
              ) -> list[tuple[Sequence, Exception]]:
        """Append each sequence's token; it is final at once."""
        failed = []
        for seq, rows in picked:
            try:
                seq.num_draws += 1
                token = rows.tokens[0]
                seq.tokens += (token,)
                seq.out_steps += (None,)
                seq.out_block_steps += (None,)
                seq.out_logprobs += (rows.logprobs[0],)
                if seq.params.repetition_penalty != 1.0:  # the only reader of the tokens seen
                    seq.penalty_ids.add(token)
                generated = len(seq.tokens) - seq.prompt_len
                finalize(seq, [generated - 1], generated)
            except Exception as e:  # noqa: BLE001 - ends this request only
                failed.append((seq, e))
        return failed
