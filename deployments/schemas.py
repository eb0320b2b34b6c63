"""The HTTP / handle API's request models, their conversion to engine requests, and the response
builders (docs/api.md). Used by both the HTTP routes and the handle methods, so the two return
exactly the same JSON.

Engine results arrive as *result dicts*: `OutputChunk.to_dict()` (a streamed delta) or
`Response.to_dict()` (the folded unary result); the final one carries `matched` (what stopped the
request). Every builder here maps a result dict field by field and element by element, so building
each delta and concatenating (`merge_generate_deltas`) equals building the folded result.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import models_json_schema

from configs import GenerationConfig
from configs.generation_config import UnmaskingStrategy

MAX_STOP_STRINGS = 64  # stop strings per request (a longer list is a 400 naming `stop`)
MAX_STOP_STRING_CHARS = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_TOP_LOGPROBS = 100
MAX_N = 64  # samples per prompt (n)
MAX_BATCH = 1024  # prompts per request (a batch list)
MAX_SEED = 2**63 - 1
MAX_TOP_K = 2**31 - 1
# Temperatures in (0, SAMPLING_EPS) sample as greedy: dividing logits by them overflows float32
# (vLLM does the same). Repetition penalties outside [MIN, MAX] would overflow the logits too.
SAMPLING_EPS = 1e-5
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0

Prompt = str | list[int]


# ---- errors ----------------------------------------------------------------------------------
class ApiError(Exception):
    """An error the API reports as `{"error": {"message", "type", "param"}}` with an HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", retry_after_s: float | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type
        self.retry_after_s = retry_after_s  # a 429 / 503's own Retry-After (None: the server's default)

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param}}

    # Between EngineServer and ingress a refusal travels as an *error item*, a plain dict that no
    # result dict can be mistaken for (result dicts carry the carrier's own `error` field).
    def to_item(self) -> dict[str, Any]:
        return {"rejected": self.to_dict()["error"], "status": self.status, "retry_after_s": self.retry_after_s}

    @classmethod
    def from_item(cls, item: Mapping[str, Any]) -> ApiError:
        e = item["rejected"]
        return cls(e.get("message", ""), e.get("param"), item.get("status", 400),
                   e.get("type", "invalid_request_error"), item.get("retry_after_s"))


class ControlError(ApiError):
    """A refused RL control call: SGLang's `{"success": false, "message"}` beside the error object."""

    def to_dict(self) -> dict[str, Any]:
        return {"success": False, "message": self.message, **super().to_dict()}


def is_error_item(item: Mapping[str, Any]) -> bool:
    return "rejected" in item


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|constrained-\w+|list\[.*\]|dict\[.*\]|[A-Z]\w*)$")


def _loc(loc: tuple) -> str:
    """A pydantic error location as `field[0].sub`, without the tags pydantic adds for union members."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif out and _UNION_TAG.match(str(part)):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def validation_error(e: ValidationError, rename: Mapping[str, str] | None = None) -> ApiError:
    """A pydantic error as an ApiError naming the (first) offending top-level field."""
    rename = rename or {}
    errors = e.errors(include_url=False)
    first = next((err for err in errors if err.get("loc")), errors[0] if errors else None)
    if first is None:
        return ApiError(str(e))
    if not first.get("loc"):  # a model-level rule: name the first field its message mentions
        message = str(first.get("msg", e)).removeprefix("Value error, ")
        words = [w for w in re.findall(r"[a-z_]+", message) if w in _ENGINE_WORDS or w in rename]
        param = rename.get(words[0], _ENGINE_WORDS.get(words[0])) if words else None
        return ApiError(_rename_words(message, rename), param)
    field = str(first["loc"][0])
    param = rename.get(field, field)
    mine = [err for err in errors if err.get("loc") and str(err["loc"][0]) == field]
    # A union reports one error per member; when some are not plain type mismatches, those matter.
    specific = [err for err in mine if not err["type"].endswith("_type")]
    msgs: list[str] = []
    for err in specific or mine:
        if err["type"] == "extra_forbidden":
            entry = f"unknown field {param!r}: not part of this endpoint's request schema"
        else:
            msg = _rename_words(str(err["msg"]).removeprefix("Value error, "), rename)
            entry = f"{_loc((param, *err['loc'][1:]))}: {msg}"
        if entry not in msgs:
            msgs.append(entry)
    return ApiError(" or ".join(msgs[:4]), param)


_ENGINE_WORDS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "random_seed": "seed",
                 "stop_words": "stop"}


def _rename_words(message: str, rename: Mapping[str, str]) -> str:
    """Engine field names in a message -> the endpoint's names (`input_ids` too where the endpoint
    calls the token ids something else, e.g. `prompt` or `messages`)."""
    words = dict(_ENGINE_WORDS)
    if "input_ids" in rename:
        words["input_ids"] = rename["input_ids"]
    for old, new in words.items():
        message = re.sub(rf"\b{old}\b", rename.get(old, new), message)
    return message


def request_error(message: str, param: str | None, rename: Mapping[str, str]) -> ApiError:
    """An engine RequestError (engine field names) in the endpoint's own field names."""
    return ApiError(_rename_words(message, rename), rename.get(param, param) if param else param)


