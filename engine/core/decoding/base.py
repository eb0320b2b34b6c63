"""The interface every decoding paradigm implements; the scheduler and the engine call only this.

A strategy holds no request state: a request's decoding state is its `Sequence.state` (the
strategy's own class), made by `start` under the request's resolved `request_settings`. A step is
three calls, each over all of the step's sequences of the paradigm: `plan_feeds` (what each feeds
next), `row_groups` (how the sampler treats each one's sampled rows, whose positions
`sample_positions` names) and `apply` (write the picks, hand what became final to the engine's
`Finalize` -- the stop rule and the trace -- and prepare the next step). The defaults run over
per-sequence hooks: `feed_target`, `is_decoding`, `computed_after`; `row_group`, asked only for a
sequence that keeps no group (it is where a paradigm's rows meet the sampler, and has no default);
`advance`, `num_final`, `after_step`.

What a paradigm reads of the request is declared in `configs.knobs` under its `paradigm` name
(the default `check_request` refuses the rest); what differs between unmasking rules inside a
paradigm is the rule object's (`engine.core.decoding.rules`), so a strategy holds no branch per rule.

The interface does not assume that a shown token is final. A paradigm whose tokens change after
they are shown -- e.g. a *renoising canvas*, where every position of a canvas is rewritten each
step, a separate forward commits the canvas without sampling, and tokens are final only when the
canvas ends -- maps onto it as follows:

- `start` appends the canvas (its initial noise tokens); `sample_positions` returns every canvas
  position each step, and `advance` rewrites all of them and returns the indices whose shown token
  changed;
- `samples_logits` is True: the engine hands the strategy each step's raw logits rows
  (`PickedRows.read_logits`) instead of running its own sampler on them; its `apply` samples the
  step's canvases together, then runs the default `apply` over them;
- `provisional_writes` is True: the step trace shows the rewrites (`trace_event` says what a
  step's event holds), the output is bounded only by final tokens;
- `num_final` stays at the canvas' start until the canvas ends, so the stop rule (and streaming)
  sees only committed tokens, as it does for token editing;
- the committing forward is a `feed_target` of `(next canvas start, False)`: a forward that writes
  the finished canvas' K/V and samples nothing; `computed_after` returns the canvas' start while it
  is being rewritten and the fed end after that commit;
- `after_step` opens the next canvas once the current one has ended; `cacheable_prefix` is the
  committed prefix only; `pass_fields` adds what a pass of the network needs beyond its tokens.

`engine.core.decoding.canvas_renoising` is that paradigm.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from configs import EngineConfig, GenerationConfig
from engine.carrier import StepEvent
from engine.core.input_processing import check_knobs
from engine.core.sampler import RowGroup
from engine.core.sequence import Sequence
from engine.core.step_plan import Feed, SampleSlice
from engine.core.trajectory_plan import TrajectoryGeometry
from engine.errors import RequestError

if TYPE_CHECKING:
    import torch

    from engine.core.decisions import Decisions
    from engine.model.spec import ModelSpec
    from engine.worker.forward_batch import ForwardBatch


class PickedRows:
    """What the sampler made of one sequence's rows (one entry per sampled position); for a strategy
    that samples its rows itself (`samples_logits`), a reader of their raw logits instead. One is made
    per sequence every step: what only some rows ask for is a class default, set on the instance
    when asked."""

    #: for a rule that reads its rows' logits itself (`wants_logits`): those rows
    logits: torch.Tensor | None = None
    #: for a rule that reads its rows' logits (`wants_logits`): (row indices, tokens) -> the logprob
    #: entries of those tokens in those rows, in the engine's logprobs mode (None each when not asked)
    logprob_of: Callable[[list[int], list[int]], list[dict | None]] | None = None
    #: for a strategy that samples its rows itself (`samples_logits`): the rows' raw logits, made when
    #: called (the LM head may run here), so that the step holds one sequence's logits at a time
    read_logits: Callable[[], torch.Tensor] | None = None
    #: per row with an allowed set: the raw probability mass the set held (NaN for the others); None
    #: when the sequence's rows had no set
    label_mass: list[float] | None = None

    def __init__(self, positions: list[int], tokens: list[int], confidence: list[float],
                 entropy: list[float] | None, logprobs: list[dict | None]):
        """One entry per sampled position of each: its pick, the pick's probability under the
        distribution drawn from, that distribution's entropy (when asked), its logprob entry."""
        self.positions = positions
        self.tokens = tokens
        self.confidence = confidence
        self.entropy = entropy
        self.logprobs = logprobs


