"""SGLang's `/generate`: a body (flat or native) as engine requests, and the engine's results as its JSON."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from configs import GenerationConfig
from configs.limits import MAX_BATCH
from deployments.errors import ApiError, parse
from deployments.generation import (
    HTTP_RENAME,
    SamplingFields,
    dllm_steps,
    engine_requests,
    logprob_fields,
    on_request_meta,
    output_fields,
    top_rows,
    weight_meta,
)
from deployments.sglang.protocol import GenerateRequest, NativeGenerateRequest, is_native, sglang_body
from deployments.wire import EngineRequest, Prompt, Result


# ---- requests -------------------------------------------------------------------------------
def _one_prompt(prompt: str | None, input_ids: list[int] | None) -> Prompt:
    if (prompt is None) == (input_ids is None):
        both = prompt is not None
        raise ApiError("give exactly one of prompt (text) or input_ids (token ids)" + (", not both" if both else ""),
                       "input_ids" if both else "prompt")
    return prompt if prompt is not None else input_ids


def generate_to_engine(req: GenerateRequest) -> list[EngineRequest]:
    """A flat /generate body as engine requests, one per sample."""
    prompt = _one_prompt(req.prompt, req.input_ids)
    rename = dict(HTTP_RENAME, logprobs="top_logprobs_num" if req.return_logprob else "return_logprob")
    return engine_requests(prompt, req, rename, max_new_tokens=req.max_tokens, n=req.n,
                           dllm_trajectory=req.dllm_trajectory, **output_fields(req),
                           **logprob_fields(req.return_logprob, req.top_logprobs_num, req.logprob_start_len,
                                            "top_logprobs_num"))


NATIVE_RENAME = {**{f: f"sampling_params.{f}" for f in SamplingFields.model_fields},
                 **{k: f"sampling_params.{v}" for k, v in HTTP_RENAME.items()},
                 "max_new_tokens": "sampling_params.max_new_tokens", "min_new_tokens": "sampling_params.min_new_tokens",
                 "prompt": "text"}


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    """A per-prompt field: one value for every prompt, or a list with one entry per prompt."""
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise ApiError(f"{name} has {len(value)} entries but the request has {count} prompts", name)
    return value


def _request_ids(rid: str | list[str] | None, count: int, batch: bool) -> list[str | None]:
    """SGLang's `rid` per prompt: one prompt takes it as is; a batch takes a list (one per prompt) or
    uses a string as the prefix of `rid_i`."""
    if rid is None:
        return [None] * count
    if isinstance(rid, list):
        return _per_prompt(rid, count, "rid")
    return [f"{rid}_{i}" for i in range(count)] if batch else [rid]


def native_to_engine(req: NativeGenerateRequest) -> tuple[list[list[EngineRequest]], bool]:
    """SGLang's native body as engine requests: per prompt, its n samples. The bool says whether the
    answer is a list (a batch, or n > 1), as SGLang answers."""
    if (req.text is None) == (req.input_ids is None):
        raise ApiError("give exactly one of text or input_ids" + (", not both" if req.text is not None else ""),
                       "input_ids" if req.text is not None else "text")
    if req.input_ids == []:
        raise ApiError("input_ids is empty: give at least one token id", "input_ids")
    batch = isinstance(req.text if req.text is not None else req.input_ids[0], list)
    prompts: list[Prompt] = (req.text if isinstance(req.text, list) else [req.text]) if req.text is not None else (
        req.input_ids if batch else [req.input_ids])
    count = len(prompts)
    columns = zip(prompts, _per_prompt(req.sampling_params, count, "sampling_params"),
                  _per_prompt(req.return_logprob, count, "return_logprob"),
                  _per_prompt(req.logprob_start_len, count, "logprob_start_len"),
                  _per_prompt(req.top_logprobs_num, count, "top_logprobs_num"),
                  _request_ids(req.rid, count, batch), _per_prompt(req.dllm_trajectory, count, "dllm_trajectory"))
    out = []
    for prompt, sp, return_logprob, start, top, rid, trajectory in columns:
        if sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0:
            name = "frequency_penalty" if sp.frequency_penalty != 0.0 else "presence_penalty"
            raise ApiError(f"sampling_params.{name} is not supported (use repetition_penalty); it must be 0",
                           f"sampling_params.{name}")
        rename = dict(NATIVE_RENAME, logprobs="top_logprobs_num" if return_logprob else "return_logprob")
        out.append(engine_requests(
            prompt, sp, rename, request_id=rid, max_new_tokens=sp.max_new_tokens, min_new_tokens=sp.min_new_tokens,
            n=sp.n, include_stop_str_in_output=sp.include_stop_str_in_output or sp.no_stop_trim,
            dllm_trajectory=trajectory, **output_fields(req),
            **logprob_fields(return_logprob, top, start, "top_logprobs_num")))
    if sum(len(s) for s in out) > MAX_BATCH:
        raise ApiError(f"at most {MAX_BATCH} generations per request (prompts x n)", "sampling_params")
    return out, batch or any(len(s) > 1 for s in out)


@dataclass(frozen=True)
class GeneratePlan:
    """A /generate body as engine requests: per prompt, its samples; whether the answer is a list
    (a batch, or n > 1); whether it streams; whether logprob rows carry the token's text; what every
    answer's `meta_info` adds (`model_note`)."""

    groups: list[list[EngineRequest]]
    as_list: bool
    stream: bool
    text_in_logprobs: bool
    meta: dict[str, str] = field(default_factory=dict)


# Fields of the /generate bodies whose schema errors name the path inside them (`sampling_params.n`)
NATIVE_NESTED = ("sampling_params", "dllm_trajectory")
FLAT_NESTED = ("dllm_trajectory",)


