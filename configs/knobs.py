"""The decoding knobs: one declaration per `dllm_*` setting, the single table the rest is derived from.

A knob is declared once here -- its type, bounds, engine-wide default, meaning, which decoding
paradigms read it and, within a paradigm, which unmasking rules -- and everything else is built
from this table: the `dllm_*` fields of `EngineConfig` and of the per-request `DllmOverrides`
(hence `GenerationConfig` and every HTTP request model, OpenAPI included), the names the
lmdeploy and JetEngine adapters and SGLang's `--dllm-algorithm-config` keys map, the refusals on
a model that cannot use a knob, and the tables of docs/config-reference.md.

A *paradigm* is how a model family decodes (its family's registry row names it): `autoregressive`
(one token per forward), `block` (block diffusion: every masked position of a block is a candidate
at every step), `sub_block` (a token shift and sub-blocks decoded left to right) or `renoising`
(DiffusionGemma: a canvas of random tokens refined as a whole, every position rewritten each step). A knob a
paradigm does not read is refused on its models: per request with a 400 naming the field, and
engine-wide at engine start when set to anything but its default (an autoregressive engine logs them
as ignored instead: see `ENGINE_WIDE_IGNORED`). Token editing's knobs are refused on a request whose
rule does not edit. A family's published defaults
(`decoding_defaults` of its registry row) replace the engine-wide default of the knobs it reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field, create_model

Paradigm = Literal["autoregressive", "block", "sub_block", "renoising"]
PARADIGMS: dict[str, str] = {
    "autoregressive": "causal LMs: one token per forward",
    "block": "block diffusion: every masked position of the block is a candidate at every step",
    "sub_block": "a token shift and sub-blocks of the block decoded left to right",
    "renoising": "uniform-state renoising: every position of a canvas is resampled or re-noised at every step",
}
DIFFUSION: tuple[Paradigm, ...] = ("block", "sub_block")
# Paradigms whose engines accept (and log as ignored) engine-wide knobs they do not read: one engine
# config is written for whichever checkpoint a deployment serves, and an autoregressive model has no
# diffusion decoding for them to misconfigure. Other paradigms refuse them at engine start.
ENGINE_WIDE_IGNORED: tuple[Paradigm, ...] = ("autoregressive",)


@dataclass(frozen=True)
class RuleSpec:
    """An unmasking rule as users name it (`dllm_unmasking_strategy`): the paradigms that decode with it,
    whether it may rewrite tokens it already revealed (token editing), and its own defaults of knobs it
    reads (`defaults`: a request decoding with it gets them where neither it nor the engine config set
    the knob; they replace the family's and the table's defaults). `greedy`: it picks from the model's
    own logits and never samples, so a request decoding with it that leaves `temperature` unset is
    greedy (temperature 0, whatever the API's default temperature), and one that sets a sampling
    temperature is refused naming `temperature`."""

    name: str
    paradigms: tuple[Paradigm, ...]
    doc: str
    edits: bool = False
    defaults: Mapping[str, Any] = field(default_factory=dict)
    greedy: bool = False


RULE_SPECS: dict[str, RuleSpec] = {r.name: r for r in (
    RuleSpec("low_confidence_dynamic", DIFFUSION, "every position at least dllm_confidence_threshold confident, "
             "at least the step's quota (sub-block: above the threshold, else the most confident one)"),
    RuleSpec("low_confidence_static", ("block",), "the step's quota of most confident positions"),
    RuleSpec("sequential", ("block",), "the step's quota of leftmost masked positions"),
    RuleSpec("entropy_bounded", ("block",), "the lowest-entropy positions while their summed entropy stays below "
             "dllm_entropy_threshold"),
    RuleSpec("random", ("block",), "the step's quota of positions drawn uniformly (seeded by the request)"),
    RuleSpec("joint_threshold", ("block",), "reveal above dllm_confidence_threshold (else the most confident) and "
             "rewrite revealed tokens whose candidate is more confident than dllm_edit_threshold", edits=True),
    RuleSpec("joint_threshold_indel", ("block",), "joint_threshold's reveals and rewrites (at least 1 + the masks it "
             "introduced while original masks remain), plus insert/delete edits: a DELETE candidate drops its "
             "position, a SPLIT one inserts a mask before its token; greedy; threshold 0.5 unless set", edits=True,
             defaults={"dllm_confidence_threshold": 0.5}, greedy=True),
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
    `jetengine.config`, `sglang.algorithm`: SGLang's dLLM algorithm config), for the adapters.
    `strict_rules`: a request setting it under a rule that does not read it is refused (token editing's
    knobs: asking for edits without an editing rule is a mistake); the other rule-specific knobs are a
    request's settings for whichever rule it decodes with, accepted under every rule of their paradigms."""

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

    @property
    def setting(self) -> str:
        """The knob's name among a request's resolved settings (`dllm_unmasking_strategy`: `strategy`)."""
        return self.name.removeprefix("dllm_").removeprefix("unmasking_")


_UNIT = {"ge": 0.0, "le": 1.0}
KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("dllm_block_length", int | None, None, "positions per diffusion block; default: the checkpoint's, else "
         "the family's", DIFFUSION, {"ge": 1},
         request_doc="must equal the model's block length if given (it cannot change per request)",
         upstream={"lmdeploy": "dllm_block_length", "jetengine.sampling": "block_length",
                   "jetengine.config": "block_length", "sglang.algorithm": "block_size"}),
    Knob("dllm_unmasking_strategy", UnmaskingStrategy, "low_confidence_dynamic", "the unmasking rule: which "
         "masked positions a denoising step reveals (and, for joint_threshold, which tokens it rewrites)",
         DIFFUSION, upstream={"lmdeploy": "dllm_unmasking_strategy", "jetengine.sampling": "remasking_strategy"}),
    Knob("dllm_denoising_steps", int | None, None, "steps per block (the step quota); default: the block length",
         ("block",), {"ge": 1}, rules=("low_confidence_dynamic", "low_confidence_static", "sequential", "random"),
         upstream={"lmdeploy": "dllm_denoising_steps", "jetengine.sampling": "denoising_steps"}),
    Knob("dllm_confidence_threshold", float, 0.85, "low_confidence_dynamic: reveal every position at least this "
         "confident (joint_threshold and joint_threshold_indel: strictly more)", DIFFUSION, _UNIT,
         rules=("low_confidence_dynamic", "joint_threshold", "joint_threshold_indel"),
         upstream={"lmdeploy": "dllm_confidence_threshold", "jetengine.sampling": "dynamic_threshold",
                   "sglang.algorithm": "threshold"}),
    Knob("dllm_entropy_threshold", float, 0.35, "entropy_bounded: reveal the lowest-entropy positions while their "
         "summed entropy (nats) stays below this bound", ("block",), {"gt": 0.0}, rules=("entropy_bounded",),
         upstream={"jetengine.sampling": "eb_threshold"}),
    Knob("dllm_edit_threshold", float, 0.0, "token editing: rewrite a revealed token when the model's candidate "
         "for its position differs and is more confident than this", ("block",), _UNIT, rules=EDITING_RULES,
         strict_rules=True, upstream={"sglang.algorithm": "edit_threshold"}),
    Knob("dllm_max_post_edit_steps", int, 16, "token editing: steps a block may keep editing after its last mask "
         "is revealed (joint_threshold_indel: counted in all, also while masks reappear)", ("block",), {"ge": 0},
         rules=EDITING_RULES, strict_rules=True, upstream={"sglang.algorithm": "max_post_edit_steps"}),
    Knob("dllm_penalty_lambda", float, 0.0, "joint_threshold: lower the logit of the token at the previous position "
         "by this much (repetition damping inside a block)", ("block",), {"ge": 0.0, "allow_inf_nan": False},
         rules=("joint_threshold",), strict_rules=True, upstream={"sglang.algorithm": "penalty_lambda"}),
    Knob("dllm_sub_block_length", int, 8, "Fast-dLLM v2: a block is decoded in sub-blocks of this many positions, "
         "left to right (must divide the block length)", ("sub_block",), {"ge": 1}, per_request=False),
    Knob("dllm_commit_fusion", bool, True, "fuse a block's commit forward with the next block's first step",
         ("block",), per_request=False),
    Knob("dllm_mask_token_id", int | None, None, "mask token of a block-diffusion model whose checkpoint names none",
         DIFFUSION, {"ge": 0}, per_request=False, upstream={"jetengine.config": "mask_token_id"}),
    Knob("dllm_delete_token_id", int | None, None, "joint_threshold_indel's DELETE token, for a checkpoint whose "
         "config.json names no delete_token_id", ("block",), {"ge": 0}, per_request=False),
    Knob("dllm_split_token_id", int | None, None, "joint_threshold_indel's SPLIT token, for a checkpoint whose "
         "config.json names no split_token_id", ("block",), {"ge": 0}, per_request=False),
    # renoising (DiffusionGemma); the checkpoint's generation_config.json replaces these defaults
    Knob("dllm_max_denoising_steps", int, 48, "renoising: steps per canvas at most (N of the temperature schedule)",
         ("renoising",), {"ge": 1}, upstream={"sglang.algorithm": "max_denoising_steps"}),
    Knob("dllm_entropy_bound", float, 0.1, "renoising: accept the lowest-entropy samples while their summed entropy, "
         "less the last one's, stays within this bound (nats); the rest are re-noised", ("renoising",),
         {"gt": 0.0, "allow_inf_nan": False}, upstream={"sglang.algorithm": "sampler_config.entropy_bound"}),
    Knob("dllm_t_min", float, 0.4, "renoising: the temperature of a canvas's last step (must be below dllm_t_max)",
         ("renoising",), {"ge": 0.0, "allow_inf_nan": False},
         upstream={"sglang.algorithm": "temperature_schedule.t_min"}),
    Knob("dllm_t_max", float, 0.8, "renoising: the temperature a canvas starts from (falls linearly to dllm_t_min "
         "over dllm_max_denoising_steps)", ("renoising",), {"gt": 0.0, "allow_inf_nan": False},
         upstream={"sglang.algorithm": "temperature_schedule.t_max"}),
    Knob("dllm_stability_threshold", int, 1, "renoising: a canvas may stop once its argmax equals that of this many "
         "previous steps", ("renoising",), {"ge": 0},
         upstream={"sglang.algorithm": "stopping_config.stability_threshold"}),
    Knob("dllm_stop_entropy", float, 0.005, "renoising: a stable canvas stops once its mean entropy (nats) is "
         "below this",
         ("renoising",), {"gt": 0.0, "allow_inf_nan": False},
         upstream={"sglang.algorithm": "stopping_config.confidence_threshold"}),
)}
RENOISING_KNOBS: tuple[str, ...] = tuple(k.name for k in KNOBS.values() if "renoising" in k.used_by)


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


def knob_model(name: str, doc: str, per_request: bool) -> type[BaseModel]:
    """A pydantic model of the knobs as fields: engine-wide (their defaults) or per request (None =
    the engine's setting, same bounds)."""
    fields: dict[str, Any] = {}
    for k in KNOBS.values():
        if per_request and not k.per_request:
            continue
        annotation = (k.type | None) if per_request else k.type
        description = (k.request_doc or k.doc) if per_request else k.doc
        fields[k.name] = (annotation, Field(None if per_request else k.default, description=description, **k.bounds))
    return create_model(name, __doc__=doc, __module__=__name__, **fields)
