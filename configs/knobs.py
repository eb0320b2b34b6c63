"""The decoding knobs: one declaration per `dllm_*` setting, the single table the rest is derived from.

A knob is declared once here -- its type, bounds, engine-wide default, meaning, which decoding
paradigms read it and, within a paradigm, which unmasking rules -- and everything else is built
from this table: the `dllm_*` fields of `EngineConfig` and of the per-request `DllmOverrides`
(hence `GenerationConfig` and every HTTP request model, OpenAPI included), the names the
lmdeploy and JetEngine adapters and SGLang's `--dllm-algorithm-config` keys map (and the keys of a
DiffusionGemma generation_config.json), the refusals on a model that cannot use a knob, a request's
resolved settings (`settings_of`: the unmasking and the renoising settings), the flags of
`python -m engine.trace`, the knob row of the /viewer page, and the tables of docs/config-reference.md.

A *paradigm* (`Paradigm`) is how a model family decodes (its family's registry row names it):
`autoregressive` (one token per forward), `block` (block diffusion: every masked position of a block is
a candidate at every step), `sub_block` (a token shift and sub-blocks decoded left to right),
`renoising` (DiffusionGemma: a canvas of random tokens refined as a whole, every position rewritten each
step) or `seeded_block` (Nemotron-Labs-Diffusion: per request autoregressive, or blocks anchored at the
prompt end, each opened by a causal seed token; `dllm_mode` chooses). A knob a paradigm does not read is
refused on its models: per request with a 400 naming the field, and engine-wide at engine start when
set to anything but its default (an autoregressive engine logs them as ignored instead: see
`ENGINE_WIDE_IGNORED`). Token editing's knobs are refused on a request whose rule does not edit. A
family's published defaults (`decoding_defaults` of its registry row) replace the engine-wide default of
the knobs it reads.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, Field, create_model

_T = TypeVar("_T")


class Paradigm(str, Enum):
    """How a model family decodes: the one name its registry row, its decoding strategy and the knob table
    use. A member is its name as a string (`Paradigm.BLOCK == "block"`, formatted and serialized as
    `block`)."""

    AUTOREGRESSIVE = "autoregressive"
    BLOCK = "block"
    SUB_BLOCK = "sub_block"
    RENOISING = "renoising"
    SEEDED_BLOCK = "seeded_block"

    __str__ = str.__str__
    __format__ = str.__format__


PARADIGMS: dict[Paradigm, str] = {
    Paradigm.AUTOREGRESSIVE: "causal LMs: one token per forward",
    Paradigm.BLOCK: "block diffusion: every masked position of the block is a candidate at every step",
    Paradigm.SUB_BLOCK: "a token shift and sub-blocks of the block decoded left to right",
    Paradigm.RENOISING: "uniform-state renoising: every position of a canvas is resampled or re-noised at every "
                        "step",
    Paradigm.SEEDED_BLOCK: "per request (dllm_mode) autoregressive, or blocks anchored at the prompt end, each opened "
                           "with the causal prediction before it, denoised bidirectionally over the causal prefix and "
                           "committed by a causal forward",
}
_BLOCK, _SUB_BLOCK, _RENOISING = (Paradigm.BLOCK,), (Paradigm.SUB_BLOCK,), (Paradigm.RENOISING,)
_SEEDED = (Paradigm.SEEDED_BLOCK,)
DIFFUSION: tuple[Paradigm, ...] = (Paradigm.BLOCK, Paradigm.SUB_BLOCK)
# paradigms whose blocks start as mask tokens (the engine resolves the model's mask token for them)
MASKED: tuple[Paradigm, ...] = (*DIFFUSION, Paradigm.SEEDED_BLOCK)
# Paradigms whose engines accept (and log as ignored) engine-wide knobs they do not read: one engine
# config is written for whichever checkpoint a deployment serves, and an autoregressive model has no
# diffusion decoding for them to misconfigure. Other paradigms refuse them at engine start.
ENGINE_WIDE_IGNORED: tuple[Paradigm, ...] = (Paradigm.AUTOREGRESSIVE,)


@dataclass(frozen=True)
class RuleSpec:
    """An unmasking rule as users name it (`dllm_unmasking_strategy`): the paradigms that decode with it,
    whether it may rewrite tokens it already revealed (token editing), and its own defaults of knobs it
    reads (`defaults`: a request decoding with it gets them where neither it nor the engine config set
    the knob; they replace the family's and the table's defaults). `greedy`: it picks from the model's
    own logits and never samples, so a request decoding with it that leaves `temperature` unset is
    greedy (temperature 0, whatever the API's default temperature), and one that sets a sampling
    temperature is refused naming `temperature`. `refuses`: request fields the rule cannot honour, each
    with why; a request setting one to anything but its default is refused naming it."""

    name: str
    paradigms: tuple[Paradigm, ...]
    doc: str
    edits: bool = False
    defaults: Mapping[str, Any] = field(default_factory=dict)
    greedy: bool = False
    refuses: Mapping[str, str] = field(default_factory=dict)


# token editing rewrites tokens after they were written, so a rollout's step map no longer gives each
# token's input: such rollouts cannot be scored
_EDITED_TRAJECTORY = {"dllm_trajectory": "a rollout decoded with token editing cannot be scored: its tokens' "
                                         "inputs changed after they were written; score rollouts decoded without "
                                         "edits"}
_GREEDY_LOGITS = "it decodes greedily from the model's own logits"
# insert/delete editing moves tokens between positions: typed decisions tied to a position cannot hold
_MOVES = ("its deletes and inserts move tokens between positions, so a slot's {} would not stay at its slot (use "
          "joint_threshold or a reveal rule; templates are served, their pinned positions stay in place)")


RULE_SPECS: dict[str, RuleSpec] = {r.name: r for r in (
    RuleSpec("low_confidence_dynamic", DIFFUSION, "every position at least dllm_confidence_threshold confident, "
             "at least the step's quota (sub-block: above the threshold, else the most confident one)"),
    RuleSpec("low_confidence_static", _BLOCK, "the step's quota of most confident positions"),
    RuleSpec("sequential", _BLOCK, "the step's quota of leftmost masked positions"),
    RuleSpec("entropy_bounded", _BLOCK, "the lowest-entropy positions while their summed entropy stays below "
             "dllm_entropy_threshold"),
    RuleSpec("random", _BLOCK, "the step's quota of positions drawn uniformly (seeded by the request)"),
    RuleSpec("joint_threshold", _BLOCK, "reveal above dllm_confidence_threshold (else the most confident) and "
             "rewrite revealed tokens whose candidate is more confident than dllm_edit_threshold", edits=True,
             refuses=_EDITED_TRAJECTORY),
    RuleSpec("joint_threshold_indel", _BLOCK, "joint_threshold's reveals and rewrites (at least 1 + the masks it "
             "introduced while original masks remain), plus insert/delete edits: a DELETE candidate drops its "
             "position, a SPLIT one inserts a mask before its token; greedy; threshold 0.5 unless set", edits=True,
             defaults={"dllm_confidence_threshold": 0.5}, greedy=True,
             refuses={**_EDITED_TRAJECTORY, "repetition_penalty": _GREEDY_LOGITS, "min_new_tokens": _GREEDY_LOGITS,
                      "dllm_allowed_token_ids": _MOVES.format("set"), "dllm_read_only": _MOVES.format("answer")}),
)}
# a runtime Literal over the table's names, so that no second list of them exists
UnmaskingStrategy = Literal[tuple(RULE_SPECS)]  # type: ignore[valid-type]
EDITING_RULES: tuple[str, ...] = tuple(r.name for r in RULE_SPECS.values() if r.edits)
GREEDY_RULES: tuple[str, ...] = tuple(r.name for r in RULE_SPECS.values() if r.greedy)


@dataclass(frozen=True)
class Knob:
    """One decoding setting. `default` is the engine-wide default; a request's field defaults to None
    (the engine's setting). `bounds` are pydantic's constraints (ge, le, gt, allow_inf_nan), the same
    engine-wide and per request. `rules`: the unmasking rules that read it (None: every rule of its
    paradigms). `upstream`: its name in another engine's settings (`lmdeploy`, `jetengine.sampling`,
    `jetengine.config`, `sglang.algorithm`: SGLang's dLLM algorithm config; `transformers`: a checkpoint's
    generation_config.json as transformers reads it; a dotted name is a key of a nested mapping).
    `strict_rules`: a request setting it under a rule that does not read it is refused (token editing's
    knobs: asking for edits without an editing rule is a mistake); the other rule-specific knobs are a
    request's settings for whichever rule it decodes with, accepted under every rule of their paradigms.
    `fixed`: the model's own value, which a request may only repeat (so it is no setting a request
    resolves or a page offers). `flag`: its `python -m engine.trace` flag and `label`: its caption in the
    viewer's knob row, both derived from `setting` unless given. `aliases`: other engines' names for its
    values (SGLang's algorithm names for a mode), accepted wherever the knob is and read as the table's."""

    name: str
    type: Any
    default: Any
    doc: str
    used_by: tuple[Paradigm, ...]
    bounds: Mapping[str, Any] = field(default_factory=dict)
    rules: tuple[str, ...] | None = None
    per_request: bool = True
    request_doc: str = ""
    upstream: Mapping[str, str] = field(default_factory=dict)
    strict_rules: bool = False
    fixed: bool = False
    flag: str = ""
    label: str = ""
    aliases: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "flag", self.flag or "--" + self.setting.replace("_", "-"))
        object.__setattr__(self, "label", self.label or self.setting.replace("_", " ").capitalize())

    @property
    def setting(self) -> str:
        """The knob's name among a request's resolved settings (`dllm_unmasking_strategy`: `strategy`)."""
        return self.name.removeprefix("dllm_").removeprefix("unmasking_")

    def canonical(self, value: Any) -> Any:
        """`value` under the table's name for it (an alias replaced; anything else as it is)."""
        return self.aliases.get(value, value) if isinstance(value, str) else value

    @property
    def value_type(self) -> Any:
        """The type of its values once set: `type` without its None (`int | None`: int)."""
        if not isinstance(self.type, types.UnionType):
            return self.type
        kinds = [k for k in typing.get_args(self.type) if k is not type(None)]
        return kinds[0] if len(kinds) == 1 else self.type

    def choices(self, paradigm: str | None = None) -> list[str] | None:
        """The values of a knob that takes one of some names (None for the others); the unmasking rule's, of
        `paradigm` where given."""
        if typing.get_origin(self.value_type) is not Literal:
            return None
        names = list(typing.get_args(self.value_type))
        if paradigm is not None and self.value_type == UnmaskingStrategy:
            names = [n for n in names if n in rules_of(paradigm)]
        return names


_UNIT = {"ge": 0.0, "le": 1.0}
KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("dllm_block_length", int | None, None, "positions per diffusion block; default: the checkpoint's, else "
         "the family's", (*DIFFUSION, *_SEEDED), {"ge": 1}, fixed=True,
         request_doc="must equal the model's block length if given (it cannot change per request)",
         upstream={"lmdeploy": "dllm_block_length", "jetengine.sampling": "block_length",
                   "jetengine.config": "block_length", "sglang.algorithm": "block_size"}),
    Knob("dllm_unmasking_strategy", UnmaskingStrategy, "low_confidence_dynamic", "the unmasking rule: which "
         "masked positions a denoising step reveals (and, for joint_threshold, which tokens it rewrites)",
         DIFFUSION, upstream={"lmdeploy": "dllm_unmasking_strategy", "jetengine.sampling": "remasking_strategy"}),
    Knob("dllm_denoising_steps", int | None, None, "steps per block (the step quota); default: the block length",
         _BLOCK, {"ge": 1}, rules=("low_confidence_dynamic", "low_confidence_static", "sequential", "random"),
         upstream={"lmdeploy": "dllm_denoising_steps", "jetengine.sampling": "denoising_steps"},
         flag="--steps", label="Steps / block"),
    Knob("dllm_confidence_threshold", float, 0.85, "low_confidence_dynamic: reveal every position at least this "
         "confident (joint_threshold and joint_threshold_indel: strictly more; seeded_block's diffusion mode: the "
         "most confident position and every other at least this confident, one position per step when neither the "
         "request nor the engine config sets it)", (*DIFFUSION, *_SEEDED), _UNIT,
         rules=("low_confidence_dynamic", "joint_threshold", "joint_threshold_indel"),
         upstream={"lmdeploy": "dllm_confidence_threshold", "jetengine.sampling": "dynamic_threshold",
                   "sglang.algorithm": "threshold"}, flag="--threshold", label="Threshold"),
    Knob("dllm_entropy_threshold", float, 0.35, "entropy_bounded: reveal the lowest-entropy positions while their "
         "summed entropy (nats) stays below this bound", _BLOCK, {"gt": 0.0}, rules=("entropy_bounded",),
         upstream={"jetengine.sampling": "eb_threshold"}),
    Knob("dllm_edit_threshold", float, 0.0, "token editing: rewrite a revealed token when the model's candidate "
         "for its position differs and is more confident than this", _BLOCK, _UNIT, rules=EDITING_RULES,
         strict_rules=True, upstream={"sglang.algorithm": "edit_threshold"}),
    Knob("dllm_max_post_edit_steps", int, 16, "token editing: steps a block may keep editing after its last mask "
         "is revealed (joint_threshold_indel: counted in all, also while masks reappear)", _BLOCK, {"ge": 0},
         rules=EDITING_RULES, strict_rules=True, upstream={"sglang.algorithm": "max_post_edit_steps"},
         label="Post-edit steps"),
    Knob("dllm_penalty_lambda", float, 0.0, "joint_threshold: lower the logit of the token at the previous position "
         "by this much (repetition damping inside a block)", _BLOCK, {"ge": 0.0, "allow_inf_nan": False},
         rules=("joint_threshold",), strict_rules=True, upstream={"sglang.algorithm": "penalty_lambda"},
         label="Penalty λ"),
    Knob("dllm_sub_block_length", int, 8, "Fast-dLLM v2: a block is decoded in sub-blocks of this many positions, "
         "left to right (must divide the block length)", _SUB_BLOCK, {"ge": 1}, per_request=False),
    Knob("dllm_commit_fusion", bool, True, "fuse a block's commit forward with the next block's first step",
         _BLOCK, per_request=False),
    Knob("dllm_mask_token_id", int | None, None, "mask token of a block-diffusion model whose checkpoint names none",
         MASKED, {"ge": 0}, per_request=False, upstream={"jetengine.config": "mask_token_id"}),
    Knob("dllm_delete_token_id", int | None, None, "joint_threshold_indel's DELETE token, for a checkpoint whose "
         "config.json names no delete_token_id", _BLOCK, {"ge": 0}, per_request=False),
    Knob("dllm_split_token_id", int | None, None, "joint_threshold_indel's SPLIT token, for a checkpoint whose "
         "config.json names no split_token_id", _BLOCK, {"ge": 0}, per_request=False),
    Knob("dllm_mode", Literal["ar", "diffusion", "linear_spec"], "diffusion", "seeded_block: how a request decodes: "
         "ar (one causal token per forward), diffusion (blocks anchored at the prompt end, each opened with a causal "
         "seed and denoised over the causal prefix) or linear_spec (self-speculation: drafts verified by a causal "
         "forward, greedy output equal to ar's)", _SEEDED,
         aliases={"FastDiffuser": "diffusion", "LinearSpec": "linear_spec"}),
    Knob("dllm_draft_lora", bool, False, "seeded_block's linear_spec: its draft passes run the checkpoint's draft "
         "adapter (linear_spec_lora/, a LoRA on every o_proj; verifies and every other forward run the plain "
         "weights)", _SEEDED, per_request=False),
    # renoising (DiffusionGemma); the checkpoint's generation_config.json replaces these defaults
    Knob("dllm_max_denoising_steps", int, 48, "renoising: steps per canvas at most (N of the temperature schedule)",
         _RENOISING, {"ge": 1}, label="Steps / canvas",
         upstream={"sglang.algorithm": "max_denoising_steps", "transformers": "max_denoising_steps"}),
    Knob("dllm_entropy_bound", float, 0.1, "renoising: accept the lowest-entropy samples while their summed entropy, "
         "less the last one's, stays within this bound (nats); the rest are re-noised", _RENOISING,
         {"gt": 0.0, "allow_inf_nan": False},
         upstream={"sglang.algorithm": "sampler_config.entropy_bound", "transformers": "sampler_config.entropy_bound"}),
    Knob("dllm_t_min", float, 0.4, "renoising: the temperature of a canvas's last step (must be below dllm_t_max)",
         _RENOISING, {"ge": 0.0, "allow_inf_nan": False},
         upstream={"sglang.algorithm": "temperature_schedule.t_min", "transformers": "t_min"}),
    Knob("dllm_t_max", float, 0.8, "renoising: the temperature a canvas starts from (falls linearly to dllm_t_min "
         "over dllm_max_denoising_steps)", _RENOISING, {"gt": 0.0, "allow_inf_nan": False},
         upstream={"sglang.algorithm": "temperature_schedule.t_max", "transformers": "t_max"}),
    Knob("dllm_stability_threshold", int, 1, "renoising: a canvas may stop once its argmax equals that of this many "
         "previous steps", _RENOISING, {"ge": 0}, label="Stable steps",
         upstream={"sglang.algorithm": "stopping_config.stability_threshold", "transformers": "stability_threshold"}),
    Knob("dllm_stop_entropy", float, 0.005, "renoising: a stable canvas stops once its mean entropy (nats) is "
         "below this",
         _RENOISING, {"gt": 0.0, "allow_inf_nan": False},
         upstream={"sglang.algorithm": "stopping_config.confidence_threshold", "transformers": "confidence_threshold"}),
    Knob("dllm_canvas_length", int, 0, "renoising: positions per canvas, at most the checkpoint's canvas_length (a "
         "narrower canvas emits that many tokens at a time; vLLM's diffusion_canvas_length); 0: the checkpoint's",
         _RENOISING, {"ge": 0}, label="Canvas"),
)}
RENOISING_KNOBS: tuple[str, ...] = tuple(k.name for k in KNOBS.values() if Paradigm.RENOISING in k.used_by)