# ---- request models --------------------------------------------------------------------------
class _Strict(BaseModel):
    # strict: no coercion ("5" is not an int, 1 is not a bool); NaN / Infinity (which Python's json
    # accepts) are refused with the field's name.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _SamplingFields(_Strict):
    """Fields shared by every endpoint (HTTP names)."""

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
    # block diffusion, per request (None: the engine's setting; dllm_block_length, if given, must equal
    # the model's: 400 otherwise)
    dllm_unmasking_strategy: UnmaskingStrategy | None = None
    dllm_denoising_steps: int | None = Field(None, ge=1)
    dllm_confidence_threshold: float | None = Field(None, ge=0.0, le=1.0)
    dllm_entropy_threshold: float | None = Field(None, gt=0.0)
    dllm_block_length: int | None = Field(None, ge=1, description="must equal the model's block length")


class GenerateRequest(_SamplingFields):
    """POST /generate (flat body) and the handle methods `generate` / `generate_stream`."""

    prompt: str | None = None
    input_ids: list[int] | None = None
    max_tokens: int = Field(128, ge=0)
    n: int = Field(1, ge=1, le=MAX_N, description="samples per prompt (seeds seed, seed+1, ...)")
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    return_step_trace: bool = False
    return_block_step_map: bool = Field(False, description="block diffusion: meta_info.block_step_map")
    return_dllm_replay: bool = Field(False, description="block diffusion: the final block's replay in meta_info")


class SamplingParams(_SamplingFields):
    """SGLang's `sampling_params` object."""

    max_new_tokens: int = Field(128, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=MAX_N, description="samples per prompt (seeds seed, seed+1, ...)")
    no_stop_trim: bool = Field(False, description="keep the matched stop string in the text")
    frequency_penalty: float = Field(0.0, description="not supported: must be 0 (use repetition_penalty)")
    presence_penalty: float = Field(0.0, description="not supported: must be 0 (use repetition_penalty)")


_PerPrompt = Annotated[list[Any], Field(min_length=1)]


class NativeGenerateRequest(_Strict):
    """POST /generate in SGLang's native shape: `text` or `input_ids` (one prompt, or a batch list),
    `sampling_params`. Per-prompt fields may be lists, one entry per prompt."""

    text: str | Annotated[list[str], Field(min_length=1, max_length=MAX_BATCH)] | None = None
    input_ids: list[int] | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_BATCH)] | None = None
    sampling_params: SamplingParams | Annotated[list[SamplingParams], Field(min_length=1)] = Field(
        default_factory=SamplingParams)
    return_logprob: bool | Annotated[list[bool], Field(min_length=1)] = False
    logprob_start_len: Annotated[int, Field(ge=-1)] | Annotated[list[Annotated[int, Field(ge=-1)]],
                                                                  Field(min_length=1)] = -1
    top_logprobs_num: (Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
                       | Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]], Field(min_length=1)]) = 0
    stream: bool = False
    return_step_trace: bool = False
    return_block_step_map: bool = Field(False, description="block diffusion: meta_info.block_step_map")
    return_dllm_replay: bool = Field(False, description="block diffusion: the final block's replay in meta_info")