def model_note(named: Any, query_model: str | None, served_model: str | None) -> dict[str, str]:
    """What `meta_info` says when a request names a model other than the one that serves it. Like
    SGLang's /generate, which has no use for `model`, this ingress answers with its own model; the
    note says so: `ignored_model` (the name given: the body's `model`, else `?model=`) and
    `served_model`. An application of several models routes by that name before it gets here, so
    there the name is always the served one."""
    name = named if isinstance(named, str) and named else query_model
    if not name or served_model is None or name == served_model:
        return {}
    return {"ignored_model": name, "served_model": served_model}


def generate_plan(body: Any, served_model: str | None = None, query_model: str | None = None) -> GeneratePlan:
    """Any /generate body, flat or SGLang-native; `served_model` (the served model's name) and
    `query_model` (the request's `?model=`) for the answer's `model_note`."""
    if isinstance(body, dict) and is_native(body):
        req = parse(NativeGenerateRequest, sglang_body(body), nested=NATIVE_NESTED)
        groups, as_list = native_to_engine(req)
        return GeneratePlan(groups, as_list, req.stream, req.return_text_in_logprobs,
                            model_note(body.get("model"), query_model, served_model))
    flat = parse(GenerateRequest, body, nested=FLAT_NESTED)
    return GeneratePlan([generate_to_engine(flat)], flat.n > 1, flat.stream, flat.return_text_in_logprobs,
                        model_note(flat.model, query_model, served_model))


# ---- responses ------------------------------------------------------------------------------
def finish_reason_json(out: Result) -> dict[str, Any] | None:
    reason = out.finish_reason
    if reason is None:
        return None
    if reason == "stop":
        return {"type": "stop", "matched": out.matched}
    if reason == "length":
        return {"type": "length", "length": out.generate_token_len}
    if reason == "read":  # a typed read: its template's positions are the output
        return {"type": "read"}
    return {"type": reason, "message": out.error or ("request aborted" if reason == "abort" else None)}


TokenTextFn = Callable[[int], str]


def _triples(pairs, token_text: TokenTextFn | None) -> list[list] | None:
    """(value, token_id) pairs as SGLang's rows `[logprob, token_id, text | null]` (None stays None)."""
    if pairs is None:
        return None
    return [[v, t, None if token_text is None else token_text(t)] for v, t in pairs]


def generate_body(out: Result, req: GenerationConfig, token_text: TokenTextFn | None = None,
                  meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The /generate JSON of one result (a delta or the whole). Logprob rows are SGLang's
    `[logprob, token_id, text]`, the text only when `token_text` is given (return_text_in_logprobs).
    `meta`: what the request's every answer adds to `meta_info` (`GeneratePlan.meta`)."""
    logprobs = out.logprobs
    k = req.logprobs or 0
    token_rows = tops = None
    if logprobs is not None:
        token_rows = _triples([(next(iter(e.values())), next(iter(e))) for e in logprobs], token_text)
        tops = [_triples(top_rows(e, k), token_text) for e in logprobs] if k > 0 else None
    input_top = out.input_top_logprobs
    return {
        "text": out.text,
        "output_ids": list(out.token_ids),
        "meta_info": {
            "id": out.request_id,
            "finish_reason": finish_reason_json(out),
            "prompt_tokens": out.input_token_len,
            "completion_tokens": out.generate_token_len,
            "output_token_logprobs": token_rows,
            "output_top_logprobs": tops,
            "input_token_logprobs": _triples(out.input_token_logprobs, token_text),
            "input_top_logprobs": None if input_top is None else [_triples(r, token_text) for r in input_top],
            "step_map": None if out.step_map is None else list(out.step_map),
            "step_trace": None if out.step_trace is None else [dict(e) for e in out.step_trace],
            **weight_meta(out),
            **dllm_steps(out),
            **on_request_meta(out),
            **(meta or {}),
        },
    }


def _cat(a: list | None, b: list | None) -> list | None:
    if a is None:
        return None if b is None else list(b)
    return a if b is None else a + list(b)


def _add(body: dict[str, Any], delta: Mapping[str, Any]) -> None:
    body["text"] += delta["text"]
    body["output_ids"] += delta["output_ids"]
    meta = body["meta_info"]
    for key, value in delta["meta_info"].items():
        prev = meta.get(key)
        meta[key] = _cat(prev, value) if isinstance(value, list) or isinstance(prev, list) else value


def merge_generate_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate streamed /generate deltas (`incremental_streaming_output`): text and lists
    concatenate (None stays None), scalars take the last value. The result equals the unary body."""
    body: dict[str, Any] = {"text": "", "output_ids": [], "meta_info": {}}
    for d in deltas:
        _add(body, d)
    return body


class CumulativeStream:
    """SGLang's default stream: each chunk is the request's body so far (the whole text, output_ids,
    step_map and logprob rows), except `step_trace`, which holds the events since the previous chunk.
    The last chunk equals the unary body but for the step trace."""

    def __init__(self) -> None:
        self.body: dict[str, Any] = {"text": "", "output_ids": [], "meta_info": {}}

    def chunk(self, delta: dict[str, Any]) -> dict[str, Any]:
        trace = delta["meta_info"].get("step_trace")
        _add(self.body, {**delta, "meta_info": {k: v for k, v in delta["meta_info"].items() if k != "step_trace"}})
        out = copy.deepcopy(self.body)
        out["meta_info"]["step_trace"] = trace
        return out


def fold_cumulative_chunks(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A cumulative stream's chunks (one request's) as the unary body: the last chunk, with the
    step-trace events of every chunk."""
    body = copy.deepcopy(chunks[-1])
    traces = [c["meta_info"].get("step_trace") for c in chunks]
    body["meta_info"]["step_trace"] = None if all(t is None for t in traces) else [e for t in traces for e in t or []]
    return body
