"""SGLang's `/generate` request models: the flat body (also the handle methods' `generate` /
`generate_stream`) and SGLang's native shape (`text` | `input_ids`, `sampling_params`), with the one
table of every field name SGLang's `GenerateReqInput` and `SamplingParams` define (`SGLANG_FIELDS`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from configs.limits import MAX_BATCH, MAX_N, MAX_TOP_LOGPROBS
from configs.trajectory import DllmTrajectory
from deployments.errors import ApiError
from deployments.generation import SamplingFields, Strict


class GenerateRequest(SamplingFields):
    """POST /generate (flat body) and the handle methods `generate` / `generate_stream`."""

    model: str | None = Field(None, description="the model to answer: on an application of several models, the "
                              "one it is routed to; one model answers with its own (meta_info.ignored_model and "
                              "served_model say so when this names another)")
    prompt: str | None = None
    input_ids: list[int] | None = None
    max_tokens: int = Field(128, ge=0)
    n: int = Field(1, ge=1, le=MAX_N, description="samples per prompt (seeds seed, seed+1, ...)")
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    return_text_in_logprobs: bool = Field(False, description="each logprob row's third entry is the token's text")
    return_step_trace: bool = False
    return_block_step_map: bool = Field(False, description="block diffusion: meta_info.block_step_map")
    return_dllm_replay: bool = Field(False, description="block diffusion: the final block's replay in meta_info")
    dllm_trajectory: DllmTrajectory | None = Field(None, description="block diffusion: score this rollout "
                                                   "(max_tokens 0, return_logprob true)")


class SamplingParams(SamplingFields):
    """SGLang's `sampling_params` object (`sampling_seed` arrives here as `seed`)."""

    max_new_tokens: int = Field(128, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=MAX_N, description="samples per prompt (seeds seed, seed+1, ...)")
    no_stop_trim: bool = Field(False, description="keep the matched stop string in the text")
    frequency_penalty: float = Field(0.0, description="not supported: must be 0 (use repetition_penalty)")
    presence_penalty: float = Field(0.0, description="not supported: must be 0 (use repetition_penalty)")


class NativeGenerateRequest(Strict):
    """POST /generate in SGLang's native shape: `text` or `input_ids` (one prompt, or a batch list),
    `sampling_params`. Per-prompt fields may be lists, one entry per prompt. The top-level fields
    take SGLang's lax types ("5" for 5, "true" for true), as SGLang's own validation does."""

    model_config = ConfigDict(strict=False)

    text: str | Annotated[list[str], Field(min_length=1, max_length=MAX_BATCH)] | None = None
    input_ids: list[int] | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_BATCH)] | None = None
    sampling_params: SamplingParams | Annotated[list[SamplingParams], Field(min_length=1)] = Field(
        default_factory=SamplingParams)
    rid: str | Annotated[list[str], Field(min_length=1)] | None = Field(
        None, description="the request's id (a batch: a list, or a prefix for `rid_i`); /abort_request takes it")
    return_logprob: bool | Annotated[list[bool], Field(min_length=1)] = False
    logprob_start_len: Annotated[int, Field(ge=-1)] | Annotated[list[Annotated[int, Field(ge=-1)]],
                                                                  Field(min_length=1)] = -1
    top_logprobs_num: (Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
                       | Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]], Field(min_length=1)]) = 0
    return_text_in_logprobs: bool = Field(False, description="each logprob row's third entry is the token's text")
    stream: bool = False
    return_step_trace: bool = False
    return_block_step_map: bool = Field(False, description="block diffusion: meta_info.block_step_map")
    return_dllm_replay: bool = Field(False, description="block diffusion: the final block's replay in meta_info")
    dllm_trajectory: DllmTrajectory | Annotated[list[DllmTrajectory], Field(min_length=1)] | None = Field(
        None, description="block diffusion: score these rollouts (one per prompt; max_new_tokens 0, return_logprob "
        "true)")


class AbortRequest(Strict):
    """POST /abort_request: one request (its samples and batch entries too) by `rid`, or every one."""

    model_config = ConfigDict(extra="ignore", strict=False)

    rid: str = ""
    abort_all: bool = False


# ---- SGLang's field names ----------------------------------------------------------------------
@dataclass(frozen=True)
class SGLangField:
    """How this server takes one of SGLang's fields. `used`: validated by the request models above
    (under the name `to` where it differs); `ignored`: no effect on the answer here (routing, logging,
    bookkeeping), any value accepted; `unsupported`: a feature this engine lacks, accepted at
    `default` (or null, or an empty list / object) and a 400 naming the field otherwise."""

    use: Literal["used", "ignored", "unsupported"]
    default: Any = None
    to: str | None = None


USED, IGNORED = SGLangField("used"), SGLangField("ignored")
UNSET, OFF, ZERO = SGLangField("unsupported"), SGLangField("unsupported", False), SGLangField("unsupported", 0)

