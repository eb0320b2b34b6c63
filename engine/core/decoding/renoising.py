"""Uniform-state renoising over a canvas (DiffusionGemma), one request at a time.

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
batch 1, so a seeded request reproduces it, and gives the same tokens in any batch. All the
sampler's temporaries are [L, V] of one request, whatever the concurrency.

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

    def temperature(self, countdown: int) -> torch.Tensor:
        """T(c) = t_min + (t_max - t_min)·c/N, in float32 as transformers computes it (a 0-d tensor)."""
        c = torch.tensor(countdown, dtype=torch.int32)
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
    step's temperature, how many samples it accepted, the mean entropy, and whether the canvas ended."""

    step: int
    positions: list[int]
    token_ids: list[int]
    temperature: float
    accepted: int
    mean_entropy: float
    ended: bool


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
    history: torch.Tensor | None = None  # [stability_threshold, L] the previous steps' argmax
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

    def open_canvas(self, decisions: CanvasDecisions | None = None) -> list[int]:
        """Draw a new canvas (uniform tokens, then its pins) and reset the per-canvas state; its tokens."""
        gen = self.generator
        self.tokens = torch.randint(0, self.vocab_size, (1, self.canvas_length), generator=gen, device=gen.device)
        self.decisions = decisions
        if decisions is not None:
            self.tokens = decisions.pin(self.tokens)
        self.countdown = self.knobs.max_denoising_steps
        self.argmax = self.history = self.changed_at = self.last_logprobs = None
        self.label_mass = {}
        if self.knobs.stability_threshold:
            self.history = torch.full((self.knobs.stability_threshold, self.canvas_length), -1, dtype=torch.long,
                                      device=gen.device)
        self.stop = None
        return self.tokens[0].tolist()

    @property
    def canvas_step(self) -> int:
        """Steps taken on the open canvas."""
        return self.knobs.max_denoising_steps - self.countdown

    @property
    def temperature(self) -> float:
        """The temperature of the open canvas's next step (exactly the float32 value)."""
        return self.knobs.temperature(self.countdown).item()

    def step(self, raw_logits: torch.Tensor) -> StepReport:
        """Apply one canvas pass's float32 logits [L, V]: sample, accept, renoise, check the stop."""
        knobs, gen, decisions = self.knobs, self.generator, self.decisions or CanvasDecisions()
        temperature = knobs.temperature(self.countdown)
        sets = decisions.set_mask(self.vocab_size)
        restricted = within_allowed(raw_logits, sets)
        z = filtered(restricted / temperature, self.top_k, self.top_p)
        probs = torch.softmax(z, dim=-1, dtype=torch.float32)
        sampled = torch.multinomial(probs, num_samples=1, generator=gen).view(1, -1)
        del probs
        argmax = decisions.pin(torch.argmax(z, dim=-1))
        entropy = torch.distributions.Categorical(logits=z).entropy()
        sorted_entropy, order = torch.sort(entropy[None], dim=-1, descending=False)
        within = torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy <= knobs.entropy_bound
        accept = torch.scatter(torch.zeros_like(within), -1, order, within)
        kept = torch.where(accept, sampled, self.tokens)
        noise = torch.randint(0, self.vocab_size, (1, self.canvas_length), generator=gen, device=gen.device)
        self.tokens = decisions.pin(torch.where(~accept, noise, kept))

        canvas_step = self.canvas_step + 1
        if self.argmax is None:
            changed = torch.ones_like(argmax, dtype=torch.bool)
            self.changed_at = torch.ones_like(argmax)
        else:
            changed = argmax != self.argmax
            self.changed_at[changed] = canvas_step
        if self.history is None:
            stable = True
        else:
            stable = bool((self.history == argmax[None]).all())
            self.history = torch.roll(self.history, shifts=-1, dims=0)
            self.history[-1] = argmax
        mean_entropy = entropy.mean()
        self.argmax = argmax
        self.countdown -= 1
        if stable and bool(mean_entropy < knobs.stop_entropy):
            self.stop = STABLE
        elif self.countdown == 0 or canvas_step == self.read_steps:
            self.stop = MAX_STEPS
        if self.stop is not None:
            self._last_rows(raw_logits, restricted, z, argmax, sets)
        del z
        positions = changed.nonzero().flatten()
        report = StepReport(self.steps_before + canvas_step, positions.tolist(), argmax[positions].tolist(),
                            temperature.item(), int(accept.sum()), mean_entropy.item(), self.stop is not None)
        if self.stop is not None:
            self.replay.append({"steps": canvas_step, "stop": self.stop})
        return report

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
