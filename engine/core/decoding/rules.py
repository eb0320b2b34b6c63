"""Decoding rules as objects: what one unmasking rule (`dllm_unmasking_strategy`) does inside a block.

A rule is declared in `configs.knobs` (`RuleSpec`: its name, the paradigms it serves, whether it
edits; the knobs name the rules that read them) and run here: one `DecodingRule` per name in
`RULES`, the one registry. The block strategies (`BlockDiffusionDecoding`, `SubBlockDecoding`)
hold the paradigm -- blocks, feeds, K/V commits -- and call the request's rule for what differs
between rules:

- `sample_positions`: the block positions whose logits this step samples;
- `lowered_logits`: what it does to the logits before the sampler picks (token editing's λ);
- `step`: a sequence's step in one call: which picked tokens it writes (reveals, and for an editing
  rule rewrites), how many tokens are final after it and whether the block ended. By default it asks
  `advance`, `num_final` and `block_done` in turn, three hooks a rule may implement instead; the reveal
  and editing rules answer all three as they write;
- `check_request` / `missing`: what a request may not combine with it (beyond the knob table's
  refusals), and what a model lacks for it (a special token);
- `decoding_params`: the settings an accepted request decodes with (greedy under a greedy-only rule);
- `wants_logits`, `moves_tokens`, `trace_event`: whether it reads its rows' logits itself, whether its
  steps move tokens between positions (the step trace then shows every write of the block) and what
  its trace events hold.

Three kinds exist: `RevealRule` (each revealed token is final; a block ends with its last mask),
`EditRule` (token editing: revealed tokens may be rewritten, so a block's tokens are final only
when the block ends, on a step that writes nothing or past its post-edit budget) and `InDelRule`
(token editing that also deletes and inserts positions: `engine.core.decoding.indel`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from configs import GenerationConfig
from configs.knobs import RULE_SPECS, RuleSpec, rule_knobs
from engine.carrier import StepEvent
from engine.core.decoding.base import PickedRows, step_event
from engine.core.decoding.block_state import BlockState
from engine.core.decoding.editing import BlockRows, budget_spent, joint_threshold
from engine.core.decoding.indel import InDelBlock, StepOutcome, indel_step
from engine.core.decoding.unmasking import (
    Rule,
    SpecialIds,
    UnmaskingSettings,
    entropy_bounded,
    low_confidence_dynamic,
    low_confidence_static,
    random_order,
    sequential,
    tokens_this_step,
)
from engine.core.sequence import Sequence
from engine.errors import RequestError

#: What a rule's step did to one sequence: the generated indices it wrote (ascending), how many leading
#: generated tokens are final after it, and whether its block ended.
StepResult = tuple[list[int], int, bool]


def step_seed(seq: Sequence) -> int:
    """The seed of a rule's draws at the sequence's current step: its seed mixed with its step counter."""
    return (seq.seed * 1_000_003 + seq.step_counter) & ((1 << 63) - 1)


def write_tokens(seq: Sequence, positions: list[int], picks: PickedRows, chosen: list[int], shift: int = 0,
                 final: bool = True) -> list[int]:
    """Write the picks `chosen` (indices into `picks`) at their positions (`positions[i] + shift`) in the
    current step (the counters already advanced); returns their generated indices, in `chosen`'s order. A
    `final` stop id outside `min_new_tokens` bounds the output (an editing rule's writes are not final:
    the stop rule reads them when their block ends)."""
    tokens, steps, block_steps, logprobs = seq.tokens, seq.out_steps, seq.out_block_steps, seq.out_logprobs
    step, block_step, base = seq.step_counter, seq.state.step_index, seq.prompt_len
    picked, entries = picks.tokens, picks.logprobs
    stop_ids, floor = seq.stop_ids, seq.params.min_new_tokens
    written = []
    for i in chosen:
        position = positions[i] + shift
        g, token = position - base, picked[i]
        tokens[position] = token
        steps[g], block_steps[g], logprobs[g] = step, block_step, entries[i]
        if final and token in stop_ids and g >= floor and g < seq.stop_bound:
            seq.stop_bound = g + 1
        written += (g,)
    if seq.params.repetition_penalty != 1.0:  # the only reader of the tokens seen
        seq.penalty_ids.update([picked[i] for i in chosen])
    if picks.label_mass is not None:  # typed decisions: the mass each written slot's allowed set held
        masses, decisions = picks.label_mass, seq.decisions
        for i, g in zip(chosen, written):
            decisions.note_mass(g, masses[i])
    return written


def write_pinned(seq: Sequence, g: int, token: int) -> None:
    """Write `token` at generated index g as the template pins it: revealed at step 0 (block step 0),
    its logprob entry 0 -- the request chose it, not the model -- when logprobs are asked."""
    seq.tokens[seq.prompt_len + g] = token
    seq.out_steps[g] = seq.out_block_steps[g] = 0
    seq.out_logprobs[g] = {token: 0.0} if seq.params.logprobs is not None else None


def read_slots(block: BlockState, positions: list[int], chosen: list[int], masked: list[bool] | None = None
               ) -> list[int]:
    """`chosen`, and on a read's last step every still-masked template slot among `positions` (`masked`:
    which of them still hold the mask; None: all); ascending."""
    if not block.read_step():
        return chosen
    end = block.read_end
    slots = {i for i, p in enumerate(positions) if p < end and (masked is None or masked[i])}
    return sorted(slots.union(chosen))


def end_block(seq: Sequence, fed_final: bool) -> None:
    """End an editing rule's block. `fed_final`: this step's forward fed exactly the block's final
    tokens, so its K/V are kept as the block's commit; otherwise the next block's first forward
    writes them."""
    block = seq.state
    block.ended, block.masked = True, []
    if fed_final:
        seq.num_computed = max(seq.num_computed, block.end)


@dataclass(frozen=True)
class DecodingRule:
    """The hooks every rule has; `spec` is its declaration, `knobs` the request knobs it reads."""

    spec: RuleSpec
    needs_entropy: bool = False
    #: the rule reads its rows' logits itself (`PickedRows.logits`), beside the sampler's picks
    wants_logits: bool = False
    #: a step may move tokens between positions, so any write of the block may reach the output
    moves_tokens: bool = False

    @property
    def knobs(self) -> tuple[str, ...]:
        return rule_knobs(self.spec.name)

    @property
    def edits(self) -> bool:
        """Whether a step's writes stay provisional until their block ends."""
        return self.spec.edits

    def check_request(self, params: GenerationConfig) -> None:
        """Raise RequestError naming the field when a request asks what this rule cannot do, as its spec
        declares: a rule that only decodes greedily (`RuleSpec.greedy`) refuses a sampling temperature
        the request set, and every rule the fields it `refuses` when set to anything but their default."""
        if self.spec.greedy and not params.is_greedy and "temperature" in params.model_fields_set:
            raise RequestError(f"temperature={params.temperature}: {self.spec.name} decodes greedily from the "
                               "model's own logits and does not sample; set temperature to 0", "temperature")
        fields = type(params).model_fields
        for name, why in self.spec.refuses.items():
            if getattr(params, name) != fields[name].default:
                raise RequestError(f"{name} does not apply to {self.spec.name}: {why}; leave it unset", name)

    def decoding_params(self, params: GenerationConfig) -> GenerationConfig:
        """The settings an accepted request decodes with: its own, made greedy under a rule that only
        decodes greedily (what `check_request` let through there asked for no temperature: e.g.
        `do_sample=True` with temperature unset, under a rule the engine config set)."""
        if self.spec.greedy and not params.is_greedy:
            return params.model_copy(update={"do_sample": False})
        return params

    def missing(self, ids: SpecialIds) -> str | None:
        """Why a model with these special tokens cannot decode with this rule (None: it can)."""
        return None

    def sample_positions(self, seq: Sequence) -> list[int]:
        return list(seq.state.masked)

    def lowered_logits(self, seq: Sequence, positions: list[int]) -> tuple[float, list[int]] | None:
        return None

    def step(self, seq: Sequence, rows: PickedRows, ids: SpecialIds) -> StepResult:
        """Apply the step's picked tokens to one sequence: `advance`, then where the sequence stands."""
        written = self.advance(seq, rows, ids)
        return written, self.num_final(seq), self.block_done(seq)

    def advance(self, seq: Sequence, rows: PickedRows, ids: SpecialIds) -> list[int]:
        """Apply the step's picked tokens; returns the generated indices written, ascending. (A rule that
        overrides `step` need not have it.)"""
        raise NotImplementedError(f"{type(self).__name__} applies its steps in step")

    def trace_event(self, seq: Sequence, shown: list[int]) -> StepEvent | None:
        """The trace event of the step just applied (`shown`: the generated indices it wrote that the
        trace shows)."""
        return step_event(seq, shown)

    def num_final(self, seq: Sequence) -> int:
        """Revealed tokens are final: the leading generated positions that hold one, every position
        before the open block's first mask (a block opens once the one before it holds no mask; the
        open block is the last one appended)."""
        block = seq.state
        return (block.masked[0] if block.masked else block.end) - seq.prompt_len

    def block_done(self, seq: Sequence) -> bool:
        return not seq.state.masked


