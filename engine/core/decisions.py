"""Typed decisions: a template over the first output positions, allowed sets at its slots, reads.

A request's `dllm_template` lays token ids over generated positions 0..L-1: a *slot* (the model's
mask id, -1 or null) is decoded as usual, any other id is *pinned* there. How a paradigm honours a
pin is its own: a mask-based block writes it into the block as already revealed before the block's
first step (fed as itself, never a candidate, never rewritten; its step_map value is 0); an
autoregressive model is forced to take it (teacher forcing). `dllm_allowed_token_ids` restricts a
slot to a set of ids -- one list for every slot, or a list per output position -- by setting every
other logit of the slot's row to -inf before any rule reads the row (so `processed` logprobs are
renormalised over the set, `raw` ones stay over the vocabulary); each such slot also reports its
`label_mass`, the raw temperature-1 probability its set holds. Without a template every output
position is a slot.

A *read* (`dllm_read_only`) returns the template's positions and ends with finish reason `read`:
greedy, at temperature 1, no stop rule, each slot's logprob rows over its set. A block-diffusion
read runs the family's rule in every block before the one holding the last slot, and at most
`dllm_max_steps` k steps (default 1) in that block: its k-th step reveals every slot it still holds
at once, so a one-step read of a template inside one block is one forward.

`Decisions` is a request's resolved fields (checked against the model: ids inside the vocabulary,
positions inside the template); `read_params` is the generation settings a read decodes with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from configs import GenerationConfig
from engine.errors import RequestError

SLOT_MARKERS = (None, -1)  # besides the model's mask id


@dataclass
class Decisions:
    """A request's template, allowed sets and read, resolved against its model."""

    #: per generated index below the template's length: the pinned id, or None at a slot
    template: list[int | None]
    #: the allowed ids of every slot (`every`), or per generated index (`per_slot`); both empty: no set
    every: list[int] | None = None
    per_slot: dict[int, list[int]] = field(default_factory=dict)
    #: a read's step budget in the block holding its last slot (None: not a read)
    read_steps: int | None = None
    #: per generated index: the raw probability mass its allowed set held at its write
    label_mass: dict[int, float] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return len(self.template)

    @property
    def has_sets(self) -> bool:
        return self.every is not None or bool(self.per_slot)

    def pinned(self, g: int) -> int | None:
        """The id pinned at generated index g (None: a slot, or past the template)."""
        return self.template[g] if g < len(self.template) else None

    def is_slot(self, g: int) -> bool:
        """Whether generated index g is a template slot (without a template: every index)."""
        return g < len(self.template) and self.template[g] is None

    def allowed(self, g: int) -> list[int] | None:
        """The ids generated index g may take (None: any)."""
        if not self.is_slot(g) and self.template:
            return None
        if g in self.per_slot:
            return self.per_slot[g]
        return self.every

    def note_mass(self, g: int, mass: float) -> None:
        """Record generated index g's label mass (a NaN, the sampler's mark of a row without a set: none)."""
        if mass == mass:
            self.label_mass[g] = mass

    def check_leaves_a_slot(self, max_new_tokens: int) -> None:
        """RequestError when the template pins every output position (a mask-based paradigm would have
        nothing to decode)."""
        if self.last_slot is None and self.length >= max_new_tokens:
            raise RequestError("dllm_template pins every output position, which leaves nothing to decode: mark a "
                               "slot (the mask id, -1 or null) or raise max_new_tokens past the template",
                               "dllm_template")

    @property
    def last_slot(self) -> int | None:
        """The generated index of the template's last slot (None: no slot)."""
        for g in range(len(self.template) - 1, -1, -1):
            if self.template[g] is None:
                return g
        return None

    @classmethod
    def resolve(cls, params: GenerationConfig, mask_id: int | None, vocab_size: int) -> Decisions | None:
        """The request's decisions (None when it sets none), or RequestError naming the field that the
        model cannot honour: ids outside the vocabulary, a template longer than max_new_tokens, a set
        at a position that is no slot."""
        if not params.has_decisions:
            return None
        if params.dllm_trajectory is not None:
            field = params.decision_field
            raise RequestError(f"{field} does not apply to a dllm_trajectory request: it scores a rollout's own "
                               "tokens and decodes nothing; leave it unset", field)
        raw, limit = params.dllm_template, params.max_new_tokens
        if raw is None:  # every output position is a slot
            template: list[int | None] = [None] * (limit if params.is_read else 0)
        else:
            if len(raw) > limit:
                raise RequestError(f"dllm_template has {len(raw)} positions but max_new_tokens={limit}: a template "
                                   "lies over the first output positions; raise max_new_tokens or shorten it",
                                   "dllm_template")
            template = [None if t in SLOT_MARKERS or t == mask_id else t for t in raw]
            bad = [t for t in template if t is not None and t >= vocab_size]
            if bad:
                raise RequestError(f"dllm_template holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                                   "dllm_template")
        sets = params.dllm_allowed_token_ids
        every, per_slot = (sets, {}) if isinstance(sets, list) else (None, dict(sets or {}))
        for ids in [every or [], *per_slot.values()]:
            bad = [t for t in ids if t >= vocab_size or t == mask_id]
            if bad:
                raise RequestError(f"dllm_allowed_token_ids holds ids outside the vocabulary [0, {vocab_size}) "
                                   f"(or the mask token): {bad[:5]}", "dllm_allowed_token_ids")
        decisions = cls(template, every, {g: sorted(set(ids)) for g, ids in per_slot.items()},
                        (params.dllm_max_steps or 1) if params.is_read else None)
        if decisions.every is not None:
            decisions.every = sorted(set(decisions.every))
        for g in per_slot:
            if template and not decisions.is_slot(g) or not template and g >= limit:
                raise RequestError(f"dllm_allowed_token_ids names output position {g}, which is no slot of the "
                                   "template (a position the template marks with the mask id, -1 or null)",
                                   "dllm_allowed_token_ids")
        if params.dllm_max_steps is not None and not params.is_read:
            raise RequestError("dllm_max_steps is a read's step budget: set dllm_read_only=true, or leave it unset",
                               "dllm_max_steps")
        if params.is_read and decisions.last_slot is None:
            raise RequestError("dllm_template has no slot, and a read (dllm_read_only) reads the template's slots: "
                               "mark the positions to read with the mask id, -1 or null", "dllm_template")
        return decisions


def read_params(params: GenerationConfig, decisions: Decisions) -> GenerationConfig:
    """The settings a read decodes with: greedy, its output the template's positions, no stop rule."""
    return params.model_copy(update=dict(
        do_sample=False, max_new_tokens=decisions.length, min_new_tokens=0, ignore_eos=True, stop_words=None,
        stop_token_ids=None, repetition_penalty=1.0))
