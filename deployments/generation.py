"""What every generation endpoint (SGLang's /generate, OpenAI's completions and chat) shares: the
strict base of the request models, the sampling fields, their conversion to engine requests, and the
readers of the engine's results (`deployments.wire.Result`) that every response builder uses.

Every response builder maps a result field by field and element by element, so building each
streamed delta and concatenating equals building the folded result.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from configs import GenerationConfig
from configs.generation_config import DecisionFields, DllmOverrides
from configs.limits import (
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    SAMPLING_EPS,
)
from deployments.errors import ApiError, validation_error
from deployments.wire import EngineRequest, Prompt, Result, new_request_id


class Strict(BaseModel):
    # strict: no coercion ("5" is not an int, 1 is not a bool); NaN / Infinity (which Python's json
    # accepts) are refused with the field's name.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class SamplingFields(Strict, DllmOverrides, DecisionFields):
    """Fields shared by every endpoint (HTTP names); the per-request `dllm_*` knobs as the engine's
    (dllm_block_length, if given, must equal the model's: 400 otherwise)."""

    temperature: float = Field(1.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=MAX_TOP_K, description="-1 or 0 = disabled")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: (Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]
           | Annotated[list[Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]],
                       Field(max_length=MAX_STOP_STRINGS)]
           | None) = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


# GenerationConfig field -> HTTP field, for error messages (endpoints add their own entries).
HTTP_RENAME = {"max_new_tokens": "max_tokens", "random_seed": "seed", "stop_words": "stop",
               "min_new_tokens": "min_tokens", "do_sample": "temperature"}


def output_fields(req: Any) -> dict[str, bool]:
    """The engine's output options a request model carries (what each endpoint has of them)."""
    return dict(return_step_trace=getattr(req, "return_step_trace", False),
                return_block_step_map=req.return_block_step_map,
                return_dllm_replay=req.return_dllm_replay)


def logprob_fields(return_logprob: bool, top_logprobs_num: int, logprob_start_len: int, name: str) -> dict:
    """SGLang's logprob switches as GenerationConfig fields (`name` is the top-k field's HTTP name)."""
    if top_logprobs_num > 0 and not return_logprob:
        raise ApiError(f"{name} > 0 needs return_logprob=true", name)
    return dict(logprobs=top_logprobs_num if return_logprob else None, logprob_start_len=logprob_start_len)


def _sampling(req: SamplingFields) -> dict[str, Any]:
    """The sampling fields as GenerationConfig's: those the client set, and `do_sample` (the HTTP
    default temperature, 1.0, samples). A field left unset is left out, so that the engine sees it
    unset, with the same value (each HTTP default is GenerationConfig's; top_k's -1 is its 0): a rule
    that only decodes greedily takes an unset temperature as greedy, as offline."""
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    sample = req.temperature >= SAMPLING_EPS
    fields = dict(
        do_sample=sample,
        temperature=req.temperature if sample else 1.0,
        top_p=req.top_p, top_k=max(req.top_k, 0), min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, random_seed=req.seed,
        stop_words=stop or None, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        **{f: getattr(req, f) for f in (*DllmOverrides.model_fields, *DecisionFields.model_fields)},
    )
    given = req.model_fields_set
    return {k: v for k, v in fields.items() if k == "do_sample" or HTTP_RENAME.get(k, k) in given}


def engine_requests(prompt: Prompt, sampling: SamplingFields, rename: Mapping[str, str], prefix: str = "req",
                    request_id: str | None = None, **fields: Any) -> list[EngineRequest]:
    """The engine requests of one prompt: the shared sampling fields plus the endpoint's own
    GenerationConfig fields, one request per sample (`GenerationConfig.samples`: seeds seed, seed+1, ...).
    Their ids: `request_id` (the caller's, e.g. SGLang's `rid`) or a new one, `-i` appended per sample.
    Their params count as given the sampling fields the client set and the endpoint's `fields`."""
    try:
        cfg = GenerationConfig(**(_sampling(sampling) | fields))
    except ValidationError as e:
        raise validation_error(e, rename) from None
    rid = request_id or new_request_id(prefix)
    configs = cfg.samples()
    return [EngineRequest(prompt=prompt, params=c, request_id=rid if len(configs) == 1 else f"{rid}-{i}",
                          rename=dict(rename)) for i, c in enumerate(configs)]


# ---- reading results ------------------------------------------------------------------------
def on_request_meta(out: Result) -> dict[str, Any]:
    """The fields shown only when asked for (return_block_step_map, return_dllm_replay, a
    trajectory's return_entropy), under their carrier names."""
    fields = {"block_step_map": out.block_step_map, "dllm_replay_token_ids": out.dllm_replay_token_ids,
              "dllm_replay_step_maps": out.dllm_replay_step_maps, "dllm_stop_length": out.dllm_stop_length,
              "dllm_replay_canvases": out.dllm_replay_canvases, "entropy": out.entropy, "label_mass": out.label_mass,
              "nfe": out.nfe, "acceptance_lengths": out.acceptance_lengths}
    return {k: v for k, v in fields.items() if v is not None}


def weight_meta(out: Result) -> dict[str, Any]:
    """The weights behind a result: `weight_version`, the last version it ran under, and
    `weight_versions`, every version in order (more than one when an in-place pause and an update
    fell inside the request). A delta lists only the versions new since the previous delta, so the
    deltas concatenate to the whole list."""
    versions = out.weight_versions
    return {"weight_version": out.weight_version, "weight_versions": None if versions is None else list(versions)}


def top_rows(entry: Mapping[int, float], k: int) -> list[list]:
    """The top-k of one logprob entry ({chosen: v, top1: v, ...}) as [[value, id], ...], best first."""
    return [[v, t] for t, v in sorted(entry.items(), key=lambda kv: (-kv[1], kv[0]))[:k]]


def rows(pairs) -> list[list] | None:
    """(value, token_id) pairs as [[value, id], ...] (None stays None)."""
    return None if pairs is None else [[v, t] for v, t in pairs]


def dllm_steps(out: Result) -> dict[str, Any]:
    """Block diffusion: the request's denoising steps so far and its output tokens per step (both
    cumulative, so the last streamed delta carries the whole request's); {} for autoregressive models."""
    steps = out.num_steps
    if steps is None:
        return {}
    tokens = out.generate_token_len
    return {"dllm_num_steps": steps, "dllm_tokens_per_step": tokens / steps if steps else None}