@dataclass(frozen=True)
class RevealRule(DecodingRule):
    """A rule that only reveals: `choose` picks which masked candidates a step reveals (its quota n
    from the block's denoising steps)."""

    choose: Rule | None = None
    #: whether `choose` draws (it is then given the request's `step_seed`; others get 0)
    draws: bool = False

    def step(self, seq: Sequence, rows: PickedRows, ids: SpecialIds) -> StepResult:
        """Reveal the chosen candidates; the tokens before the block's first mask are final (`num_final`), and
        the block ends with its last mask (`block_done`), both read off the masks the step leaves."""
        block = seq.state
        settings, positions = block.settings, rows.positions
        count = len(positions)
        n = tokens_this_step(block.num_masked_at_start, settings.denoising_steps, block.step_index)
        n = 1 if n < 1 else count if n > count else n
        chosen = self.choose(rows.confidence, rows.entropy, n, settings, step_seed(seq) if self.draws else 0)
        if block.read_left is not None:  # in a read's last block (typed decisions)
            chosen = read_slots(block, positions, chosen)
        seq.step_counter += 1
        block.step_index += 1
        revealed = write_tokens(seq, positions, rows, chosen)
        masked = block.masked  # equal to `positions` (the step sampled the masked ones): the chosen leave it
        for i in reversed(chosen):
            del masked[i]
        if masked:
            return revealed, masked[0] - seq.prompt_len, False
        return revealed, block.end - seq.prompt_len, True


