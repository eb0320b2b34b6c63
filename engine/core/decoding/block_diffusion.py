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

What differs between unmasking rules is the rule object's (`engine.core.decoding.rules`): which
positions a step samples, what it does to the logits, which tokens it writes, when they are final
and when the block ends; this strategy calls the request's rule and holds no branch per rule.

Token editing (an `EditRule`, e.g. `joint_threshold`) generalises this:
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

from collections.abc import Callable

from configs import EngineConfig, GenerationConfig
from engine.carrier import StepEvent
from engine.core.decisions import Decisions
from engine.core.decoding.base import DecodingStrategy, Finalize, PickedRows
from engine.core.decoding.block_state import BlockState
from engine.core.decoding.indel import special_ids
from engine.core.decoding.rules import RULES, DecodingRule, StepResult, write_pinned
from engine.core.decoding.unmasking import SpecialIds, UnmaskingSettings
from engine.core.input_processing import check_knobs
from engine.core.sampler import RowGroup
from engine.core.sequence import Sequence
from engine.core.step_plan import Feed, SampleSlice
from engine.errors import RequestError
from engine.model.spec import ModelSpec


class BlockDiffusionDecoding(DecodingStrategy):
    paradigm = "block"
    #: the logits at position p decide position p + row_shift (0: the position itself)
    row_shift = 0
    #: (sequence, its picks, the request's rule) -> the rule's `StepResult`, for a paradigm that decides a
    #: step's writes itself (sub-blocks); None: the request's rule writes the step (`DecodingRule.step`)
    write_step: Callable[[Sequence, PickedRows, DecodingRule], StepResult] | None = None

    def __init__(self, block_length: int, mask_id: int, commit_fusion: bool = True, ids: SpecialIds | None = None):
        self.block_length = block_length
        self.mask_id = mask_id
        self.ids = ids or SpecialIds(mask_id)
        self.commit_fusion = commit_fusion
        self.chunk_alignment = block_length

    @classmethod
    def from_config(cls, config: EngineConfig, spec: ModelSpec, mask_id: int) -> BlockDiffusionDecoding:
        """The strategy of an engine config whose `dllm_block_length` is resolved; ValueError when the
        engine's rule needs a special token the model lacks."""
        ids = special_ids(spec, config, mask_id)
        problem = RULES[config.dllm_unmasking_strategy].missing(ids)
        if problem:
            raise ValueError(problem)
        return cls(config.dllm_block_length, mask_id, config.dllm_commit_fusion, ids)

    def check_request(self, params: GenerationConfig, settings: UnmaskingSettings) -> None:
        check_knobs(params, self.paradigm, settings.strategy)
        rule = RULES[settings.strategy]
        problem = rule.missing(self.ids)
        if problem:
            raise RequestError(problem, "dllm_unmasking_strategy")
        rule.check_request(params)

    def check_decisions(self, params: GenerationConfig, settings: UnmaskingSettings, decisions: Decisions) -> None:
        """Every rule honours templates (what a rule cannot take beside them, e.g. joint_threshold_indel's
        sets and reads, its spec refuses: `check_request`); an editing rule that moves tokens reads its
        DELETE and SPLIT ids as edits, so a template may not pin them."""
        if RULES[settings.strategy].moves_tokens and {self.ids.delete_id, self.ids.split_id} & set(decisions.template):
            raise RequestError("dllm_template pins the model's DELETE or SPLIT token "
                               f"({self.ids.delete_id}, {self.ids.split_id}), which {settings.strategy!r} reads as "
                               "an edit and never outputs; pin other ids", "dllm_template")
        decisions.check_leaves_a_slot(params.max_new_tokens)

    def decoding_params(self, params: GenerationConfig, settings: UnmaskingSettings) -> GenerationConfig:
        return RULES[settings.strategy].decoding_params(params)

    @staticmethod
    def rule(seq: Sequence) -> DecodingRule:
        """The unmasking rule the sequence decodes with."""
        return RULES[seq.state.settings.strategy]

    def request_settings(self, params: GenerationConfig, config: EngineConfig,
                         engine_set: frozenset[str] = frozenset()) -> UnmaskingSettings:
        return UnmaskingSettings.resolve(params, config, self.block_length, engine_set)

    def start(self, seq: Sequence, settings: UnmaskingSettings) -> None:
        seq.stop_bound = seq.params.max_new_tokens
        self._open_block(seq, settings)

    def _open_block(self, seq: Sequence, settings: UnmaskingSettings | None = None) -> bool:
        """Append the next block's positions as masks (the first one completes the prompt's block); a
        template's pinned positions are written into it as revealed. A block the template pins whole
        needs no step: the next one opens too (its forward computes their K/V), up to the output's
        limit. Returns whether a pinned position was written."""
        b, settings = self.block_length, settings or seq.state.settings
        decisions, pinned_any = seq.decisions, False
        while True:
            start = len(seq.tokens)
            end = (start // b + 1) * b
            n = end - start
            seq.append_positions([self.mask_id] * n)
            block = seq.state = BlockState(settings, start - start % b, end, list(range(start, end)), n)
            if decisions is None or not decisions.template:
                return False
            pinned_any = pin(seq, block, decisions) or pinned_any
            if block.masked or end >= seq.prompt_len + seq.params.max_new_tokens:
                return pinned_any

    def cacheable_prefix(self, seq: Sequence) -> int:
        return seq.state.start  # committed tokens only

    def sample_positions(self, seq: Sequence, end: int) -> list[int]:
        return RULES[seq.state.settings.strategy].sample_positions(seq)

    def provisional_writes(self, seq: Sequence) -> bool:
        return self.rule(seq).edits

    def trace_bound(self, seq: Sequence) -> int:
        # a rule that moves tokens may bring any write of the block into the output
        return seq.num_generated_positions if self.rule(seq).moves_tokens else super().trace_bound(seq)

    def trace_event(self, seq: Sequence, shown: list[int]) -> StepEvent | None:
        return self.rule(seq).trace_event(seq, shown)

    # ---- the step, over all its sequences ------------------------------------------------------
    def plan_feeds(self, seqs: list[Sequence]) -> list[Feed]:
        """The block being denoised, with the commit of the previous one (without commit fusion, a
        finished block's commit is a forward of its own); its K/V stay final up to the block's start."""
        window = 2 * self.block_length  # a block, with at most the previous one's commit: decoding
        if self.commit_fusion:
            return [(seq.state.end, True, seq.state.end - seq.num_computed <= window, seq.state.start) for seq in seqs]
        feeds = []
        for seq in seqs:
            block = seq.state
            decoding = block.end - seq.num_computed <= window
            if seq.num_computed < block.start and seq.step_counter > 0:
                feeds.append((block.start, False, decoding, block.start))
            else:
                feeds.append((block.end, True, decoding, block.start))
        return feeds

    def row_group(self, sl: SampleSlice) -> RowGroup:
        """The request's rule says what the rows need: entropy, λ-lowered tokens (an editing rule), the
        raw logits (a rule that reads them itself); logits at p decide position p + `row_shift`; a
        typed decision's slot takes only its allowed ids."""
        seq, positions = sl.seq, sl.positions
        params, rule = self.row_params(seq), RULES[seq.state.settings.strategy]
        floor, first = params.min_new_tokens, seq.prompt_len - self.row_shift
        decisions = seq.decisions
        return RowGroup(
            params, seq.seed, seq.num_draws, sorted(seq.penalty_ids) if params.repetition_penalty != 1.0 else [],
            [p - first < floor for p in positions] if floor else [], seq.stop_ids, rule.needs_entropy,
            rule.lowered_logits(seq, positions) if rule.spec.edits else None, rule.wants_logits,
            [decisions.allowed(p - first) for p in positions] if decisions is not None and decisions.has_sets else None)

    def apply(self, picked: list[tuple[Sequence, PickedRows]], finalize: Finalize
              ) -> list[tuple[Sequence, Exception]]:
        """The request's rule writes the step; a block the rule ends is followed by the next one."""
        failed = []
        ids = self.ids
        own_step = self.write_step
        for seq, rows in picked:
            try:
                seq.num_draws += len(rows.positions)
                rule = RULES[seq.state.settings.strategy]
                written, num_final, block_done = rule.step(seq, rows, ids) if own_step is None \
                    else own_step(seq, rows, rule)
                if not finalize(seq, written, num_final) and block_done and self._open_block(seq):
                    finalize(seq, [], rule.num_final(seq))  # pinned tokens may be final at once
            except Exception as e:  # noqa: BLE001 - ends this request only
                failed.append((seq, e))
        return failed


def pin(seq: Sequence, block: BlockState, decisions: Decisions) -> bool:
    """Write the template's pinned ids into a newly opened block as revealed (step 0, logprob 0: chosen
    by the request, not the model) and mark the read's last block; returns whether it pinned any."""
    base, template = seq.prompt_len, decisions.template
    g0, g1 = block.masked[0] - base, min(block.end - base, len(template))
    pinned = [g for g in range(g0, g1) if template[g] is not None]
    floor = seq.params.min_new_tokens
    for g in pinned:
        token = template[g]
        write_pinned(seq, g, token)
        if token in seq.stop_ids and floor <= g < seq.stop_bound:
            seq.stop_bound = g + 1
    if pinned and seq.params.repetition_penalty != 1.0:  # the only reader of the tokens seen
        seq.penalty_ids.update(template[g] for g in pinned)
    if pinned:
        block.pinned = frozenset(base + g for g in pinned)
        block.masked = [p for p in block.masked if p not in block.pinned]
        block.num_masked_at_start = len(block.masked)
        block.ended = not block.masked  # nothing to denoise (an editing rule's block is final)
    last = decisions.last_slot
    if decisions.read_steps is not None and last is not None and block.start <= base + last < block.end:
        block.read_left, block.read_end = decisions.read_steps, base + decisions.length
    return bool(pinned)
