"""Uniform-state renoising over a canvas (DiffusionGemma): each request's canvas on its own, the
canvases of one pass stepped together.

A canvas of L positions starts as uniform random tokens. Each step scores the whole canvas, divides
the logits by the step's temperature (a linear schedule from `t_max` down to `t_min` over the
countdown N..1), samples every position, accepts the lowest-entropy samples while their summed
entropy minus the largest stays within `entropy_bound`, and re-noises every other position with
fresh uniform tokens. The canvas stops when its argmax has not changed for `stability_threshold`
steps and the mean entropy is below `stop_entropy`, or after N steps; what it emits is the last
step's argmax, not the accepted samples.

Every random draw comes from the request's own generator, in this order and these shapes: the
canvas init `randint(0, V, (1, L))`, per step `multinomial(softmax(z), 1)` on the [L, V] rows (the
exponential trick on that one tensor) and the renoise `randint(0, V, (1, L))` of the whole canvas.
That is exactly what transformers' DiffusionGemma `generate()` draws from the global generator at
batch 1, so a seeded request reproduces it, and gives the same tokens in any batch.

`step_canvases` steps the canvases of one pass together: each operation runs once over a leading
canvas dimension, and each is one that computes every row on its own (elementwise, or a reduction
along the vocabulary or the canvas), so a canvas's values are the ones it gets alone; only the draws
run per canvas, from its own generator. Its strategy hands it groups of canvases bounded in logits
bytes, so the sampler's temporaries do not grow with the concurrency.

A token's *settle step* is the request-wide number of the step of its canvas from which the argmax
at its position never changed again (steps count canvas passes; a canvas's first step follows the
previous canvas's last).

A canvas may carry a request's typed decisions (`CanvasDecisions`):

- *pins*: canvas positions that hold a given id. The canvas is drawn as above, then the pins
  overwrite their positions; every step's accept and renoise are computed as usual and the pins
  overwrite the result again, so a pinned position is always fed its id. Its argmax -- what the
  stability test, the settle steps and the emitted canvas read -- is its id too, and its settle
  step is 0. (The zero self-conditioning at pins is the runner's: the strategy names the rows.)
- *allowed sets*: per canvas position the ids it may take. Every other logit of its row is -inf
  before the sampler, the entropy (acceptance and the stop test), the argmax and the logprobs read
  the row; the renoise still draws from the whole vocabulary (the draws above are unchanged) and
  the next step's self-conditioning still comes from the unrestricted row. At the canvas's last
  step each such position records its *label mass*, the raw temperature-1 probability its set holds.
- a *read* of k steps: the canvas also stops after its k-th step (as after its N-th), and its
  logprobs are taken at temperature 1 (the raw logits, within the sets), not the step's temperature.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from configs import EngineConfig, GenerationConfig
from configs.knobs import Paradigm, settings_of
from engine.core.logprobs import logprob_entries, logprob_values
from engine.core.sampler import allowed_mass, within_allowed

STABLE, MAX_STEPS = "stable", "max_steps"


@settings_of(Paradigm.RENOISING)
class RenoiseKnobs:
    """The paradigm's settings: a frozen dataclass of one field per renoising knob of `configs.knobs`, named
    by its `setting` (`max_denoising_steps`, `entropy_bound`, `t_min`, ...), in the table's order. Its
    defaults are the table's (the release's), which a checkpoint's generation_config.json replaces in the
    engine config (the family's `generation_defaults`)."""

    def __post_init__(self) -> None:
        if not self.t_min < self.t_max:
            raise ValueError(f"dllm_t_min={self.t_min} must be below dllm_t_max={self.t_max}")

    @classmethod
    def of_engine(cls, config: EngineConfig) -> RenoiseKnobs:
        """The engine's knobs (its `dllm_*` fields)."""
        return cls(**{k.setting: getattr(config, k.name) for k in cls.KNOBS})

    def for_request(self, params: GenerationConfig) -> RenoiseKnobs:
        """These knobs with the `dllm_*` values a request sets over them (ValueError: t_min >= t_max)."""
        given = {k.setting: getattr(params, k.name) for k in self.KNOBS}
        return replace(self, **{k: v for k, v in given.items() if v is not None})

    def temperature(self, countdown: int | torch.Tensor) -> torch.Tensor:
        """T(c) = t_min + (t_max - t_min)·c/N, in float32 as transformers computes it (a 0-d tensor, or one
        value per countdown of a tensor of them)."""
        c = torch.as_tensor(countdown, dtype=torch.int32)
        return self.t_min + (self.t_max - self.t_min) * (c / self.max_denoising_steps)


def filtered(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """`z` [L, V] with the tokens outside each row's top-k / top-p nucleus at -inf (vLLM's rule: the
    filters shape what is sampled and the entropy; the most likely token always stays)."""
    if top_k and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = z.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        outside = probs.cumsum(dim=-1) - probs > top_p
        z = z.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), float("-inf"))
    return z