@dataclass(frozen=True)
class EditRule(DecodingRule):
    """A token-editing rule: every generated position of the block is sampled each step; `pick` (see
    `engine.core.decoding.editing`) returns the indices to write, ascending, or None when the block ends."""

    pick: Callable[[BlockRows, int, UnmaskingSettings], list[int] | None] | None = None

    def sample_positions(self, seq: Sequence) -> list[int]:
        # revealed ones may be rewritten; a template's pinned ones never are
        block = seq.state
        positions = range(max(block.start, seq.prompt_len), block.end)
        return [p for p in positions if p not in block.pinned] if block.pinned else list(positions)

    def lowered_logits(self, seq: Sequence, positions: list[int]) -> tuple[float, list[int]] | None:
        """The λ penalty: at each position but the block's first, the token now at the position before it."""
        amount = seq.state.settings.penalty_lambda
        if not amount:
            return None
        return amount, [seq.tokens[p - 1] if p > seq.state.start else -1 for p in positions]

    def step(self, seq: Sequence, rows: PickedRows, ids: SpecialIds) -> StepResult:
        """Write what the rule picks, or end the block; its tokens are final once it ended (`num_final`)."""
        block, positions, mask_id = seq.state, rows.positions, ids.mask_id
        # the positions are one stretch of the block unless a template pinned some of it
        now = [seq.tokens[p] for p in positions] if block.pinned else seq.tokens[positions[0]: positions[-1] + 1]
        masked = [token == mask_id for token in now]
        if mask_id not in now:
            block.post_edit_steps += 1
        view = BlockRows(now, rows.tokens, rows.confidence, masked)
        writes = self.pick(view, block.post_edit_steps, seq.state.settings)
        if writes is None:
            end_block(seq, fed_final=True)
            return [], self.num_final(seq), True
        last_read = block.read_left == 1
        writes = read_slots(block, positions, writes, masked)  # `pick` gives them ascending
        seq.step_counter += 1
        block.step_index += 1
        written = write_tokens(seq, positions, rows, writes, final=False)
        block.masked = [p for p in positions if seq.tokens[p] == mask_id]
        if last_read:  # a read's last step: its slots are written, the block ends with them
            block.ended = True
        elif not block.masked and budget_spent(block.post_edit_steps, seq.state.settings):
            # the next step could only end the block: its tokens are final now, and their K/V ride on
            # the next block's first forward (as after a last reveal), which spares that step's forward
            block.ended = True
        return written, self.num_final(seq), block.ended

    def num_final(self, seq: Sequence) -> int:
        """A block's tokens are final when it ends."""
        block = seq.state
        return max(0, (block.end if block.ended else block.start) - seq.prompt_len)

    def block_done(self, seq: Sequence) -> bool:
        return seq.state.ended


