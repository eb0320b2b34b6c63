"""Unmasking rules: which masked positions of a block one denoising step reveals.

A rule is one function `rule(candidates, n, settings) -> chosen` registered in `RULES` under the
name users pass as `dllm_unmasking_strategy`; adding a strategy is adding one function here.

`candidates` are the block's still-masked positions in ascending order, each with the confidence
(probability of its candidate token under the distribution the sampler drew from) and the entropy
of that distribution (nats). `n` is the step's quota: with M positions masked when the block
opened and S denoising steps, the block's s-th step (s = 0, 1, ...) has
`n_s = M // S + (1 if s < M % S else 0)`. A rule returns at least one and at most all candidates,
in ascending position order. Ties break toward the lower position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    position: int
    confidence: float
    entropy: float


@dataclass(frozen=True)
class UnmaskingSettings:
    """A request's block-diffusion knobs, resolved once from the request and the engine defaults."""

    strategy: str
    denoising_steps: int
    confidence_threshold: float
    entropy_threshold: float


def tokens_this_step(num_masked_at_block_start: int, steps: int, step_index: int) -> int:
    """n_s = M // S + (1 if s < M % S else 0)."""
    m, s = num_masked_at_block_start, steps
    return m // s + (1 if step_index < m % s else 0)


def _most_confident(candidates: list[Candidate], n: int) -> list[Candidate]:
    return sorted(candidates, key=lambda c: (-c.confidence, c.position))[:n]


def sequential(candidates: list[Candidate], n: int, settings: UnmaskingSettings) -> list[Candidate]:
    """The leftmost n masked positions."""
    return candidates[:n]


def low_confidence_static(candidates: list[Candidate], n: int, settings: UnmaskingSettings) -> list[Candidate]:
    """The n most confident positions."""
    return _most_confident(candidates, n)


def low_confidence_dynamic(candidates: list[Candidate], n: int, settings: UnmaskingSettings) -> list[Candidate]:
    """Every position with confidence >= the threshold if there are at least n of them, else the n
    most confident."""
    confident = [c for c in candidates if c.confidence >= settings.confidence_threshold]
    return confident if len(confident) >= n else _most_confident(candidates, n)


def entropy_bounded(candidates: list[Candidate], n: int, settings: UnmaskingSettings) -> list[Candidate]:
    """JetEngine's `entropy_bounded` rule (the EB-sampler of Ben-Hamu et al.): order the masked
    positions by entropy, lowest first, and reveal the longest prefix of that order whose running
    sum of entropies stays strictly below `entropy_threshold`; always at least one position. The
    step quota n is not used: the entropy budget decides how many tokens a step reveals."""
    ranked = sorted(candidates, key=lambda c: (c.entropy, c.position))
    total, k = 0.0, 0
    for c in ranked:
        total += c.entropy
        if total >= settings.entropy_threshold:
            break
        k += 1
    return ranked[: max(k, 1)]


Rule = Callable[[list[Candidate], int, UnmaskingSettings], list[Candidate]]

RULES: dict[str, Rule] = {
    "sequential": sequential,
    "low_confidence_static": low_confidence_static,
    "low_confidence_dynamic": low_confidence_dynamic,
    "entropy_bounded": entropy_bounded,
}
NEEDS_ENTROPY = frozenset({"entropy_bounded"})


def choose_positions(candidates: list[Candidate], n: int, settings: UnmaskingSettings) -> list[int]:
    """The positions to reveal this step, ascending."""
    n = max(1, min(n, len(candidates)))
    chosen = RULES[settings.strategy](candidates, n, settings)
    return sorted(c.position for c in chosen)
