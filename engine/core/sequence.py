"""A request's state inside the engine: its tokens, its KV pages, its outputs so far, and the state
its decoding paradigm keeps of it (`Sequence.state`, the strategy's own)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from configs import GenerationConfig
from engine.core.sampler import RowGroup, steady_group
from engine.kv.page_manager import PageTable

if TYPE_CHECKING:
    from engine.core.decisions import Decisions
    from engine.core.stopping import StopChecker
    from engine.core.trajectory_plan import TrajectoryState


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a request is itself: list membership and removal compare identity, not every field
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: GenerationConfig
    stop_ids: frozenset[int]
    stop: StopChecker
    seed: int
    arrival: int
    tokens: list[int] = field(default_factory=list)  # prompt + generated positions (block diffusion: masks too)
    num_computed: int = 0  # leading tokens whose K/V in the cache are final
    table: PageTable = field(default_factory=PageTable)
    status: SeqStatus = SeqStatus.WAITING
    # Per generated position (index = position - prompt_len): the step that revealed it (block
    # diffusion) and its logprob entry; None while the position is masked.
    out_steps: list[int | None] = field(default_factory=list)
    out_block_steps: list[int | None] = field(default_factory=list)  # step index within its block, 1-based
    out_logprobs: list[dict | None] = field(default_factory=list)
    penalty_ids: set[int] = field(default_factory=set)  # every token id seen (kept only under a repetition penalty)
    num_draws: int = 0  # random draws consumed (the sampler's counter)
    # how the sampler treats its rows, kept from step to step where that never changes (`keep_row_group`)
    row_group: RowGroup | None = None
    # the decoding paradigm's own state of the request (its class is the strategy's: a block-diffusion
    # request's block and knobs, a renoising request's canvas and generator); None for autoregressive
    state: Any = None
    step_counter: int = 0
    # a diffusion model's request decoded one causal token per forward (a mode it chose): its outputs
    # carry no step map, step count, trace or replay, as an autoregressive model's
    decodes_autoregressively: bool = False
    stop_bound: int = 0  # the output cannot reach past this many tokens (a revealed stop id, max_new_tokens)
    # scoring: next position whose logits row (scoring token position+1) is still owed
    next_score_pos: int = 0
    num_preemptions: int = 0
    trajectory: TrajectoryState | None = None  # a trajectory to score instead of generating
    decisions: Decisions | None = None  # its template, allowed sets and read (typed decisions)
    finish_reason: str | None = None
    num_output: int | None = None  # generated tokens to output, fixed once the request finishes
    matched: int | str | None = None  # the stop id or stop string that ended it
    added_at: float = field(default_factory=time.monotonic)  # when add_request created it
    admitted_at: float | None = None  # when the scheduler first moved it from waiting to running
    prompt_len: int = field(init=False)  # len(prompt_ids): read on every step, and the prompt never changes

    def __post_init__(self) -> None:
        self.prompt_len = len(self.prompt_ids)

    @property
    def num_generated_positions(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def wants_input_logprobs(self) -> bool:
        return self.params.logprob_start_len >= 0

    @property
    def score_end(self) -> int:
        """One past the last position whose logits score an input token (rows for N .. L-2)."""
        return self.prompt_len - 1 if self.wants_input_logprobs else 0

    def append_positions(self, tokens: list[int]) -> None:
        """Append generated positions holding `tokens` (masks, a canvas' noise, a block's seed), none of
        them revealed yet: no step, no block step, no logprob."""
        n = len(tokens)
        self.tokens += tokens
        self.out_steps += [None] * n
        self.out_block_steps += [None] * n
        self.out_logprobs += [None] * n

    def keep_row_group(self, group: RowGroup) -> None:
        """Serve `group` again at the later steps when nothing of it can change between them: no typed
        decision shapes the rows, and the group is steady (`sampler.steady_group`)."""
        if self.decisions is None and steady_group(group, self.params):
            group.steady = True
            self.row_group = group

    def finish(self, reason: str, num_output: int, matched: int | str | None = None) -> None:
        self.finish_reason, self.num_output, self.matched = reason, num_output, matched