@dataclass(frozen=True)
class InDelRule(EditRule):
    """Token editing with deletes and inserts (`engine.core.decoding.indel`): greedy on the rows' own
    logits, which it reads itself (fallbacks, cleanup and anti-loop take other tokens than the
    argmax; its spec is `greedy`: a sampling temperature is refused, an unset one is greedy). Each
    position's step, block step and logprob are those of its content's last write, carried when a
    delete or split moves it; a step that changed nothing (e.g. a mask written back) neither counts
    nor shows. The block ends when a step has nothing to write (its forward fed the final tokens) or
    after its cleanup step (whose writes the next block's first forward commits when they changed
    the block)."""

    wants_logits: bool = True
    moves_tokens: bool = True
    # its writes are `advance`'s below, with editing's finality and block end (not `EditRule.step`'s writes)
    step = DecodingRule.step

    def missing(self, ids: SpecialIds) -> str | None:
        if ids.delete_id is None or ids.split_id is None:
            return (f"dllm_unmasking_strategy={self.spec.name!r} needs the model's DELETE and SPLIT tokens: "
                    "config.json delete_token_id and split_token_id (or EngineConfig dllm_delete_token_id and "
                    "dllm_split_token_id), and this model has none")
        return None

    def sample_positions(self, seq: Sequence) -> list[int]:
        # every generated position, pinned ones too: the step reads the block as one stretch (a pin's
        # row is never written; it only keeps the rescan's positions in place)
        block = seq.state
        return list(range(max(block.start, seq.prompt_len), block.end))

    def lowered_logits(self, seq: Sequence, positions: list[int]) -> tuple[float, list[int]] | None:
        return None  # no λ penalty (an engine-wide one is joint_threshold's)

    def advance(self, seq: Sequence, rows: PickedRows, ids: SpecialIds) -> list[int]:
        block, positions = seq.state, rows.positions
        if block.rule_state is None:  # the block's first step: every unpinned generated position is an original mask
            pinned = frozenset(i for i, p in enumerate(positions) if p in block.pinned)
            block.rule_state = InDelBlock([i not in pinned for i in range(len(positions))], pinned=pinned)
        state: InDelBlock = block.rule_state
        state.last = None
        outcome = indel_step(state, [seq.tokens[p] for p in positions], rows.logits, positions[0] - block.start,
                             block.end - block.start, seq.state.settings, ids)
        if outcome is None:
            end_block(seq, fed_final=True)
            return []
        if outcome.changed:
            seq.step_counter += 1
            block.step_index += 1
            self._rewrite(seq, positions, outcome, rows, ids.mask_id)
            state.last = outcome
        if outcome.cleanup:
            end_block(seq, fed_final=not outcome.changed)
        first = positions[0] - seq.prompt_len
        return [first + i for i in sorted(outcome.writes) if outcome.writes[i] not in (ids.delete_id, ids.split_id)]

    @staticmethod
    def _rewrite(seq: Sequence, positions: list[int], outcome: StepOutcome, rows: PickedRows, mask_id: int) -> None:
        """The block's positions after the step: written tokens with this step's counters and logprobs,
        moved ones with their own, new masks with none."""
        g0, n = positions[0] - seq.prompt_len, len(positions)
        steps, block_steps, logprobs = (values[g0: g0 + n] for values in
                                        (seq.out_steps, seq.out_block_steps, seq.out_logprobs))
        written = [(j, it) for j, it in enumerate(outcome.items) if it.written and it.token != mask_id]
        entries = dict(zip((j for j, _ in written), rows.logprob_of([it.source for _, it in written],
                                                                    [it.token for _, it in written]), strict=True))
        for j, it in enumerate(outcome.items):
            seq.tokens[positions[j]] = it.token
            if j in entries:
                now = (seq.step_counter, seq.state.step_index, entries[j])
            elif it.source is not None and it.token != mask_id:
                now = (steps[it.source], block_steps[it.source], logprobs[it.source])
            else:
                now = (None, None, None)
            seq.out_steps[g0 + j], seq.out_block_steps[g0 + j], seq.out_logprobs[g0 + j] = now
        seq.state.masked = [p for p in positions if seq.tokens[p] == mask_id]

    def trace_event(self, seq: Sequence, shown: list[int]) -> StepEvent | None:
        """Every changing write of the step at its input position (edit tokens aside); a step that
        deleted or split adds `moves` (input position -> position after the step, of each token the
        rescan moved) and `deleted` (the input positions whose content left the block)."""
        state: InDelBlock | None = seq.state.rule_state
        outcome = state.last if state is not None else None
        if outcome is None:
            return None
        first = max(seq.state.start, seq.prompt_len) - seq.prompt_len
        event: StepEvent = {"step": seq.step_counter, "positions": shown,
                            "token_ids": [outcome.writes[g - first] for g in shown]}
        if outcome.rescanned:
            event["moves"] = [[first + a, first + b] for a, b in outcome.moves]
            event["deleted"] = [first + i for i in outcome.deleted]
        return event


RULES: dict[str, DecodingRule] = {r.spec.name: r for r in (
    RevealRule(RULE_SPECS["sequential"], choose=sequential),
    RevealRule(RULE_SPECS["low_confidence_static"], choose=low_confidence_static),
    RevealRule(RULE_SPECS["low_confidence_dynamic"], choose=low_confidence_dynamic),
    RevealRule(RULE_SPECS["entropy_bounded"], needs_entropy=True, choose=entropy_bounded),
    RevealRule(RULE_SPECS["random"], choose=random_order, draws=True),
    EditRule(RULE_SPECS["joint_threshold"], pick=joint_threshold),
    InDelRule(RULE_SPECS["joint_threshold_indel"]),
)}