@dataclass
class Speculation:
    """What a self-speculating request's outputs report (`DecodingStrategy.speculation`): its forwards as
    its release counts them (`nfe`: the prefill, every draft and every verify) and the tokens each verify
    accepted. Its strategy updates it in place."""

    nfe: int = 0
    acceptance: list[int] = field(default_factory=list)


#: The engine's part of applying a step to one sequence, called by `DecodingStrategy.apply` once the
#: strategy wrote the step's picks: (the sequence, the generated indices it wrote, how many leading
#: generated tokens are final now) -> whether the request finished. It feeds the newly final tokens to
#: the stop rule and records the step's trace event.
Finalize = Callable[[Sequence, list[int], int], bool]


def step_event(seq: Sequence, shown: list[int]) -> StepEvent | None:
    """A step's trace event: the generated indices `shown` written this step and their tokens now."""
    if not shown:
        return None
    base = seq.prompt_len
    return {"step": seq.step_counter, "positions": shown, "token_ids": [seq.tokens[base + g] for g in shown]}


class DecodingStrategy(ABC):
    #: the paradigm's name in the knob table (`configs.knobs.PARADIGMS`): which knobs and rules it reads
    paradigm: str = "autoregressive"
    #: feeds must end on multiples of this (a block-causal query sees its whole block)
    chunk_alignment: int = 1
    #: whether the unmasking needs the confidence of every sampled row
    needs_confidence: bool = True
    #: whether the strategy samples its rows' raw logits itself (the engine's sampler does not run)
    samples_logits: bool = False
    #: whether its passes need fields beyond tokens and pages (`pass_fields` is called only then)
    has_pass_fields: bool = False

    def request_settings(self, params: GenerationConfig, config: EngineConfig,
                         engine_set: frozenset[str] = frozenset()) -> Any:
        """The request's settings of this paradigm, resolved once over the engine's (`engine_set`: the
        engine config's fields its user set); handed to `check_request`, `decoding_params` and `start`.
        None by default: the paradigm reads the request's parameters as they are."""
        return None

    def autoregressive(self, settings: Any) -> bool:
        """Whether a request with these settings decodes one causal token per forward (its input is then
        checked as an autoregressive model's: input-token scoring allowed, no block rounding)."""
        return self.paradigm == "autoregressive"

    def check_request(self, params: GenerationConfig, settings: Any) -> None:
        """Raise RequestError naming the field when a request asks for what this strategy cannot do:
        by default, what the knob table refuses for its paradigm."""
        check_knobs(params, self.paradigm, None)

    def check_decisions(self, params: GenerationConfig, settings: Any, decisions: Decisions) -> None:
        """Raise RequestError naming the field when this paradigm cannot honour the request's typed
        decisions (`engine.core.decisions`: a template, allowed sets, a read); by default it honours none."""
        field = params.decision_field
        raise RequestError(f"{field}: typed decisions (templates, allowed sets, reads) are not served for "
                           f"{self.paradigm} decoding yet; leave it unset", field)

    def decoding_params(self, params: GenerationConfig, settings: Any) -> GenerationConfig:
        """The settings a request `check_request` accepted decodes with (by default its own)."""
        return params

    @classmethod
    @abstractmethod
    def from_config(cls, config: EngineConfig, spec: ModelSpec, mask_id: int | None) -> DecodingStrategy:
        """The strategy of an engine config whose `dllm_block_length` is resolved and whose knobs were
        checked against this paradigm when the engine was built, for the checkpoint `spec`."""

    # ---- the step: three calls, each over all of the step's sequences ---------------------------
    # `plan_feeds` and `apply` default to the per-sequence hooks below; a paradigm overrides them to do
    # the step's work in one pass (block diffusion and autoregressive decoding do).

    def plan_feeds(self, seqs: list[Sequence]) -> list[Feed]:
        """Plan the rows: per sequence its next forward (`step_plan.Feed`: where it ends, whether it
        samples, whether the sequence is past its prefill, how far its K/V are final after it)."""
        feeds = []
        for seq in seqs:
            end, sample = self.feed_target(seq)
            feeds.append((end, sample, self.is_decoding(seq), self.computed_after(seq, end, True)))
        return feeds

    def row_groups(self, slices: list[SampleSlice]) -> list[RowGroup]:
        """Pick from the logits: how the sampler treats each slice's rows (its sampling parameters, seed
        and draw counter, penalties, suppressed stop ids, λ-lowered tokens, entropy, raw logits). A
        sequence whose group cannot change between steps is served the group it keeps
        (`Sequence.keep_row_group`); `row_group` makes the others'. A strategy that samples its raw rows
        itself (`samples_logits`) is never asked."""
        groups = [sl.seq.row_group for sl in slices]
        if not all(groups):  # a group is always true: one is missing (`None in` would call __eq__ on each)
            for i in [i for i, group in enumerate(groups) if group is None]:
                groups[i] = group = self.row_group(slices[i])
                slices[i].seq.keep_row_group(group)
        return groups

    def row_group(self, sl: SampleSlice) -> RowGroup:
        """How the sampler treats one slice's rows, made anew (the default `row_groups` calls it for a
        sequence that keeps no group). Every strategy whose rows the engine's sampler picks writes it."""
        raise NotImplementedError(f"{type(self).__name__} names how the sampler treats its rows in row_group")

    def apply(self, picked: list[tuple[Sequence, PickedRows]], finalize: Finalize
              ) -> list[tuple[Sequence, Exception]]:
        """Apply the step: write each sequence's picks, hand what became final to `finalize` (the
        engine's stop rule and trace) and prepare the next step of those that go on. Returns the
        sequences whose step raised, each with its error (the engine ends those alone)."""
        failed = []
        for seq, rows in picked:
            try:
                seq.num_draws += len(rows.positions)
                written = self.advance(seq, rows)
                if not finalize(seq, written, self.num_final(seq)):
                    self.after_step(seq)
            except Exception as e:  # noqa: BLE001 - ends this request only
                failed.append((seq, e))
        return failed

    # ---- per-sequence hooks ------------------------------------------------------------------

    def feed_target(self, seq: Sequence) -> tuple[int, bool]:
        """(end of the tokens to feed next, whether the forward that reaches it samples); the default
        `plan_feeds` calls it per sequence."""
        raise NotImplementedError(f"{type(self).__name__} plans its feeds in plan_feeds")

    def is_decoding(self, seq: Sequence) -> bool:
        """Past its prefill (not charged to the chunked-prefill budget); the default `plan_feeds` calls it
        per sequence."""
        raise NotImplementedError(f"{type(self).__name__} plans its feeds in plan_feeds")

    @abstractmethod
    def start(self, seq: Sequence, settings: Any) -> None:
        """Prepare a newly added sequence (its `state`, when the paradigm keeps one) under its resolved
        `request_settings`."""

    @abstractmethod
    def cacheable_prefix(self, seq: Sequence) -> int:
        """How many leading tokens may come from the prefix cache."""

    @abstractmethod
    def sample_positions(self, seq: Sequence, end: int) -> list[int]:
        """Positions whose logits pick tokens, in a forward that fed the sequence up to `end`."""

    def computed_after(self, seq: Sequence, end: int, sampled: bool) -> int:
        """Leading tokens whose K/V are final after a forward that fed up to `end`; the default
        `plan_feeds` calls it per sequence."""
        raise NotImplementedError(f"{type(self).__name__} plans its feeds in plan_feeds")

    def advance(self, seq: Sequence, rows: PickedRows) -> list[int]:
        """Apply the picked tokens; returns the generated indices written (revealed, or rewritten by a
        token-editing rule), ascending. The default `apply` calls it per sequence."""
        raise NotImplementedError(f"{type(self).__name__} applies its steps in apply")

    def num_final(self, seq: Sequence) -> int:
        """Leading generated tokens that will not change any more (the default `apply` asks after each
        sequence's `advance`)."""
        raise NotImplementedError(f"{type(self).__name__} applies its steps in apply")

    def after_step(self, seq: Sequence) -> None:
        """Called by the default `apply` when the request goes on after a step."""
        raise NotImplementedError(f"{type(self).__name__} applies its steps in apply")

    def provisional_writes(self, seq: Sequence) -> bool:
        """Whether a step's writes stay provisional until their block ends (token editing). The step
        trace shows such writes inside the token budget, even where the stop rule then ends the output
        before them; final writes it shows inside the output only."""
        return False

    def pass_fields(self, batch: ForwardBatch, seq: Sequence, sample: bool) -> None:
        """Add what the network needs of this sequence's pass beyond its tokens and pages (the pass
        kinds of a network with encoder and canvas passes); called only when `has_pass_fields`."""
        return

    def view_fields(self, batch: ForwardBatch) -> None:
        """Add what the network needs of one trajectory-scoring view (a step's block as the model saw it,
        `engine.core.trajectory`) beyond its tokens and pages; called only when `has_pass_fields`."""
        return

    def trajectory_geometry(self, predicts_next: bool) -> TrajectoryGeometry:
        """How this paradigm's rollouts lay out their blocks, for trajectory scoring (`predicts_next`: the
        family's rows propose the next position's token)."""
        return TrajectoryGeometry(shifted=predicts_next)

    def trace_bound(self, seq: Sequence) -> int:
        """Generated indices at or past this stay out of the step trace: past the output once it is
        final, else past what the output can reach (`stop_bound`)."""
        ended = seq.num_output is not None and not self.provisional_writes(seq)
        return seq.num_output if ended else seq.stop_bound

    def trace_event(self, seq: Sequence, shown: list[int]) -> StepEvent | None:
        """The step trace event of the step just applied, for the generated indices `shown` (None: no
        event, as for a step that showed nothing)."""
        return step_event(seq, shown)

    def replay(self, seq: Sequence, num_output: int) -> dict[str, Any]:
        """The replay fields of a finished request (`return_dllm_replay`): its last block as it stood
        at finish -- its generated positions (the mask id where never revealed), the step that
        revealed each (0 = never), and how many of them are output tokens."""
        first = max(seq.state.start, seq.prompt_len) - seq.prompt_len
        last = seq.state.end - seq.prompt_len
        return {"dllm_replay_token_ids": seq.tokens[seq.prompt_len + first: seq.prompt_len + last],
                "dllm_replay_step_maps": [s or 0 for s in seq.out_steps[first:last]],
                "dllm_stop_length": max(0, num_output - first)}

    def speculation(self, seq: Sequence) -> Speculation | None:
        """The counts a self-speculating request's outputs report, kept up to date by this strategy (None:
        the request does not speculate); asked once, when the request is added."""
        return None

    def release(self, seq: Sequence) -> None:
        """The request ended (finished, aborted or failed); nothing to do by default."""
        return

    def row_params(self, seq: Sequence) -> GenerationConfig:
        """The sampling parameters of the sequence's rows in its next forward: the request's, unless this
        step picks greedily whatever the request asks (Fast-dLLM v2's inherited token)."""
        return seq.params