# Every field of SGLang's GenerateReqInput (python/sglang/srt/managers/io_struct.py) and, under
# `sampling_params.`, of its SamplingParams (python/sglang/srt/sampling/sampling_params.py), as of
# sglang 0.5.23 (PyPI) and its repository's head.
SGLANG_FIELDS: dict[str, SGLangField] = {
    # -- GenerateReqInput: what is generated and returned
    "text": USED, "input_ids": USED, "sampling_params": USED, "rid": USED, "stream": USED,
    "return_logprob": USED, "logprob_start_len": USED, "top_logprobs_num": USED, "return_text_in_logprobs": USED,
    # -- routing, sessions, logging and tracing: nothing to do on one engine
    "session_id": IGNORED, "log_metrics": IGNORED, "routed_dp_rank": IGNORED, "data_parallel_rank": IGNORED,
    "disagg_prefill_dp_rank": IGNORED, "kv_router_hint": IGNORED, "routing_key": IGNORED,
    "conversation_id": IGNORED, "http_worker_ipc": IGNORED, "background": IGNORED, "priority": IGNORED,
    "extra_key": IGNORED, "cache_salt": IGNORED, "kv_hints": IGNORED, "no_logs": IGNORED, "custom_labels": IGNORED,
    "external_trace_header": IGNORED, "received_time": IGNORED,
    # not GenerateReqInput's, but sglang-router forwards it with every request; it routes on an application of
    # several models, and a one-model application notes one it does not serve (deployments.sglang.serving)
    "model": IGNORED,
    # -- features this engine lacks: multimodal input, embeddings, LoRA, hidden states, disaggregation, ...
    "input_embeds": UNSET, "image_data": UNSET, "video_data": UNSET, "audio_data": UNSET, "mm_hashes": UNSET,
    "mm_content_hashes": UNSET, "use_audio_in_video": OFF, "video_config": UNSET, "modalities": UNSET,
    "token_ids_logprob": UNSET, "return_sampling_mask": OFF, "return_flat_raw_top_logprobs": OFF,
    "return_flat_raw_top_logprobs_b64": OFF, "return_hidden_states": OFF, "return_routed_experts": OFF,
    "routed_experts_start_len": ZERO, "return_indexer_topk": OFF, "session_params": UNSET, "lora_path": UNSET,
    "lora_id": UNSET, "custom_logit_processor": UNSET, "positional_embed_overrides": UNSET,
    "bootstrap_host": UNSET, "bootstrap_port": UNSET, "bootstrap_room": UNSET, "bootstrap_pair_key": UNSET,
    "decode_tp_size": UNSET, "require_reasoning": OFF, "max_thinking_tokens": UNSET, "return_bytes": OFF,
    "return_entropy": OFF, "return_prompt_token_ids": OFF, "need_wait_for_mm_inputs": UNSET,
    "num_items_assigned": UNSET, "encoder_urls": UNSET, "max_dynamic_patch": UNSET, "min_dynamic_patch": UNSET,
    "image_max_dynamic_patch": UNSET, "video_max_dynamic_patch": UNSET, "images_config": UNSET,
    "multi_item_delimiter_indices": UNSET, "watermark": UNSET, "sampling_logprobs_mode": UNSET,
    "return_flat_raw_output_top_logprobs": OFF, "mm_processor_kwargs": UNSET, "token_indices_to_pool": UNSET,
    # -- SamplingParams
    **{f"sampling_params.{name}": USED for name in (
        "max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
        "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "ignore_eos", "skip_special_tokens",
        "no_stop_trim")},
    "sampling_params.sampling_seed": SGLangField("used", to="seed"),
    # fast tokenizers never put spaces between special tokens; the stream's cadence is the engine's
    "sampling_params.spaces_between_special_tokens": IGNORED, "sampling_params.stream_interval": IGNORED,
    "sampling_params.custom_params": IGNORED,  # read only by a custom logit processor (unsupported)
    **{f"sampling_params.{name}": UNSET for name in (
        "stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "logit_bias", "watermark", "stop_strs",
        "stop_regex_strs")},
    "sampling_params.beam_width": SGLangField("unsupported", 1),  # beam search; 1 (or null) is none
    "sampling_params.ebnf_full_assistant": OFF,
    "sampling_params.stop_str_max_len": ZERO, "sampling_params.stop_regex_max_len": ZERO,
    "sampling_params.is_normalized": OFF,
}


def _unset(value: Any, default: Any) -> bool:
    """SGLang's "not asked for": the default, null, or empty (AReaL sends `image_data: []`), per prompt too."""
    if value is None or value == default or value in ([], {}):
        return True
    return isinstance(value, list) and all(_unset(v, default) for v in value)


def _fold(fields: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """One level of a native body as the request models take it: nulls and ignored fields dropped,
    unsupported ones checked, renamed ones renamed; names SGLang does not know are left for the
    model to refuse."""
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}  # the field each taken name came as
    for name, value in fields.items():
        spec = SGLANG_FIELDS.get(prefix + name)
        if value is None or (spec is not None and spec.use == "ignored"):
            continue
        if spec is not None and spec.use == "unsupported":
            if not _unset(value, spec.default):
                raise ApiError(f"{prefix}{name} is not supported by this server (it serves text generation "
                               f"without it); leave it unset", prefix + name)
            continue
        target = spec.to if spec is not None and spec.to else name
        if target in out and out[target] != value:
            raise ApiError(f"{prefix}{given_as[target]} and {prefix}{name} disagree; give one of them", prefix + name)
        out[target], given_as[target] = value, name
    return out


def sglang_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """A native /generate body with SGLang's conventions applied (see `SGLangField`), ready for
    NativeGenerateRequest."""
    out = _fold(body, "")
    sp = out.get("sampling_params")
    if isinstance(sp, dict):
        out["sampling_params"] = _fold(sp, "sampling_params.")
    elif isinstance(sp, list):
        out["sampling_params"] = [_fold(p, "sampling_params.") if isinstance(p, dict) else (p or {}) for p in sp]
    return out


def is_native(body: Mapping[str, Any]) -> bool:
    """Whether a /generate body is SGLang's native shape rather than the flat one: it has `text`,
    `sampling_params`, a batch of `input_ids`, or any other field only SGLang's body has (`model`
    is both shapes')."""
    ids = body.get("input_ids")
    if isinstance(ids, list) and any(isinstance(i, list) for i in ids):
        return True
    return any(name in SGLANG_FIELDS and name not in GenerateRequest.model_fields for name in body)
