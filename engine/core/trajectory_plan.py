"""Trajectory scoring, the plan: a block-diffusion rollout checked against the model and laid out as
the context to prefill and one view per denoising step (see engine.core.trajectory for how they run).

A step's view is its block as the model saw it at that step: prompt positions as they are, tokens
revealed at earlier steps visible, the mask id elsewhere (docs/rollouts.md). Steps that reveal no
output token (only positions past a stop) need no view.

Block geometry (`TrajectoryGeometry`): most families' blocks lie at multiples of B, the prompt's last
one completed by the output. A *seeded* family's (Nemotron-Labs-Diffusion's `diffusion` mode) start
at the prompt end, and each opens with a seed drawn from the causal row before it: the seed's view is
that one position, fed as itself over the causal context (its row is the causal row). Such a family's
pass may reveal nothing (its candidate the mask id), so its steps may skip, and a position may stay
masked to the end (the mask id, step 0, no logprob).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from configs import GenerationConfig
from engine.errors import RequestError
from engine.kv.page_manager import KVPageManager, PageTable

if TYPE_CHECKING:
    from engine.core.input_processing import ModelLimits

_FIELD = "dllm_trajectory"
_PROCESSED_MODES = ("processed_logprobs", "processed_logits")


@dataclass(frozen=True)
class TrajectoryGeometry:
    """How a family lays out a rollout's blocks (see the module's docstring)."""

    shifted: bool = False  # row i-1 proposes token i (a token shift), rather than row i
    seeded: bool = False  # blocks start at the prompt end, each opened by a seed from the causal row before it


@dataclass
class View:
    """One denoising step of one block, as the model saw it."""

    start: int  # absolute position of the block's first token
    tokens: list[int]  # the block's B tokens at that step (mask id where not yet revealed)
    step: int  # the global step
    rows: list[int]  # offsets in the block of the output tokens this step revealed
    outputs: list[int]  # their indices in the output
    targets: list[int]  # their token ids
    scratch_pages: int  # private KV pages: from the page holding the block's first position to its end
    penalty_ids: list[int] | None = None  # tokens seen before the step (repetition penalty only)
    argmax: bool = False  # the step took the argmax whatever the sampling (a token shift's inherited token)


@dataclass
class TrajectoryState:
    """A trajectory request inside the engine: its plan and what has been scored so far."""

    context_len: int  # tokens [0, context_len) are fed as the request's own prefill
    views: list[View]
    output_ids: list[int]
    step_map: list[int]
    params: GenerationConfig  # the request's, without the trajectory (it travels with every forward)
    stop_ids: list[int]
    processed: bool  # the engine's logprobs mode is a processed one
    entries: list[dict[int, float] | None]
    entropy: list[float | None] | None  # None unless asked for
    next_view: int = 0  # views handed to the scheduler so far
    done_views: int = 0  # views whose rows came back
    scratch: PageTable = field(default_factory=PageTable)  # the private pages of the views in flight

    @property
    def done(self) -> bool:
        return self.done_views == len(self.views)

    def reserve(self, kv: KVPageManager, count: int) -> bool:
        """Take the scratch pages of the next `count` views (False, nothing taken, if they do not fit)."""
        pages = sum(v.scratch_pages for v in self.views[self.next_view : self.next_view + count])
        return kv.allocate(self.scratch, pages * kv.page_size)

    def take(self, count: int) -> list[View]:
        views = self.views[self.next_view : self.next_view + count]
        self.next_view += count
        return views


def _check_steps(generated: list[int], generated_steps: list[int], num_output: int, starts: range,
                 prompt_len: int, b: int, mask_id: int, seeded: bool) -> None:
    """A valid global step_map over the blocks at `starts`: output tokens revealed (>= 1; a seeded
    family's may also be the mask id at step 0, never revealed), never-revealed replay positions 0;
    every block's steps above every earlier block's; and (but for a seeded family, whose passes may
    reveal nothing) the steps 1..max all used (each step reveals)."""
    for g, s in enumerate(generated_steps):
        unrevealed = seeded and s == 0 and generated[g] == mask_id
        if s < 0 or (g < num_output and s == 0 and not unrevealed):
            name = "step_map" if g < num_output else "replay_step_maps"
            what = "an output token" if g < num_output else "a replay position"
            raise RequestError(f"{name}: value {s} for {what} (generated position {g}) is out of range: steps "
                               "start at 1 (0 only for replay positions never revealed)", f"{_FIELD}.{name}")
    reached = 0
    for start in starts:
        lo, hi = max(start, prompt_len) - prompt_len, start + b - prompt_len
        values = sorted({s for s in generated_steps[lo:hi] if s})
        if not values:
            raise RequestError(f"step_map: the block at positions [{start}, {start + b}) has no revealed position",
                               f"{_FIELD}.step_map")
        if values[0] <= reached:
            raise RequestError(f"step_map is not a trajectory of this model (block length {b}): the block at "
                               f"positions [{start}, {start + b}) has step {values[0]} but an earlier block "
                               f"already reached step {reached}; steps must increase from block to block",
                               f"{_FIELD}.step_map")
        missing = sorted(set(range(reached + 1, values[-1] + 1)) - set(values))
        if missing and not seeded:
            raise RequestError(f"step_map: step {missing[0]} reveals nothing (the block at positions [{start}, "
                               f"{start + b}) has steps {values}); every step reveals at least one token, so the "
                               "steps are 1, 2, ... without gaps", f"{_FIELD}.step_map")
        reached = values[-1]


def plan_trajectory(prompt: list[int], params: GenerationConfig, limits: ModelLimits, mask_id: int,
                    stop_ids: frozenset[int], geometry: TrajectoryGeometry = TrajectoryGeometry()
                    ) -> TrajectoryState:
    """Check the trajectory against the model (RequestError naming the field) and lay out its context
    and views. A shifted geometry (row i-1 proposes token i): a view scores the rows before its tokens,
    and a block's first token is scored on the view of the finished block before it. A seeded one: see
    the module's docstring."""
    t = params.dllm_trajectory
    b, prompt_len = limits.block_length, len(prompt)
    origin = prompt_len if geometry.seeded else 0  # where the blocks are counted from

    def block_start(p: int) -> int:
        return origin + (p - origin) // b * b
    out, steps = list(t.output_ids), list(t.step_map)
    if len(steps) != len(out):
        raise RequestError(f"step_map has {len(steps)} entries for {len(out)} output_ids: one step per output "
                           "token", f"{_FIELD}.step_map")
    vocab = limits.vocab_size
    for name, ids in (("output_ids", out), ("replay_token_ids", t.replay_token_ids or [])):
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise RequestError(f"{name} holds ids outside the vocabulary [0, {vocab}): {bad[:5]}", f"{_FIELD}.{name}")
    end = prompt_len + len(out)
    last_start = block_start(end - 1)  # the last block's first position
    first = max(last_start, prompt_len) - prompt_len  # generated index of the last block's first position
    span = last_start + b - prompt_len - first  # generated positions of the last block
    replay = (t.replay_token_ids, t.replay_step_maps, t.stop_length)
    if any(v is not None for v in replay):
        for name, v in zip(("replay_token_ids", "replay_step_maps", "stop_length"), replay):
            if v is None:
                raise RequestError(f"{name} is missing: the final-block replay is replay_token_ids, "
                                   "replay_step_maps and stop_length together", f"{_FIELD}.{name}")
        tokens, replay_steps, stop_length = replay
        if len(tokens) != span:
            raise RequestError(f"replay_token_ids has {len(tokens)} entries; the last block of this output "
                               f"(positions [{prompt_len + first}, {prompt_len + first + span})) has {span} "
                               "generated positions", f"{_FIELD}.replay_token_ids")
        if len(replay_steps) != span:
            raise RequestError(f"replay_step_maps has {len(replay_steps)} entries for {span} replay positions",
                               f"{_FIELD}.replay_step_maps")
        if stop_length != len(out) - first:
            raise RequestError(f"stop_length={stop_length}, but {len(out) - first} output tokens lie in the last "
                               "block", f"{_FIELD}.stop_length")
        if tokens[:stop_length] != out[first:]:
            raise RequestError("replay_token_ids does not start with the output tokens of the last block",
                               f"{_FIELD}.replay_token_ids")
        if replay_steps[:stop_length] != steps[first:]:
            raise RequestError("replay_step_maps does not start with the step_map of the last block's output "
                               "tokens", f"{_FIELD}.replay_step_maps")
        generated, generated_steps = out[:first] + list(tokens), steps[:first] + list(replay_steps)
    elif (end - origin) % b:
        raise RequestError(f"the output ends inside a block (position {end}, block length {b}): pass the rollout's "
                           "final-block replay (replay_token_ids, replay_step_maps, stop_length = its "
                           "dllm_replay_token_ids, dllm_replay_step_maps, dllm_stop_length)",
                           f"{_FIELD}.replay_token_ids")
    else:
        generated, generated_steps = out, steps
    total = prompt_len + len(generated)
    if total > limits.max_model_len:
        raise RequestError(f"prompt + trajectory ({total} positions) exceeds max_model_len={limits.max_model_len}",
                           f"{_FIELD}.output_ids")
    _check_steps(generated, generated_steps, len(out), range(block_start(prompt_len), last_start + 1, b), prompt_len,
                 b, mask_id, geometry.seeded)

    processed = limits.logprobs_mode in _PROCESSED_MODES
    penalized = processed and params.repetition_penalty != 1.0
    seen = set(prompt) - {mask_id}
    by_step: dict[int, list[int]] = {}
    for g, s in enumerate(generated_steps):
        if s:
            by_step.setdefault(s, []).append(g)
    views = []
    page = limits.kv_page_size
    for step in sorted(by_step):  # steps follow the blocks, so views come block by block
        revealed = by_step[step]
        start = block_start(prompt_len + revealed[0])
        rows = [g for g in revealed if g < len(out)]
        seed = geometry.seeded and revealed == [start - prompt_len] and _is_seed(generated_steps, revealed[0], b)
        if rows and seed:
            q = start - 1  # the seed's row: the causal row of the position before its block
            token = prompt[q] if q < prompt_len else generated[q - prompt_len]
            views.append(View(q, [token], step, [0], rows, [out[g] for g in rows], _pages_touched(q, q + 1, page)))
        elif rows:
            offsets = [prompt_len + g - start for g in rows]
            inherited = geometry.shifted and offsets == [0]
            if inherited:  # a block's first token: the last row of the finished block before it
                start, offsets = start - b, [b]
            if geometry.shifted:
                offsets = [o - 1 for o in offsets]
            tokens = [prompt[p] if p < prompt_len
                      else generated[p - prompt_len] if 0 < generated_steps[p - prompt_len] < step else mask_id
                      for p in range(start, start + b)]
            views.append(View(start, tokens, step, offsets, rows, [out[g] for g in rows],
                              _pages_touched(start, start + b, page), sorted(seen) if penalized else None,
                              inherited))
        seen.update(generated[g] for g in revealed)
    pages = -(-last_start // page) + max(v.scratch_pages for v in views)
    if pages > limits.num_kv_pages:
        raise RequestError(f"scoring this trajectory needs {pages} KV pages (its context and one view) but the cache "
                           f"has only {limits.num_kv_pages}: it can never fit", f"{_FIELD}.output_ids")
    return TrajectoryState(
        context_len=last_start, views=views, output_ids=out, step_map=steps,
        params=params.model_copy(update={"dllm_trajectory": None}),
        stop_ids=sorted(stop_ids), processed=processed, entries=[None] * len(out),
        entropy=[None] * len(out) if t.return_entropy else None)


def _pages_touched(start: int, end: int, page: int) -> int:
    """How many KV pages positions [start, end) lie in."""
    return -(-end // page) - start // page


def _is_seed(generated_steps: list[int], g: int, b: int) -> bool:
    """Whether generated index g, the first of a seeded block, holds the block's seed: revealed before
    every other position of the block (by the forward before the block's passes)."""
    others = [s for s in generated_steps[g + 1: g + b] if s]
    return generated_steps[g] > 0 and all(generated_steps[g] < s for s in others)


def context_tokens(prompt: list[int], params: GenerationConfig, state: TrajectoryState) -> list[int]:
    """The tokens fed as the request's prefill: prompt and output up to the last block (whose earlier
    blocks are complete, so they are the output's own tokens)."""
    return (prompt + list(params.dllm_trajectory.output_ids))[: state.context_len]
