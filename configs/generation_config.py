"""Per-request sampling and output settings."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from configs.knobs import GREEDY_RULES, knob_model
from configs.limits import (
    MAX_ALLOWED_IDS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_TEMPLATE,
    MIN_REPETITION_PENALTY,
)
from configs.trajectory import DllmTrajectory

AllowedIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_ALLOWED_IDS)]


class DecisionFields(BaseModel):
    """The typed-decision fields, in `GenerationConfig` and in every HTTP request model: a template over
    the first output positions, allowed sets at its slots, reads (`engine.core.decisions`)."""

    dllm_template: Annotated[list[Annotated[int, Field(ge=-1)] | None], Field(min_length=1, max_length=MAX_TEMPLATE)] \
        | None = Field(None, description="token ids laid over the first output positions: a slot (the model's mask id, "
                       "-1 or null) is decoded, any other id is pinned there (pre-revealed, never rewritten)")
    dllm_allowed_token_ids: AllowedIds | dict[Annotated[int, Field(ge=0)], AllowedIds] | None = Field(
        None, description="the ids a slot may take: one list for every slot, or {output position: [ids]} per slot "
        f"(at most {MAX_ALLOWED_IDS} ids a slot); other ids are set to -inf before any rule reads the slot's logits")
    dllm_read_only: bool | None = Field(None, description="a read: the slots' label logprobs after dllm_max_steps "
                                        "steps (default 1), the request ending with finish_reason read")
    dllm_max_steps: int | None = Field(None, ge=1, description="a read's steps (default 1)")

    @field_validator("dllm_allowed_token_ids", mode="before")
    @classmethod
    def _positions_as_ints(cls, value: Any) -> Any:
        """A JSON object's keys are strings: `{"3": [...]}` names output position 3."""
        if isinstance(value, dict):
            return {int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: v for k, v in value.items()}
        return value


# the per-request decoding knobs (None = the engine's setting): the same fields, with the same bounds,
# in `GenerationConfig` and in every HTTP request model
class DllmOverrides(knob_model("DllmOverrides", "", per_request=True)):
    """Block-diffusion settings a request may override (None = the engine's setting)."""

    @model_validator(mode="before")
    @classmethod
    def _unset_temperature_under_a_greedy_rule(cls, data: Any) -> Any:
        """A request that names a rule which only decodes greedily (`RuleSpec.greedy`) and leaves
        `temperature` unset is greedy: temperature 0, in place of its model's default (1.0 in
        GenerationConfig and in every HTTP body, which derive from this class). A temperature the
        request sets is kept (the engine refuses a sampling one, naming it)."""
        if (isinstance(data, dict) and "temperature" in cls.model_fields and "temperature" not in data
                and data.get("dllm_unmasking_strategy") in GREEDY_RULES):
            return {**data, "temperature": 0.0}
        return data


class GenerationConfig(DllmOverrides, DecisionFields):
    """What one request asks for. Invalid values raise ValueError naming the field."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    max_new_tokens: int = Field(512, ge=0, description="0 only for scoring")
    min_new_tokens: int = Field(0, ge=0)
    do_sample: bool = False
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = 1.0
    top_k: int = Field(0, ge=0, description="0 = disabled")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    random_seed: int | None = None
    stop_words: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = Field(None, ge=0, description="None = none; k = chosen + top-k")
    logprob_start_len: int = Field(-1, ge=-1)
    return_step_trace: bool = False
    # RL rollouts
    n: int = Field(1, ge=1, le=MAX_N, description="samples per prompt")
    return_block_step_map: bool = False
    return_dllm_replay: bool = False
    dllm_trajectory: DllmTrajectory | None = Field(
        None, description="score this rollout instead of generating (block diffusion; max_new_tokens=0)"
    )

    @field_validator("top_p")
    @classmethod
    def _top_p_range(cls, v: float) -> float:
        if not (0.0 < v <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        return v

    @field_validator("stop_words")
    @classmethod
    def _stop_words_nonempty(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(len(w) == 0 for w in v):
            raise ValueError("stop_words must not contain empty strings")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_nonneg(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(i < 0 for i in v):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return v

    @model_validator(mode="after")
    def _check(self) -> GenerationConfig:
        # a trajectory is scored under the min_new_tokens it was generated with
        if self.min_new_tokens > self.max_new_tokens and self.dllm_trajectory is None:
            raise ValueError("min_new_tokens must not exceed max_new_tokens")
        if self.dllm_read_only:  # a read returns its slots' label logprobs: every id of the largest set
            sets = self.dllm_allowed_token_ids
            largest = max((len(ids) for ids in ([sets] if isinstance(sets, list) else (sets or {}).values())),
                          default=0)
            if self.logprobs is None or self.logprobs < largest:
                self.__dict__["logprobs"] = largest
        return self

    @property
    def is_read(self) -> bool:
        """A typed read (`dllm_read_only`): its slots' label logprobs, then the request ends."""
        return bool(self.dllm_read_only)

    @property
    def decision_field(self) -> str | None:
        """The first typed-decision field the request sets (`dllm_read_only=false` sets none), for a
        refusal to name; None: it sets none."""
        return next((f for f in DecisionFields.model_fields if getattr(self, f) not in (None, False)), None)

    @property
    def has_decisions(self) -> bool:
        """Whether the request sets any typed-decision field (template, allowed sets, read)."""
        return self.decision_field is not None

    def samples(self) -> list[GenerationConfig]:
        """The `n` samples of a request as n single-sample configs: sample i is seeded
        `random_seed + i` (so each sample is reproducible on its own); unseeded samples each get
        fresh randomness."""
        if self.n == 1:
            return [self]
        return [self.model_copy(update={"n": 1, "random_seed": None if self.random_seed is None
                                        else self.random_seed + i}) for i in range(self.n)]

    @property
    def is_greedy(self) -> bool:
        """Greedy when sampling is off or the temperature is (numerically) 0, the HTTP convention:
        dividing logits by a temperature below 1e-5 would overflow to inf/NaN probabilities."""
        return not self.do_sample or self.temperature < 1e-5
