"""The HTTP / handle API's request models, their conversion to engine requests, and the response
builders (CONTRACT.md §5). Used by both the HTTP routes and the handle methods, so the two return
exactly the same JSON.

Engine results arrive as *result dicts*: `OutputChunk.to_dict()` (a streamed delta) or
`Response.to_dict()` (the folded unary result), plus `"matched"` (what stopped the request) on the
final one. Every builder here maps a result dict field by field and element by element, so building
each delta and concatenating (`merge_generate_deltas`) equals building the folded result.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from configs import GenerationConfig

MAX_STOP_STRINGS = 64  # stop strings per request (a longer list is a 400 naming `stop`)
MAX_STOP_STRING_CHARS = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_TOP_LOGPROBS = 100
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
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param}}

    # Between EngineServer and ingress a refusal travels as an *error item*, a plain dict that no
    # result dict can be mistaken for (result dicts carry the carrier's own `error` field).
    def to_item(self) -> dict[str, Any]:
        return {"rejected": self.to_dict()["error"], "status": self.status}

    @classmethod
    def from_item(cls, item: Mapping[str, Any]) -> ApiError:
        e = item["rejected"]
        return cls(e.get("message", ""), e.get("param"), item.get("status", 400),
                   e.get("type", "invalid_request_error"))


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


class GenerateRequest(_SamplingFields):
    """POST /generate and the handle methods `generate` / `generate_stream`."""

    prompt: str | None = None
    input_ids: list[int] | None = None
    max_tokens: int = Field(128, ge=0)
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    return_step_trace: bool = False


class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAIFields(_SamplingFields):
    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    min_tokens: int = Field(0, ge=0)


class CompletionRequest(_OpenAIFields):
    """POST /v1/completions (one prompt; n=1)."""

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
    """POST /v1/chat/completions (n=1)."""

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


def generate_to_engine(req: GenerateRequest, request_id: str | None = None) -> EngineRequest:
    if (req.prompt is None) == (req.input_ids is None):
        both = req.prompt is not None
        raise ApiError("give exactly one of prompt (text) or input_ids (token ids)" + (", not both" if both else ""),
                       "input_ids" if both else "prompt")
    if req.top_logprobs_num > 0 and not req.return_logprob:
        raise ApiError("top_logprobs_num > 0 needs return_logprob=true", "top_logprobs_num")
    rename = dict(HTTP_RENAME, logprobs="top_logprobs_num" if req.return_logprob else "return_logprob")
    fields = _sampling(req)
    fields.update(max_new_tokens=req.max_tokens, logprob_start_len=req.logprob_start_len,
                  logprobs=req.top_logprobs_num if req.return_logprob else None,
                  return_step_trace=req.return_step_trace)
    cfg = _config(fields, rename)
    prompt: Prompt = req.prompt if req.prompt is not None else req.input_ids
    return EngineRequest(prompt=prompt, params=cfg.model_dump(), request_id=request_id or new_request_id(),
                         rename=rename)


def _check_openai(req: _OpenAIFields, served_model: str) -> None:
    if req.model is not None and req.model != served_model:
        raise ApiError(f"model {req.model!r} is not served here; this server serves {served_model!r}",
                       "model", status=404, type="model_not_found")
    if req.n != 1:
        raise ApiError("only n=1 is supported", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) != 0.0:
            raise ApiError(f"{name} is not supported (use repetition_penalty); it must be 0", name)
    if req.logit_bias:
        raise ApiError("logit_bias is not supported", "logit_bias")


def completion_to_engine(req: CompletionRequest, served_model: str, request_id: str | None = None) -> EngineRequest:
    _check_openai(req, served_model)
    if req.echo:
        raise ApiError("echo is not supported", "echo")
    if req.best_of not in (None, 1):
        raise ApiError("best_of is not supported (only 1)", "best_of")
    if req.suffix is not None:
        raise ApiError("suffix is not supported", "suffix")
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError("only one prompt per request is supported (n=1, no batches)", "prompt")
        prompt = prompt[0]
    rename = dict(HTTP_RENAME, logprobs="logprobs", input_ids="prompt", prompt="prompt")
    fields = _sampling(req)
    fields.update(max_new_tokens=req.max_tokens, min_new_tokens=req.min_tokens, logprobs=req.logprobs)
    cfg = _config(fields, rename)
    return EngineRequest(prompt=prompt, params=cfg.model_dump(), request_id=request_id or new_request_id("cmpl"),
                         rename=rename)


def chat_to_engine(req: ChatCompletionRequest, served_model: str, tokenizer, max_model_len: int,
                   request_id: str | None = None) -> EngineRequest:
    """Render the messages with the tokenizer's chat template and tokenize them here, so the
    default max_tokens (what is left of max_model_len) is known."""
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
    fields = _sampling(req)
    fields.update(max_new_tokens=max_tokens, min_new_tokens=req.min_tokens,
                  logprobs=(req.top_logprobs or 0) if req.logprobs else None)
    cfg = _config(fields, rename)
    return EngineRequest(prompt=ids, params=cfg.model_dump(), request_id=request_id or new_request_id("chatcmpl"),
                         rename=rename)


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
        },
    }


def _cat(a: list | None, b: list | None) -> list | None:
    if a is None:
        return None if b is None else list(b)
    return a if b is None else a + list(b)


def merge_generate_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate streamed /generate deltas: text and lists concatenate (None stays None), scalars
    take the last value. The result equals the unary body (CONTRACT.md §5)."""
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
class OpenAIFormatter:
    """Builds OpenAI completion / chat JSON from result dicts; one instance per request so that the
    streamed chunks carry running state (text offsets, the first chat chunk's role)."""

    def __init__(self, kind: Literal["completion", "chat"], model: str, request_id: str,
                 params: GenerationConfig, token_text: Callable[[int], str], include_usage: bool = False):
        self.kind, self.model, self.id, self.params = kind, model, request_id, params
        self.token_text = token_text
        self.include_usage = include_usage
        self.created = int(time.time())
        self.offset = 0
        self.first = True

    # logprobs in the two OpenAI shapes
    def _completion_logprobs(self, logprobs: list[dict[int, float]]) -> dict[str, Any]:
        k = self.params.logprobs or 0
        tokens, values, tops, offsets = [], [], [], []
        for e in logprobs:
            tok, val = next(iter(e)), next(iter(e.values()))
            s = self.token_text(tok)
            tokens.append(s)
            values.append(val)
            tops.append({self.token_text(t): v for v, t in _top_rows(e, k)} if k > 0 else None)
            offsets.append(self.offset)
            self.offset += len(s)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops if k > 0 else None,
                "text_offset": offsets}

    def _chat_logprobs(self, logprobs: list[dict[int, float]]) -> dict[str, Any]:
        k = self.params.logprobs or 0

        def item(t: int, v: float) -> dict[str, Any]:
            s = self.token_text(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

        content = []
        for e in logprobs:
            entry = item(next(iter(e)), next(iter(e.values())))
            entry["top_logprobs"] = [item(t, v) for v, t in _top_rows(e, k)]
            content.append(entry)
        return {"content": content}

    def _logprobs(self, out: Mapping[str, Any]) -> dict[str, Any] | None:
        lp = out.get("logprobs")
        if lp is None:
            return None
        return self._completion_logprobs(lp) if self.kind == "completion" else self._chat_logprobs(lp)

    def _usage(self, out: Mapping[str, Any]) -> dict[str, int]:
        p, c = out.get("input_token_len", 0), out.get("generate_token_len", 0)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _choice(self, out: Mapping[str, Any], delta: bool) -> dict[str, Any]:
        text = out.get("text", "")
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "completion":
            choice["text"] = text
        elif delta:
            choice["delta"] = {"role": "assistant", "content": text} if self.first else {"content": text}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = self._logprobs(out)
        choice["finish_reason"] = out.get("finish_reason")
        choice["step_map"] = None if out.get("step_map") is None else list(out["step_map"])
        self.first = False
        return choice

    def full(self, out: Mapping[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion" if self.kind == "completion" else "chat.completion",
                "created": self.created, "model": self.model, "choices": [self._choice(out, delta=False)],
                "usage": self._usage(out)}

    def chunks(self, out: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The stream chunks for one delta (none when it carries nothing OpenAI shows)."""
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        base = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        finished = out.get("finish_reason") is not None
        if not (out.get("text") or out.get("token_ids") or finished):
            return []
        result = [dict(base, choices=[self._choice(out, delta=True)])]
        if out.get("finish_reason") == "error":
            result.append({"error": {"message": out.get("error") or "the engine failed this request",
                                     "type": "internal_error", "param": None}})
        if self.include_usage:
            result[0]["usage"] = None
            if finished:
                result.append(dict(base, choices=[], usage=self._usage(out)))
        return result