def request_knobs() -> list[Knob]:
    return [k for k in KNOBS.values() if k.per_request]


def rule_knobs(rule: str) -> tuple[str, ...]:
    """The request knobs an unmasking rule reads (beyond the block length)."""
    return tuple(k.name for k in request_knobs() if k.rules is not None and rule in k.rules)


def unusable(paradigm: str) -> list[Knob]:
    """The knobs a model of `paradigm` has no use for (refused when set)."""
    return [k for k in KNOBS.values() if paradigm not in k.used_by]


def rules_of(paradigm: str) -> tuple[str, ...]:
    return tuple(r.name for r in RULE_SPECS.values() if paradigm in r.paradigms)


def upstream_names(api: str) -> dict[str, str]:
    """knob name -> its name in another engine's settings (`api`: a key of `Knob.upstream`)."""
    return {k.name: k.upstream[api] for k in KNOBS.values() if api in k.upstream}


def upstream_values(api: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """knob name -> its value in another engine's `settings` (a dotted name looks into nested mappings),
    for the knobs `settings` sets (to anything but None)."""
    found = {}
    for knob, key in upstream_names(api).items():
        value: Any = settings
        for part in key.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if value is not None:
            found[knob] = value
    return found


def settings_of(*paradigms: Paradigm) -> Callable[[type[_T]], type[_T]]:
    """A class decorator: the class becomes a frozen dataclass of a request's resolved settings of
    `paradigms`, its fields the table's -- one per per-request knob one of them reads (but `fixed` ones),
    in the table's order, named by its `setting`, of its value type and defaulting to its default; the
    class's `KNOBS` are those knobs. A knob whose default is None is resolved per model (the step quota:
    from the block length), so its field has no default, nor have those before it (the dataclass's
    required fields come first)."""
    knobs = tuple(k for k in request_knobs() if not k.fixed and set(paradigms) & set(k.used_by))
    required = max((i + 1 for i, k in enumerate(knobs) if k.default is None), default=0)

    def make(cls: type[_T]) -> type[_T]:
        cls.__annotations__ = {k.setting: k.value_type for k in knobs}
        for knob in knobs[required:]:
            setattr(cls, knob.setting, knob.default)
        settings = dataclass(frozen=True)(cls)
        settings.KNOBS = knobs  # type: ignore[attr-defined]
        return settings

    return make


def knob_model(name: str, doc: str, per_request: bool) -> type[BaseModel]:
    """A pydantic model of the knobs as fields: engine-wide (their defaults) or per request (None =
    the engine's setting, same bounds)."""
    fields: dict[str, Any] = {}
    for k in KNOBS.values():
        if per_request and not k.per_request:
            continue
        annotation = (k.type | None) if per_request else k.type
        if k.aliases:  # the knob's own method: the engine and request models' fields carry equal metadata
            annotation = Annotated[annotation, BeforeValidator(k.canonical)]
        description = (k.request_doc or k.doc) if per_request else k.doc
        fields[k.name] = (annotation, Field(None if per_request else k.default, description=description, **k.bounds))
    return create_model(name, __doc__=doc, __module__=__name__, **fields)
