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
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from configs import EngineConfig, GenerationConfig
from configs.knobs import Paradigm, settings_of
from engine.core.sampler import logprob_entries, logprob_values

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

    def open_canvas(self) -> list[int]:
        """Draw a new canvas (uniform tokens) and reset the per-canvas state; its tokens."""
        gen = self.generator
        self.tokens = torch.randint(0, self.vocab_size, (1, self.canvas_length), generator=gen, device=gen.device)
        self.countdown = self.knobs.max_denoising_steps
        self.argmax = self.history = self.changed_at = self.last_logprobs = None
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
        knobs, gen = self.knobs, self.generator
        temperature = knobs.temperature(self.countdown)
        z = filtered(raw_logits / temperature, self.top_k, self.top_p)
        probs = torch.softmax(z, dim=-1, dtype=torch.float32)
        sampled = torch.multinomial(probs, num_samples=1, generator=gen).view(1, -1)
        del probs
        argmax = torch.argmax(z, dim=-1)
        entropy = torch.distributions.Categorical(logits=z).entropy()
        sorted_entropy, order = torch.sort(entropy[None], dim=-1, descending=False)
        within = torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy <= knobs.entropy_bound
        accept = torch.scatter(torch.zeros_like(within), -1, order, within)
        kept = torch.where(accept, sampled, self.tokens)
        noise = torch.randint(0, self.vocab_size, (1, self.canvas_length), generator=gen, device=gen.device)
        self.tokens = torch.where(~accept, noise, kept)

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
        elif self.countdown == 0:
            self.stop = MAX_STEPS
        if self.stop is not None and self.logprobs is not None:
            raw = self.logprobs_mode in ("raw_logprobs", "raw_logits")
            values = logprob_values(raw_logits if raw else z, argmax, self.logprobs, self.logprobs_mode)
            lists = [None if v is None else v.tolist() for v in values]
            self.last_logprobs = logprob_entries(argmax.tolist(), [self.logprobs] * len(argmax), *lists)
        del z
        positions = changed.nonzero().flatten()
        report = StepReport(self.steps_before + canvas_step, positions.tolist(), argmax[positions].tolist(),
                            temperature.item(), int(accept.sum()), mean_entropy.item(), self.stop is not None)
        if self.stop is not None:
            self.replay.append({"steps": canvas_step, "stop": self.stop})
        return report

    def close_canvas(self) -> tuple[list[int], list[int]]:
        """(the emitted tokens = the last argmax, their request-wide settle steps); the next canvas's
        steps count on from this one's."""
        settle = (self.changed_at + self.steps_before).tolist()
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
