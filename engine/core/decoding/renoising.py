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

from dataclasses import dataclass, field, fields

import torch

STABLE, MAX_STEPS = "stable", "max_steps"


@dataclass(frozen=True)
class RenoiseKnobs:
    """The paradigm's settings; defaults are the release's (a checkpoint's generation_config.json
    overrides them through `from_generation_config`)."""

    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    stop_entropy: float = 0.005

    def __post_init__(self) -> None:
        if self.max_denoising_steps < 1:
            raise ValueError(f"dllm_max_denoising_steps must be >= 1 (got {self.max_denoising_steps})")
        if self.entropy_bound <= 0:
            raise ValueError(f"dllm_entropy_bound must be > 0 (got {self.entropy_bound})")
        if not 0 <= self.t_min < self.t_max:
            raise ValueError(f"dllm_t_min must be >= 0 and below dllm_t_max (got {self.t_min}, {self.t_max})")
        if self.stability_threshold < 0:
            raise ValueError(f"dllm_stability_threshold must be >= 0 (got {self.stability_threshold})")
        if self.stop_entropy <= 0:
            raise ValueError(f"dllm_stop_entropy must be > 0 (got {self.stop_entropy})")

    @classmethod
    def from_generation_config(cls, gen: dict) -> RenoiseKnobs:
        """The defaults a checkpoint's generation_config.json sets (transformers' key names)."""
        sampler = gen.get("sampler_config") or {}
        found = {"max_denoising_steps": gen.get("max_denoising_steps"), "entropy_bound": sampler.get("entropy_bound"),
                 "t_min": gen.get("t_min"), "t_max": gen.get("t_max"),
                 "stability_threshold": gen.get("stability_threshold"),
                 "stop_entropy": gen.get("confidence_threshold")}
        return cls(**{k: v for k, v in found.items() if v is not None})

    def override(self, values: dict) -> RenoiseKnobs:
        """These knobs with the `dllm_<name>` entries of `values` that are set."""
        names = {f"dllm_{f.name}": f.name for f in fields(self)}
        given = {names[k]: v for k, v in values.items() if k in names and v is not None}
        return type(self)(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **given})

    def temperature(self, countdown: int) -> torch.Tensor:
        """T(c) = t_min + (t_max - t_min)·c/N, in float32 as transformers computes it (a 0-d tensor)."""
        c = torch.tensor(countdown, dtype=torch.int32)
        return self.t_min + (self.t_max - self.t_min) * (c / self.max_denoising_steps)


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
    last_logits: torch.Tensor | None = None  # [L, V] the last step's raw logits (only when logprobs are asked)
    keep_logits: bool = False
    stop: str | None = None
    replay: list[dict] = field(default_factory=list)

    def open_canvas(self) -> list[int]:
        """Draw a new canvas (uniform tokens) and reset the per-canvas state; its tokens."""
        gen = self.generator
        self.tokens = torch.randint(0, self.vocab_size, (1, self.canvas_length), generator=gen, device=gen.device)
        self.countdown = self.knobs.max_denoising_steps
        self.argmax = self.history = self.changed_at = self.last_logits = None
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
        z = raw_logits / temperature
        probs = torch.softmax(z, dim=-1, dtype=torch.float32)
        sampled = torch.multinomial(probs, num_samples=1, generator=gen).view(1, -1)
        del probs
        argmax = torch.argmax(z, dim=-1)
        entropy = torch.distributions.Categorical(logits=z).entropy()
        del z
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
        if self.keep_logits:
            self.last_logits = raw_logits
        self.countdown -= 1
        if stable and bool(mean_entropy < knobs.stop_entropy):
            self.stop = STABLE
        elif self.countdown == 0:
            self.stop = MAX_STEPS
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

    def logprobs(self, raw: bool, top_k: int = 0) -> list[dict]:
        """Per canvas position, the log-probability of the emitted token at the canvas's last step:
        of the processed logits (÷ the step's temperature), or of the raw ones; with the `top_k` best."""
        temperature = self.knobs.temperature(self.countdown + 1)
        logits = self.last_logits if raw else self.last_logits / temperature
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp.gather(-1, self.argmax[:, None])[:, 0].tolist()
        out = [{"logprob": v} for v in chosen]
        if top_k:
            values, ids = logp.topk(top_k, dim=-1)
            for entry, v, i in zip(out, values.tolist(), ids.tolist(), strict=True):
                entry["top"] = list(zip(v, i, strict=True))
        return out


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