def _output_fields(req: GenerateRequest | NativeGenerateRequest | _OpenAIFields) -> dict[str, bool]:
    return dict(return_step_trace=getattr(req, "return_step_trace", False),
                return_block_step_map=req.return_block_step_map,
                return_dllm_replay=req.return_dllm_replay)


def is_native(body: Mapping[str, Any]) -> bool:
    """Whether a /generate body is SGLang's native shape rather than the flat one."""
    ids = body.get("input_ids")
    return "text" in body or "sampling_params" in body or (isinstance(ids, list) and any(
        isinstance(i, list) for i in ids))


class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAIFields(_SamplingFields):
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N, description="choices per prompt (seeds seed, seed+1, ...)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    min_tokens: int = Field(0, ge=0)
    return_block_step_map: bool = Field(False, description="block diffusion: `block_step_map` on each choice")
    return_dllm_replay: bool = Field(False, description="block diffusion: the final block's replay on each choice")


class CompletionRequest(_OpenAIFields):
    """POST /v1/completions: one prompt or a list of prompts, n choices each."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]
    name: str | None = None


class ChatCompletionRequest(_OpenAIFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


def _unencodable(value: Any, path: str, depth: int = 0) -> str | None:
    """The path of the first string that is not valid Unicode (JSON `\\ud800` escapes decode to lone
    surrogates, which no tokenizer accepts), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if depth > 64:  # deeper than any request model: validation refuses it anyway
        return None
    if isinstance(value, dict):
        items = [(f"{path}.{k}" if path else str(k), k, v) for k, v in value.items()]
    elif isinstance(value, list):
        items = [(f"{path}[{i}]", None, v) for i, v in enumerate(value)]
    else:
        return None
    for sub, key, item in items:
        if isinstance(key, str) and _unencodable(key, sub, depth + 1):
            return path or "body"
        found = _unencodable(item, sub, depth + 1)
        if found is not None:
            return found
    return None


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body (or a handle's dict) against a request model, or ApiError."""
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    bad = _unencodable(body, "")
    if bad is not None:
        field = None if bad == "body" else re.split(r"[.\[]", bad, maxsplit=1)[0]
        raise ApiError(f"{bad}: a string is not valid Unicode (it holds an unpaired surrogate escape)", field)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


# ---- conversion to engine requests -------------------------------------------------------
# GenerationConfig field -> HTTP field, for error messages (endpoints add their own entries).
HTTP_RENAME = {"max_new_tokens": "max_tokens", "random_seed": "seed", "stop_words": "stop",
               "min_new_tokens": "min_tokens", "do_sample": "temperature"}


DLLM_KNOBS = ("dllm_unmasking_strategy", "dllm_denoising_steps", "dllm_confidence_threshold",
              "dllm_entropy_threshold", "dllm_block_length")


def _sampling(req: _SamplingFields) -> dict[str, Any]:
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    sample = req.temperature >= SAMPLING_EPS
    return dict(
        do_sample=sample,
        temperature=req.temperature if sample else 1.0,
        top_p=req.top_p, top_k=max(req.top_k, 0), min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, random_seed=req.seed,
        stop_words=stop or None, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        **{f: getattr(req, f) for f in DLLM_KNOBS},
    )


def _config(fields: dict[str, Any], rename: Mapping[str, str]) -> GenerationConfig:
    try:
        return GenerationConfig(**fields)
    except ValidationError as e:
        raise validation_error(e, rename) from None


class EngineRequest(BaseModel):
    """What the ingress sends an EngineServer: plain data, pickles across processes."""

    prompt: str | list[int]
    params: dict[str, Any]
    request_id: str
    rename: dict[str, str] = Field(default_factory=dict)  # engine field -> this endpoint's field

    def generation_config(self) -> GenerationConfig:
        return GenerationConfig(**self.params)


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _engine_requests(prompt: Prompt, sampling: _SamplingFields, rename: Mapping[str, str], prefix: str = "req",
                     **fields: Any) -> list[EngineRequest]:
    """The engine requests of one prompt: the shared sampling fields plus the endpoint's own
    GenerationConfig fields, one request per sample (`GenerationConfig.samples`: seeds seed, seed+1, ...)."""
    cfg = _config(_sampling(sampling) | fields, rename)
    rid = new_request_id(prefix)
    configs = cfg.samples()
    return [EngineRequest(prompt=prompt, params=c.model_dump(), request_id=rid if len(configs) == 1 else f"{rid}-{i}",
                          rename=dict(rename)) for i, c in enumerate(configs)]


def _one_prompt(prompt: str | None, input_ids: list[int] | None) -> Prompt:
    if (prompt is None) == (input_ids is None):
        both = prompt is not None
        raise ApiError("give exactly one of prompt (text) or input_ids (token ids)" + (", not both" if both else ""),
                       "input_ids" if both else "prompt")
    return prompt if prompt is not None else input_ids


def _logprob_fields(return_logprob: bool, top_logprobs_num: int, logprob_start_len: int, name: str) -> dict:
    if top_logprobs_num > 0 and not return_logprob:
        raise ApiError(f"{name} > 0 needs return_logprob=true", name)
    return dict(logprobs=top_logprobs_num if return_logprob else None, logprob_start_len=logprob_start_len)


def generate_to_engine(req: GenerateRequest) -> list[EngineRequest]:
    """A flat /generate body as engine requests, one per sample."""
    prompt = _one_prompt(req.prompt, req.input_ids)
    rename = dict(HTTP_RENAME, logprobs="top_logprobs_num" if req.return_logprob else "return_logprob")
    return _engine_requests(prompt, req, rename, max_new_tokens=req.max_tokens, n=req.n,
                            **_output_fields(req), **_logprob_fields(req.return_logprob, req.top_logprobs_num,
                                                                     req.logprob_start_len, "top_logprobs_num"))


NATIVE_RENAME = {**{f: f"sampling_params.{f}" for f in _SamplingFields.model_fields},
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


def native_to_engine(req: NativeGenerateRequest) -> tuple[list[list[EngineRequest]], bool]:
    """SGLang's native body as engine requests: per prompt, its n samples. The bool says whether the
    answer is a list (a batch, or n > 1), as SGLang answers."""
    if (req.text is None) == (req.input_ids is None):
        raise ApiError("give exactly one of text or input_ids" + (", not both" if req.text is not None else ""),
                       "input_ids" if req.text is not None else "text")
    batch = isinstance(req.text, list) or (isinstance(req.input_ids, list) and isinstance(req.input_ids[0], list))
    prompts: list[Prompt] = (req.text if isinstance(req.text, list) else [req.text]) if req.text is not None else (
        req.input_ids if batch else [req.input_ids])
    count = len(prompts)
    columns = zip(prompts, _per_prompt(req.sampling_params, count, "sampling_params"),
                  _per_prompt(req.return_logprob, count, "return_logprob"),
                  _per_prompt(req.logprob_start_len, count, "logprob_start_len"),
                  _per_prompt(req.top_logprobs_num, count, "top_logprobs_num"))
    out = []
    for prompt, sp, return_logprob, start, top in columns:
        if sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0:
            name = "frequency_penalty" if sp.frequency_penalty != 0.0 else "presence_penalty"
            raise ApiError(f"sampling_params.{name} is not supported (use repetition_penalty); it must be 0",
                           f"sampling_params.{name}")
        rename = dict(NATIVE_RENAME, logprobs="top_logprobs_num" if return_logprob else "return_logprob")
        out.append(_engine_requests(
            prompt, sp, rename, max_new_tokens=sp.max_new_tokens, min_new_tokens=sp.min_new_tokens, n=sp.n,
            include_stop_str_in_output=sp.include_stop_str_in_output or sp.no_stop_trim, **_output_fields(req),
            **_logprob_fields(return_logprob, top, start, "top_logprobs_num")))
    if sum(len(s) for s in out) > MAX_BATCH:
        raise ApiError(f"at most {MAX_BATCH} generations per request (prompts x n)", "sampling_params")
    return out, batch or any(len(s) > 1 for s in out)


def generate_plan(body: Any) -> tuple[list[list[EngineRequest]], bool, bool]:
    """Any /generate body (flat or SGLang-native) as (engine requests per prompt, each prompt's samples;
    whether the answer is a list; whether it streams)."""
    if isinstance(body, dict) and is_native(body):
        req = parse(NativeGenerateRequest, body)
        groups, as_list = native_to_engine(req)
        return groups, as_list, req.stream
    flat = parse(GenerateRequest, body)
    return [generate_to_engine(flat)], flat.n > 1, flat.stream


def _check_openai(req: _OpenAIFields, served_model: str) -> None:
    if req.model is not None and req.model != served_model:
        raise ApiError(f"model {req.model!r} is not served here; this server serves {served_model!r}",
                       "model", status=404, type="model_not_found")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) != 0.0:
            raise ApiError(f"{name} is not supported (use repetition_penalty); it must be 0", name)
    if req.logit_bias:
        raise ApiError("logit_bias is not supported", "logit_bias")


@dataclass(frozen=True)
class Echo:
    """The prompt of one completion choice, shown before its text when `echo` is set."""

    text: str
    ids: list[int]


def completion_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[Prompt]:
    """OpenAI's `prompt`: text, token ids, or a list of either (one choice per prompt)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return list(prompt)
    return [prompt]


def completion_to_engine(req: CompletionRequest, served_model: str, tokenizer, is_dllm: bool
                         ) -> list[tuple[Echo | None, list[EngineRequest]]]:
    """Per prompt: what to echo (None without `echo`) and its n samples as engine requests.
    `echo` with `logprobs` (or max_tokens=0) scores the prompt (logprob_start_len=0), which only AR
    models can do; an echoed text prompt is tokenized here so its tokens can be listed."""
    _check_openai(req, served_model)
    if req.best_of not in (None, 1, req.n):
        raise ApiError("best_of is not supported (only best_of = n)", "best_of")
    if req.suffix is not None:
        raise ApiError("suffix is not supported", "suffix")
    prompts = completion_prompts(req.prompt)
    if len(prompts) * req.n > MAX_BATCH:
        raise ApiError(f"at most {MAX_BATCH} choices per request (prompts x n)", "prompt")
    score_prompt = req.echo and (req.logprobs is not None or req.max_tokens == 0)
    if score_prompt and is_dllm:
        raise ApiError("echo with logprobs or max_tokens=0 needs the prompt's token logprobs, which only "
                       "autoregressive models give; this model is a block-diffusion LM", "echo")
    rename = dict(HTTP_RENAME, logprobs="logprobs", input_ids="prompt", prompt="prompt", logprob_start_len="echo")
    fields = dict(max_new_tokens=req.max_tokens, min_new_tokens=req.min_tokens, logprobs=req.logprobs)
    if score_prompt:  # max_tokens=0 without logprobs: rows computed, not shown
        fields.update(logprob_start_len=0, logprobs=req.logprobs if req.logprobs is not None else 0)
    out = []
    for prompt in prompts:
        echo = None
        if req.echo:
            ids = list(tokenizer.encode(prompt, add_special_tokens=False)) if isinstance(prompt, str) else prompt
            text = prompt if isinstance(prompt, str) else tokenizer.decode(ids, clean_up_tokenization_spaces=False)
            echo, prompt = Echo(text, ids), ids if score_prompt else prompt
        out.append((echo, _engine_requests(prompt, req, rename, "cmpl", n=req.n, **fields, **_output_fields(req))))
    return out


def chat_to_engine(req: ChatCompletionRequest, served_model: str, tokenizer, max_model_len: int
                   ) -> list[EngineRequest]:
    """The n samples of a chat request. The messages are rendered with the tokenizer's chat template
    and tokenized here, so the default max_tokens (what is left of max_model_len) is known."""
    _check_openai(req, served_model)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError("top_logprobs needs logprobs=true", "top_logprobs")
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError("this model's tokenizer has no chat template; use /v1/completions", "messages")
    messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                 else "".join(p.text for p in m.content)} for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # a template that rejects these messages (e.g. role order)
        raise ApiError(f"the chat template rejected the messages: {e}", "messages") from None
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    rename = dict(HTTP_RENAME, input_ids="messages", prompt="messages",
                  logprobs="top_logprobs" if req.logprobs else "logprobs")
    if req.max_completion_tokens is not None:
        rename["max_new_tokens"] = "max_completion_tokens"
    max_tokens = req.max_completion_tokens or req.max_tokens or max(max_model_len - len(ids), 1)
    return _engine_requests(ids, req, rename, "chatcmpl", max_new_tokens=max_tokens, min_new_tokens=req.min_tokens,
                            n=req.n, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                            **_output_fields(req))


# ---- responses: /generate ----------------------------------------------------------------------
def finish_reason_json(out: Mapping[str, Any]) -> dict[str, Any] | None:
    reason = out.get("finish_reason")
    if reason is None:
        return None
    if reason == "stop":
        return {"type": "stop", "matched": out.get("matched")}
    if reason == "length":
        return {"type": "length", "length": out.get("generate_token_len", 0)}
    return {"type": reason, "message": out.get("error") or ("request aborted" if reason == "abort" else None)}


def _top_rows(entry: Mapping[int, float], k: int) -> list[list]:
    """The top-k of one logprob entry ({chosen: v, top1: v, ...}) as [[value, id], ...], best first."""
    return [[v, t] for t, v in sorted(entry.items(), key=lambda kv: (-kv[1], kv[0]))[:k]]


def _rows(pairs) -> list[list] | None:
    return None if pairs is None else [[v, t] for v, t in pairs]


# meta_info keys present only when asked for (return_block_step_map, return_dllm_replay)
ON_REQUEST_META = ("block_step_map", "dllm_replay_token_ids", "dllm_replay_step_maps", "dllm_stop_length")


def generate_body(out: Mapping[str, Any], req: GenerationConfig) -> dict[str, Any]:
    """The /generate JSON of one result dict (a delta or the whole result)."""
    logprobs = out.get("logprobs")
    k = req.logprobs or 0
    token_rows = top_rows = None
    if logprobs is not None:
        token_rows = [[next(iter(e.values())), next(iter(e))] for e in logprobs]
        top_rows = [_top_rows(e, k) for e in logprobs] if k > 0 else None
    input_top = out.get("input_top_logprobs")
    return {
        "text": out.get("text", ""),
        "output_ids": list(out.get("token_ids") or []),
        "meta_info": {
            "id": out.get("request_id"),
            "finish_reason": finish_reason_json(out),
            "prompt_tokens": out.get("input_token_len", 0),
            "completion_tokens": out.get("generate_token_len", 0),
            "output_token_logprobs": token_rows,
            "output_top_logprobs": top_rows,
            "input_token_logprobs": _rows(out.get("input_token_logprobs")),
            "input_top_logprobs": None if input_top is None else [_rows(r) for r in input_top],
            "step_map": None if out.get("step_map") is None else list(out["step_map"]),
            "step_trace": None if out.get("step_trace") is None else [dict(e) for e in out["step_trace"]],
            "weight_version": out.get("weight_version"),
            **dllm_steps(out),
            **{k: out[k] for k in ON_REQUEST_META if out.get(k) is not None},
        },
    }


def dllm_steps(out: Mapping[str, Any]) -> dict[str, Any]:
    """Block diffusion: the request's denoising steps so far and its output tokens per step (both
    cumulative, so the last streamed delta carries the whole request's); {} for autoregressive models."""
    steps = out.get("num_steps")
    if steps is None:
        return {}
    tokens = out.get("generate_token_len", 0)
    return {"dllm_num_steps": steps, "dllm_tokens_per_step": tokens / steps if steps else None}


def _cat(a: list | None, b: list | None) -> list | None:
    if a is None:
        return None if b is None else list(b)
    return a if b is None else a + list(b)


def merge_generate_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate streamed /generate deltas: text and lists concatenate (None stays None), scalars
    take the last value. The result equals the unary body."""
    body: dict[str, Any] = {"text": "", "output_ids": [], "meta_info": {}}
    for d in deltas:
        body["text"] += d["text"]
        body["output_ids"] += d["output_ids"]
        meta = body["meta_info"]
        for key, value in d["meta_info"].items():
            prev = meta.get(key)
            meta[key] = _cat(prev, value) if isinstance(value, list) or isinstance(prev, list) else value
    return body


# ---- responses: OpenAI ---------------------------------------------------------------------------
class ChoiceFormatter:
    """One OpenAI choice (completion or chat) from its result dicts; one instance per choice, so that
    streamed chunks carry running state (text offsets, the first chat chunk's role, the echo)."""

    def __init__(self, kind: Literal["completion", "chat"], index: int, logprobs: int | None,
                 token_text: Callable[[int], str], echo: Echo | None = None):
        self.kind, self.index, self.k, self.token_text = kind, index, logprobs, token_text
        self.echo = echo  # shown once, before the first text
        self.prompt_listed = False  # the echoed prompt's tokens are in the logprobs already
        self.offset = 0
        self.first = True

    def _tops(self, rows: list[list] | None) -> dict[str, float] | None:
        return None if rows is None else {self.token_text(t): v for v, t in rows}

    def _completion_logprobs(self, out: Mapping[str, Any]) -> dict[str, Any]:
        """OpenAI's completion logprobs; with echo the prompt's tokens come first (the first has no
        logprob: nothing precedes it)."""
        k = self.k or 0
        entries: list[tuple[int, float | None, dict[str, float] | None]] = []
        if self.echo is not None and out.get("input_token_logprobs") and not self.prompt_listed:
            self.prompt_listed = True
            rows = out["input_token_logprobs"]
            tops = out.get("input_top_logprobs") or [None] * len(rows)
            entries.append((self.echo.ids[0], None, None))
            entries += [(t, v, self._tops(_rows(top)) if k > 0 else None) for (v, t), top in zip(rows, tops)]
        for e in out.get("logprobs") or []:
            entries.append((next(iter(e)), next(iter(e.values())), self._tops(_top_rows(e, k)) if k > 0 else None))
        tokens, offsets = [], []
        for t, _, _ in entries:
            tokens.append(self.token_text(t))
            offsets.append(self.offset)
            self.offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [v for _, v, _ in entries],
                "top_logprobs": [top for _, _, top in entries] if k > 0 else None, "text_offset": offsets}

    def _chat_logprobs(self, out: Mapping[str, Any]) -> dict[str, Any]:
        def item(t: int, v: float) -> dict[str, Any]:
            s = self.token_text(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

        content = []
        for e in out["logprobs"]:
            entry = item(next(iter(e)), next(iter(e.values())))
            entry["top_logprobs"] = [item(t, v) for v, t in _top_rows(e, self.k or 0)]
            content.append(entry)
        return {"content": content}

    def choice(self, out: Mapping[str, Any], delta: bool) -> dict[str, Any]:
        text = out.get("text", "")
        if self.first and self.echo is not None:
            text = self.echo.text + text
        choice: dict[str, Any] = {"index": self.index}
        if self.kind == "completion":
            choice["text"] = text
        elif delta:
            choice["delta"] = {"role": "assistant", "content": text} if self.first else {"content": text}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        if self.k is None or out.get("logprobs") is None:
            choice["logprobs"] = None
        else:
            choice["logprobs"] = (self._completion_logprobs(out) if self.kind == "completion"
                                  else self._chat_logprobs(out))
        choice["finish_reason"] = out.get("finish_reason")
        choice["step_map"] = None if out.get("step_map") is None else list(out["step_map"])
        choice["weight_version"] = out.get("weight_version")
        choice.update(dllm_steps(out))
        choice.update({k: out[k] for k in ON_REQUEST_META if out.get(k) is not None})
        self.first = False
        return choice


class OpenAIFormatter:
    """OpenAI completion / chat JSON for the choices of one request (prompt-major: choice
    `i * n + j` is sample j of prompt i)."""

    def __init__(self, kind: Literal["completion", "chat"], model: str, request_id: str,
                 choices: list[ChoiceFormatter], n: int = 1, include_usage: bool = False):
        self.kind, self.model, self.id, self.choices, self.n = kind, model, request_id, choices, n
        self.include_usage = include_usage
        self.created = int(time.time())
        self.finals: dict[int, Mapping[str, Any]] = {}  # streamed: each choice's last delta

    def _usage(self, outs: Mapping[int, Mapping[str, Any]]) -> dict[str, int]:
        """Prompt tokens once per prompt, completion tokens over every choice."""
        p = sum(o.get("input_token_len", 0) for i, o in outs.items() if i % self.n == 0)
        c = sum(o.get("generate_token_len", 0) for o in outs.values())
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def full(self, outs: list[Mapping[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion" if self.kind == "completion" else "chat.completion",
                "created": self.created, "model": self.model,
                "choices": [f.choice(o, delta=False) for f, o in zip(self.choices, outs)],
                "usage": self._usage(dict(enumerate(outs)))}

    def chunks(self, index: int, out: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The stream chunks for one delta of choice `index` (none when it carries nothing OpenAI
        shows); the usage chunk follows the last choice's last delta when asked for."""
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        base = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        finished = out.get("finish_reason") is not None
        if finished:
            self.finals[index] = out
        if not (out.get("text") or out.get("token_ids") or out.get("input_token_logprobs") or finished):
            return []
        result = [dict(base, choices=[self.choices[index].choice(out, delta=True)])]
        if out.get("finish_reason") == "error":
            result.append({"error": {"message": out.get("error") or "the engine failed this request",
                                     "type": "internal_error", "param": None}})
        if self.include_usage:
            result[0]["usage"] = None
            if len(self.finals) == len(self.choices):
                result.append(dict(base, choices=[], usage=self._usage(self.finals)))
        return result


# ---- RL control requests (SGLang's payloads) ----------------------------------------------------------
class _Control(BaseModel):
    # Unknown fields are ignored, not refused: trainers written for SGLang send SGLang's own extras
    # (abort_all_requests, flush_cache, ...), and the same code must work here unchanged.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class EmptyControlRequest(_Control):
    """flush_cache, continue_generation: no fields."""


class UpdateWeightsFromDiskRequest(_Control):
    model_path: str
    weight_version: str | None = None


class UpdateWeightsFromTensorRequest(_Control):
    """Handle only: `named_tensors` are [[name, torch.Tensor], ...] (or SGLang's flattened_bucket payload
    with load_format="flattened_bucket"), carried by Ray. SGLang's HTTP `serialized_named_tensors`
    (pickles) are refused."""

    model_config = ConfigDict(extra="ignore", strict=False, arbitrary_types_allowed=True)

    named_tensors: Any = None
    serialized_named_tensors: Any = None
    weight_version: str | None = None
    load_format: str | None = None


class InitWeightsUpdateGroupRequest(_Control):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(1, ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["nccl", "gloo"] = "nccl"


class UpdateWeightsFromDistributedRequest(_Control):
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: str | None = None


class DestroyWeightsUpdateGroupRequest(_Control):
    group_name: str = "weight_update_group"


class PauseGenerationRequest(_Control):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class MemoryOccupationRequest(_Control):
    tags: list[str] | None = Field(None, description="weights, kv_cache (default: both)")


CONTROL_REQUESTS: dict[str, type[_Control]] = {
    "update_weights_from_disk": UpdateWeightsFromDiskRequest,
    "update_weights_from_tensor": UpdateWeightsFromTensorRequest,
    "init_weights_update_group": InitWeightsUpdateGroupRequest,
    "update_weights_from_distributed": UpdateWeightsFromDistributedRequest,
    "destroy_weights_update_group": DestroyWeightsUpdateGroupRequest,
    "flush_cache": EmptyControlRequest,
    "pause_generation": PauseGenerationRequest,
    "continue_generation": EmptyControlRequest,
    "release_memory_occupation": MemoryOccupationRequest,
    "resume_memory_occupation": MemoryOccupationRequest,
}


# ---- OpenAPI ----------------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None


class ErrorResponse(BaseModel):
    """Every refusal: HTTP 4xx (or 5xx when the server failed) with this body."""

    error: ErrorDetail


REQUEST_MODELS: tuple[type[BaseModel], ...] = (GenerateRequest, NativeGenerateRequest, CompletionRequest,
                                               ChatCompletionRequest)


def request_body(*models: type[BaseModel]) -> dict[str, Any]:
    """An OpenAPI requestBody (for a route's `openapi_extra`) whose schema is one of `models`. The
    routes validate the raw body with these same models themselves (after the API key and the body
    size limit, with the project's 400 error shape), so the documented schema is the enforced one."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}}}}


def request_components() -> dict[str, Any]:
    """JSON schemas of the request models (and what they nest), for the OpenAPI `components`."""
    _, top = models_json_schema([(m, "validation") for m in REQUEST_MODELS],
                                ref_template="#/components/schemas/{model}")
    return top.get("$defs", {})
