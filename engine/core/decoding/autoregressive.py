"""Autoregressive decoding: feed everything not yet computed, sample one token from the last row.

Typed decisions (`engine.core.decisions`): a template's pinned position is a forced token (teacher
forcing: its logprob is the model's for it in that row), a slot is sampled from its allowed set; a
read is the template decoded greedily, each slot's label logprobs read at its row."""

from __future__ import annotations

from configs import EngineConfig, GenerationConfig
from engine.core.decisions import Decisions
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

    def check_decisions(self, params: GenerationConfig, settings: None, decisions: Decisions) -> None:
        """Templates, allowed sets and reads are all served: nothing to refuse."""

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
        return [(n, seq.params.max_new_tokens > 0, n - seq.num_computed <= 1, n) for seq in seqs
                for n in (len(seq.tokens),)]

    def row_group(self, sl: SampleSlice) -> RowGroup:
        seq, params = sl.seq, sl.seq.params
        g = sl.positions[0] + 1 - seq.prompt_len  # a causal LM's logits at p decide generated token p + 1
        floor = params.min_new_tokens
        group = RowGroup(params, seq.seed, seq.num_draws,
                         sorted(seq.penalty_ids) if params.repetition_penalty != 1.0 else [],
                         [g < floor] if floor else [], seq.stop_ids)
        decisions = seq.decisions
        if decisions is not None:
            if decisions.pinned(g) is not None:  # forced: the row's logits give the pinned token's logprob
                group.want_logits = params.logprobs is not None
            elif decisions.has_sets:
                group.allowed = [decisions.allowed(g)]
        return group

    def apply(self, picked: list[tuple[Sequence, PickedRows]], finalize: Finalize
              ) -> list[tuple[Sequence, Exception]]:
        """Append each sequence's token; it is final at once."""
        failed = []
        for seq, rows in picked:
            try:
                seq.num_draws += 1
                token, entry = rows.tokens[0], rows.logprobs[0]
                decisions, g = seq.decisions, len(seq.tokens) - seq.prompt_len
                if decisions is not None:
                    token, entry = self._decided(decisions, g, rows, token, entry)
                seq.tokens += (token,)
                seq.out_steps += (None,)
                seq.out_block_steps += (None,)
                seq.out_logprobs += (entry,)
                if seq.params.repetition_penalty != 1.0:  # the only reader of the tokens seen
                    seq.penalty_ids.add(token)
                finalize(seq, [g], g + 1)
            except Exception as e:  # noqa: BLE001 - ends this request only
                failed.append((seq, e))
        return failed

    @staticmethod
    def _decided(decisions: Decisions, g: int, rows: PickedRows, token: int, entry: dict | None
                 ) -> tuple[int, dict | None]:
        """The token at generated index g under the request's decisions: the pinned one (its logprob
        read from the row), or the pick, whose allowed set's mass is recorded."""
        pinned = decisions.pinned(g)
        if pinned is not None:
            return pinned, rows.logprob_of([0], [pinned])[0] if rows.logprob_of is not None else None
        if rows.label_mass is not None:
            decisions.note_mass(g, rows.label_mass[0])
        return token, entry