@dataclass
class CanvasDecisions:
    """A canvas's share of a request's typed decisions, on the canvas's device: its pins (`pinned`
    [L] bool, `pinned_ids` [L] holding the id at each pin; `pinned_rows` their positions) and its
    allowed sets (`set_rows` [R], the positions with a set, and `set_ids` [R, K], each one's ids
    padded with its first)."""

    pinned: torch.Tensor | None = None
    pinned_ids: torch.Tensor | None = None
    pinned_rows: list[int] = field(default_factory=list)
    set_rows: torch.Tensor | None = None
    set_ids: torch.Tensor | None = None

    @classmethod
    def of(cls, template: list[int | None], sets: dict[int, list[int]], length: int,
           device: torch.device | str) -> CanvasDecisions | None:
        """The decisions of a canvas of `length` positions: `template` over its first positions (an id
        pins its position, None leaves a slot), `sets` the allowed ids per position. None: neither."""
        out = cls()
        out.pinned_rows = [pos for pos, t in enumerate(template) if t is not None]
        if out.pinned_rows:
            ids = [-1 if t is None else t for t in template] + [-1] * (length - len(template))
            out.pinned_ids = torch.tensor(ids, dtype=torch.long, device=device)
            out.pinned = out.pinned_ids >= 0
        if sets:
            width = max(len(ids) for ids in sets.values())
            out.set_rows = torch.tensor(list(sets), dtype=torch.long, device=device)
            out.set_ids = torch.tensor([ids + ids[:1] * (width - len(ids)) for ids in sets.values()],
                                       dtype=torch.long, device=device)
        return out if out.pinned is not None or out.set_rows is not None else None

    def pin(self, tokens: torch.Tensor) -> torch.Tensor:
        """`tokens` ([L] or [1, L]) with the pinned ids at the pins."""
        return tokens if self.pinned is None else torch.where(self.pinned, self.pinned_ids, tokens)

    def set_mask(self, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the positions with a set, a [R, V] mask True at each one's allowed ids); None: no set."""
        if self.set_rows is None:
            return None
        keep = torch.zeros(len(self.set_rows), vocab_size, dtype=torch.bool, device=self.set_ids.device)
        return self.set_rows, keep.scatter_(1, self.set_ids, True)


@dataclass
class StepReport:
    """What one canvas step did: the canvas positions whose argmax changed and their new argmax, the
    step's temperature, how many samples it accepted, the mean entropy, whether the canvas ended, and
    the canvas it feeds next."""

    step: int
    positions: list[int]
    token_ids: list[int]
    temperature: float
    accepted: int
    mean_entropy: float
    ended: bool
    canvas: list[int]


@dataclass
class CanvasState:
    """One request's renoising state across its canvases."""

    knobs: RenoiseKnobs
    generator: torch.Generator
    canvas_length: int
    vocab_size: int
    steps_before: int = 0  # request-wide steps of the canvases already ended
    countdown: int = 0
    tokens: torch.Tensor | None = None  # [1, L] the canvas fed next
    argmax: torch.Tensor | None = None  # [L] the last step's argmax
    # consecutive steps before the last whose argmax equals the last one's (the stability test reads it)
    unchanged_steps: int = 0
    changed_at: torch.Tensor | None = None  # [L] canvas step of each position's last argmax change
    start: int = 0  # the open canvas's first position (absolute)
    ended: bool = False  # the open canvas stopped: its emitted tokens replaced it
    report: StepReport | None = None  # what the last step did
    top_k: int = 0
    top_p: float = 1.0
    logprobs: int | None = None  # the request's top-k logprobs (None: no logprobs)
    logprobs_mode: str | None = "processed_logprobs"
    last_logprobs: list[dict] | None = None  # per canvas position, the entry of the last step's argmax
    stop: str | None = None
    replay: list[dict] = field(default_factory=list)
    read_steps: int | None = None  # a read: its canvas stops after this many steps at the latest
    decisions: CanvasDecisions | None = None  # the open canvas's pins and allowed sets
    label_mass: dict[int, float] = field(default_factory=dict)  # per set position: its set's mass at the end
    #: the temperature of each countdown 0..N, exactly the float32 values (`RenoiseKnobs.temperature`)
    schedule: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.schedule = self.knobs.temperature(torch.arange(self.knobs.max_denoising_steps + 1)).tolist()

    def open_canvas(self, decisions: CanvasDecisions | None = None) -> list[int]:
        """Draw a new canvas (uniform tokens, then its pins) and reset the per-canvas state; its tokens."""
        gen = self.generator
        self.tokens = torch.randint(0, self.vocab_size, (1, self.canvas_length), generator=gen, device=gen.device)
        self.decisions = decisions
        if decisions is not None:
            self.tokens = decisions.pin(self.tokens)
        self.countdown = self.knobs.max_denoising_steps
        self.argmax = self.changed_at = self.last_logprobs = None
        self.unchanged_steps = 0
        self.label_mass = {}
        self.stop = None
        return self.tokens[0].tolist()

    @property
    def canvas_step(self) -> int:
        """Steps taken on the open canvas."""
        return self.knobs.max_denoising_steps - self.countdown

    @property
    def temperature(self) -> float:
        """The temperature of the open canvas's next step (exactly the float32 value)."""
        return self.schedule[self.countdown]

    def _last_rows(self, raw_logits: torch.Tensor, restricted: torch.Tensor, z: torch.Tensor, argmax: torch.Tensor,
                   sets: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """What the canvas's last step leaves beside its argmax: each set position's label mass and,
        when asked, the logprob entries of the argmax (a read's at temperature 1: its raw rows within
        their sets, unfiltered)."""
        if sets is not None:
            rows, keep = sets
            mass = allowed_mass(raw_logits.index_select(0, rows), keep)
            self.label_mass = dict(zip(rows.tolist(), mass.tolist(), strict=True))
        if self.logprobs is None:
            return
        if self.logprobs_mode in ("raw_logprobs", "raw_logits"):
            values = raw_logits
        else:
            values = restricted if self.read_steps is not None else z
        lists = [None if v is None else v.tolist()
                 for v in logprob_values(values, argmax, self.logprobs, self.logprobs_mode, sets)]
        self.last_logprobs = logprob_entries(argmax.tolist(), [self.logprobs] * len(argmax), *lists)

    @property
    def settle(self) -> torch.Tensor:
        """Per position of the open canvas, the canvas step of its last argmax change (0 at a pin)."""
        pinned = self.decisions.pinned if self.decisions is not None else None
        return self.changed_at if pinned is None else self.changed_at.masked_fill(pinned, 0)

    def close_canvas(self) -> tuple[list[int], list[int]]:
        """(the emitted tokens = the last argmax, their request-wide settle steps, 0 at a pin); the
        next canvas's steps count on from this one's."""
        settle = self.settle
        settle = torch.where(settle > 0, settle + self.steps_before, settle).tolist()
        self.steps_before += self.canvas_step
        return self.argmax.tolist(), settle


def step_canvases(canvases: list[CanvasState], raw_logits: torch.Tensor) -> list[StepReport | RuntimeError]:
    """Apply one canvas pass to each of `canvases` (all of one canvas length L): `raw_logits` [k, L, V]
    float32, row i the pass's logits of canvas i. Sample, accept, renoise, check the stop -- every
    operation the one a canvas alone would run, over a leading canvas dimension: each row is computed
    on its own, so a canvas gets the values it gets alone, and each draws from its own generator in
    its own order (`multinomial(p, 1)` is, as torch computes it, Exp(1) draws over the [L, V] rows and
    the argmax of p / draws). A canvas whose logits give no distribution (NaN) gets the error
    `multinomial` raises instead of a report, and its state and generator are left as they were."""
    device = raw_logits.device
    sets = [c.decisions.set_mask(c.vocab_size) if c.decisions is not None else None for c in canvases]
    restricted = raw_logits
    if any(s is not None for s in sets):
        restricted = raw_logits.clone()
        for i, allowed in enumerate(sets):
            if allowed is not None:
                restricted[i] = within_allowed(raw_logits[i], allowed)
    temperatures = [c.temperature for c in canvases]
    z = restricted / torch.tensor(temperatures, dtype=torch.float32, device=device)[:, None, None]
    for i, c in enumerate(canvases):
        if c.top_k or c.top_p < 1.0:
            z[i] = filtered(z[i], c.top_k, c.top_p)
    probs = torch.softmax(z, dim=-1, dtype=torch.float32)
    invalid = probs.isnan().flatten(1).any(-1).tolist()
    if any(invalid):  # those canvases fail alone, before any of their draws
        keep = [i for i, bad in enumerate(invalid) if not bad]
        reports = iter(step_canvases([canvases[i] for i in keep], raw_logits[keep]) if keep else [])
        error = "probability tensor contains either `inf`, `nan` or element < 0"
        return [RuntimeError(error) if bad else next(reports) for bad in invalid]
    draws = torch.empty_like(probs)
    for i, c in enumerate(canvases):
        draws[i].exponential_(1, generator=c.generator)
    sampled = probs.div_(draws).argmax(-1)
    del probs, draws
    pins = _pins(canvases)
    argmax = _pinned(z.argmax(-1), pins)
    entropy = torch.distributions.Categorical(logits=z, validate_args=False).entropy()
    sorted_entropy, order = torch.sort(entropy, dim=-1, descending=False)
    bounds = torch.tensor([c.knobs.entropy_bound for c in canvases], dtype=torch.float32, device=device)[:, None]
    within = torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy <= bounds
    accept = torch.scatter(torch.zeros_like(within), -1, order, within)
    kept = torch.where(accept, sampled, torch.cat([c.tokens for c in canvases]))
    length = raw_logits.shape[1]
    noise = torch.cat([torch.randint(0, c.vocab_size, (1, length), generator=c.generator, device=c.generator.device)
                       for c in canvases])
    tokens = _pinned(torch.where(~accept, noise, kept), pins)

    first = [c.argmax is None for c in canvases]
    before = torch.stack([torch.full_like(argmax[i], -1) if f else c.argmax for i, (c, f) in
                          enumerate(zip(canvases, first))])
    changed = argmax != before  # every position on a canvas's first step
    steps = torch.tensor([c.canvas_step + 1 for c in canvases], device=device)[:, None]
    changed_at = torch.where(changed, steps, torch.stack([torch.zeros_like(argmax[i]) if f else c.changed_at
                                                          for i, (c, f) in enumerate(zip(canvases, first))]))
    mean_entropy = entropy.mean(-1)
    stops = torch.tensor([c.knobs.stop_entropy for c in canvases], dtype=torch.float32, device=device)
    confident = (mean_entropy < stops).tolist()
    changed_rows, argmax_rows, token_rows = changed.tolist(), argmax.tolist(), tokens.tolist()
    accepted, means = accept.sum(-1).tolist(), mean_entropy.tolist()

    reports: list[StepReport | RuntimeError] = []
    for i, c in enumerate(canvases):
        c.unchanged_steps = 0 if True in changed_rows[i] else c.unchanged_steps + 1
        stable = c.unchanged_steps >= c.knobs.stability_threshold
        canvas_step = c.canvas_step + 1
        c.argmax, c.changed_at, c.tokens = argmax[i], changed_at[i], tokens[i: i + 1]
        c.countdown -= 1
        if stable and confident[i]:
            c.stop = STABLE
        elif c.countdown == 0 or canvas_step == c.read_steps:
            c.stop = MAX_STEPS
        if c.stop is not None:
            c._last_rows(raw_logits[i], restricted[i], z[i], argmax[i], sets[i])
            c.replay.append({"steps": canvas_step, "stop": c.stop})
        row = argmax_rows[i]
        positions = [p for p, moved in enumerate(changed_rows[i]) if moved]
        reports.append(StepReport(c.steps_before + canvas_step, positions, [row[p] for p in positions],
                                  temperatures[i], accepted[i], means[i], c.stop is not None, token_rows[i]))
    return reports


def _pins(canvases: list[CanvasState]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The canvases' pins as one (mask [k, L], ids [k, L]); None when no canvas has one."""
    if all(c.decisions is None or c.decisions.pinned is None for c in canvases):
        return None
    length, device = canvases[0].canvas_length, canvases[0].generator.device
    free = torch.full((length,), -1, dtype=torch.long, device=device)
    ids = torch.stack([free if c.decisions is None or c.decisions.pinned is None else c.decisions.pinned_ids
                       for c in canvases])
    return ids >= 0, ids


def _pinned(tokens: torch.Tensor, pins: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """`tokens` [k, L] with each canvas's pinned ids at its pins."""
    return tokens if pins is None else torch.where(pins[0], pins[1], tokens)


def request_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """The request's own generator on the device its logits are on: seeded, or freshly seeded from the
    OS when no seed is given. (On CPU a seed draws what `torch.manual_seed(seed)` makes the global
    generator draw; another device's generator draws its own, equally reproducible, stream.)"""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
