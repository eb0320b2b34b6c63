"""Unmasking rules: which masked positions of a block one denoising step reveals.

A rule's choice is one function `rule(confidence, entropy, n, settings, step_seed) -> chosen`; the
rule object that runs it (`engine.core.decoding.rules.RULES`, under the name users pass as
`dllm_unmasking_strategy`) is declared beside its knobs in `configs.knobs`. `step_seed` is the
request's seed mixed with its step counter, for rules that draw (0 for the others).

The candidates are the block's still-masked positions in ascending order, given as columns (one
entry per candidate, so a step makes no per-candidate objects): `confidence`, the probability of its
candidate token under the distribution the sampler drew from, and `entropy`, the entropy of that
distribution (nats; computed only for the rules that need it, None for the others). `n` is the step's
quota: with M positions masked when the block opened and S denoising steps, the block's s-th step
(s = 0, 1, ...) has `n_s = M // S + (1 if s < M % S else 0)`. A rule returns the indices of at least
one and at most all candidates, ascending. Ties break toward the lower position.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from configs import EngineConfig, GenerationConfig
from configs.knobs import DIFFUSION, RULE_SPECS, settings_of
from engine.errors import RequestError


@settings_of(*DIFFUSION)
class UnmaskingSettings:
    """A request's block-diffusion knobs, resolved once from the request and the engine defaults: a frozen
    dataclass of one field per per-request knob of `configs.knobs` that a diffusion paradigm reads, but the
    block length, named by its `setting` (`strategy`, `denoising_steps`, `confidence_threshold`, ...), in
    the table's order."""

    @classmethod
    def resolve(cls, params: GenerationConfig, config: EngineConfig, block_length: int,
                engine_set: frozenset[str] = frozenset()) -> UnmaskingSettings:
        """The request's knobs over the engine's (`config`, family defaults applied); a request's
        `dllm_block_length` must equal the model's. The rule's own defaults (`RuleSpec.defaults`) come
        between: they replace the engine's value of a knob unless its user set it (`engine_set`, the
        fields given to the EngineConfig before the family's defaults were applied)."""
        if params.dllm_block_length is not None and params.dllm_block_length != block_length:
            raise RequestError(f"dllm_block_length={params.dllm_block_length}: this model decodes blocks of "
                               f"{block_length} tokens and the block length cannot change per request; leave it "
                               "unset", "dllm_block_length")
        rule = params.dllm_unmasking_strategy or config.dllm_unmasking_strategy
        rule_defaults = {k: v for k, v in RULE_SPECS[rule].defaults.items() if k not in engine_set}
        values = {}
        for knob in cls.KNOBS:
            value = getattr(params, knob.name)
            if value is None:
                value = rule_defaults.get(knob.name, getattr(config, knob.name))
            values[knob.setting] = value
        values["denoising_steps"] = values["denoising_steps"] or block_length  # default: one token per step
        return cls(**values)


@dataclass(frozen=True)
class SpecialIds:
    """The token ids a block's rules treat specially: the mask, and the edit tokens of
    `joint_threshold_indel` (None where the model has none)."""

    mask_id: int
    delete_id: int | None = None
    split_id: int | None = None


def tokens_this_step(num_masked_at_block_start: int, steps: int, step_index: int) -> int:
    """n_s = M // S + (1 if s < M % S else 0)."""
    m, s = num_masked_at_block_start, steps
    return m // s + (1 if step_index < m % s else 0)


def _most_confident(confidence: list[float], n: int) -> list[int]:
    """The n most confident candidates, ascending."""
    # a stable sort, also in reverse: equal confidences keep the lower position first; for one, `max`
    # keeps the first of equal values and `index` finds the first
    if n == 1:
        return [confidence.index(max(confidence))]
    return sorted(sorted(range(len(confidence)), key=confidence.__getitem__, reverse=True)[:n])


def sequential(confidence: list[float], entropy: list[float] | None, n: int, settings: UnmaskingSettings,
               step_seed: int) -> list[int]:
    """The leftmost n masked positions."""
    return list(range(n))


def low_confidence_static(confidence: list[float], entropy: list[float] | None, n: int,
                          settings: UnmaskingSettings, step_seed: int) -> list[int]:
    """The n most confident positions."""
    return _most_confident(confidence, n)


def low_confidence_dynamic(confidence: list[float], entropy: list[float] | None, n: int,
                           settings: UnmaskingSettings, step_seed: int) -> list[int]:
    """Every position with confidence >= the threshold if there are at least n of them, else the n
    most confident."""
    threshold = settings.confidence_threshold
    confident = [i for i, c in enumerate(confidence) if c >= threshold]
    return confident if len(confident) >= n else _most_confident(confidence, n)


def entropy_bounded(confidence: list[float], entropy: list[float], n: int, settings: UnmaskingSettings,
                    step_seed: int) -> list[int]:
    """JetEngine's `entropy_bounded` rule (the EB-sampler of Ben-Hamu et al.): order the masked
    positions by entropy, lowest first, and reveal the longest prefix of that order whose running
    sum of entropies stays strictly below `entropy_threshold`; always at least one position. The
    step quota n is not used: the entropy budget decides how many tokens a step reveals."""
    ranked = sorted(range(len(entropy)), key=entropy.__getitem__)  # stable: ties keep the lower position
    total, k = 0.0, 0
    for i in ranked:
        total += entropy[i]
        if total >= settings.entropy_threshold:
            break
        k += 1
    return sorted(ranked[: max(k, 1)])


def random_order(confidence: list[float], entropy: list[float] | None, n: int, settings: UnmaskingSettings,
                 step_seed: int) -> list[int]:
    """n positions drawn uniformly without replacement (JetEngine's and LLaDA's `random` remasking),
    from a generator seeded by the request's seed and step: the same seed gives the same order."""
    return sorted(random.Random(step_seed).sample(range(len(confidence)), n))


def above_threshold_or_best(confidence: list[float], threshold: float) -> list[int]:
    """Indices of the candidates with confidence strictly above `threshold`; when none is, the single
    most confident one (ties: the lowest index)."""
    chosen = [i for i, c in enumerate(confidence) if c > threshold]
    return chosen or _most_confident(confidence, 1)


Rule = Callable[[list[float], list[float] | None, int, "UnmaskingSettings", int], list[int]]
