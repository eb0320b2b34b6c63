"""The interface every decoding paradigm implements; the scheduler and the engine call only this.

A strategy is stateless: a request's decoding state lives on its `Sequence`. Per step the engine
asks what to feed (`feed_target`) and which positions' logits pick tokens (`sample_positions`),
hands the picked tokens back (`advance`), then asks how much of the output is final
(`num_final`) and feeds those tokens to the stop rule; when the request goes on, `after_step`
prepares the next step (block diffusion: opens the next block).

What a paradigm reads of the request is declared in `configs.knobs` under its `paradigm` name
(the default `check_request` refuses the rest); what differs between unmasking rules inside a
paradigm is the rule object's (`engine.core.decoding.rules`), so a strategy holds no branch per rule.

The interface does not assume that a shown token is final. A paradigm whose tokens change after
they are shown -- e.g. a *renoising canvas*, where every position of a canvas is rewritten each
step, a separate forward commits the canvas without sampling, and tokens are final only when the
canvas ends -- maps onto it as follows:

- `start` appends the canvas (its initial noise tokens); `sample_positions` returns every canvas
  position each step, and `advance` rewrites all of them and returns every index it wrote;
- `provisional_writes` is True: the step trace shows the rewrites, the output is bounded only by
  final tokens;
- `num_final` stays at the canvas' start until the canvas ends, so the stop rule (and streaming)
  sees only committed tokens, as it does for token editing;
- the committing forward is a `feed_target` of `(canvas end, False)`: a forward that writes the
  canvas' final K/V and samples nothing; `computed_after` returns the canvas' start while it is
  being rewritten and its end after that commit;
- `after_step` opens the next canvas once the current one has ended; `cacheable_prefix` is the
  committed prefix only;
- `lowered_logits` and `row_params` shape the logits and the sampling of each step's rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from configs import EngineConfig, GenerationConfig
from engine.core.input_processing import check_knobs
from engine.core.sequence import Sequence

if TYPE_CHECKING:
    from engine.core.decoding.unmasking import UnmaskingSettings


@dataclass
class PickedRows:
    """What the sampler made of one sequence's rows (one entry per sampled position)."""

    positions: list[int]
    tokens: list[int]
    confidence: list[float]
    entropy: list[float] | None
    logprobs: list[dict | None]


class DecodingStrategy(ABC):
    #: the paradigm's name in the knob table (`configs.knobs.PARADIGMS`): which knobs and rules it reads
    paradigm: str = "autoregressive"
    #: feeds must end on multiples of this (a block-causal query sees its whole block)
    chunk_alignment: int = 1
    #: whether the unmasking needs the confidence of every sampled row
    needs_confidence: bool = True

    def check_request(self, params: GenerationConfig, settings: UnmaskingSettings | None) -> None:
        """Raise RequestError naming the field when a request asks for what this strategy cannot do:
        by default, what the knob table refuses for its paradigm and the request's rule."""
        check_knobs(params, self.paradigm, None if settings is None else settings.strategy)

    @classmethod
    @abstractmethod
    def from_config(cls, config: EngineConfig, mask_id: int | None) -> DecodingStrategy:
        """The strategy of an engine config whose `dllm_block_length` is resolved and whose knobs were
        checked against this paradigm when the engine was built."""

    @abstractmethod
    def start(self, seq: Sequence) -> None:
        """Prepare a newly added sequence."""

    @abstractmethod
    def feed_target(self, seq: Sequence) -> tuple[int, bool]:
        """(end of the tokens to feed next, whether the forward that reaches it samples)."""

    @abstractmethod
    def cacheable_prefix(self, seq: Sequence) -> int:
        """How many leading tokens may come from the prefix cache."""

    @abstractmethod
    def is_decoding(self, seq: Sequence) -> bool:
        """Past its prefill (not charged to the chunked-prefill budget)."""

    @abstractmethod
    def sample_positions(self, seq: Sequence, end: int) -> list[int]:
        """Positions whose logits pick tokens, in a forward that fed the sequence up to `end`."""

    @abstractmethod
    def token_index(self, seq: Sequence, position: int) -> int:
        """Index of the generated token that the logits at `position` decide."""

    @abstractmethod
    def computed_after(self, seq: Sequence, end: int, sampled: bool) -> int:
        """Leading tokens whose K/V are final after a forward that fed up to `end`."""

    @abstractmethod
    def advance(self, seq: Sequence, rows: PickedRows) -> list[int]:
        """Apply the picked tokens; returns the generated indices written (revealed, or rewritten by a
        token-editing rule), ascending."""

    @abstractmethod
    def num_final(self, seq: Sequence) -> int:
        """Leading generated tokens that will not change any more."""

    @abstractmethod
    def after_step(self, seq: Sequence) -> None:
        """Called when the request goes on after a step."""

    def wants_entropy(self, seq: Sequence) -> bool:
        return False

    def provisional_writes(self, seq: Sequence) -> bool:
        """Whether a step's writes stay provisional until their block ends (token editing). The step
        trace shows such writes inside the token budget, even where the stop rule then ends the output
        before them; final writes it shows inside the output only."""
        return False

    def lowered_logits(self, seq: Sequence, positions: list[int]) -> tuple[float, list[int]] | None:
        """(amount, per sampled position the token whose logit is lowered by it, -1 for none) when this
        step's sampling lowers logits (token editing's λ penalty), else None."""
        return None

    def row_params(self, seq: Sequence) -> GenerationConfig:
        """The sampling parameters of the sequence's rows in its next forward: the request's, unless this
        step picks greedily whatever the request asks (Fast-dLLM v2's inherited token)."""
        return seq.params
