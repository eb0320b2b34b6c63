"""The API's error: `ApiError` (an HTTP status and `{"error": {"message", "type", "param"}}`), the
`Rejection` it travels as from an EngineServer to the ingress, and the validation of a decoded JSON
body against a request model with errors that name the offending field in the endpoint's own words."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from deployments.wire import Rejection


class ApiError(Exception):
    """An error the API reports as `{"error": {"message", "type", "param"}}` with an HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", retry_after_s: float | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type
        self.retry_after_s = retry_after_s  # a 429 / 503's own Retry-After (None: the server's default)

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param}}

    # From an EngineServer to the ingress a refusal travels as a `Rejection` in place of the results.
    def to_rejection(self) -> Rejection:
        return Rejection(self.message, self.param, self.status, self.type, self.retry_after_s)

    @classmethod
    def from_rejection(cls, r: Rejection) -> ApiError:
        return cls(r.message, r.param, r.status, r.type, r.retry_after_s)


class ControlError(ApiError):
    """A refused RL control call: SGLang's `{"success": false, "message"}` beside the error object."""

    def to_dict(self) -> dict[str, Any]:
        return {"success": False, "message": self.message, **super().to_dict()}


def unavailable(message: str = "no engine replica is running") -> ApiError:
    """503: no engine replica can take the call (Serve replaces failed ones; a retry is the remedy)."""
    return ApiError(message, None, 503, "engine_unavailable")


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


def validation_error(e: ValidationError, rename: Mapping[str, str] | None = None,
                     nested: Collection[str] = ()) -> ApiError:
    """A pydantic error as an ApiError naming the (first) offending top-level field, or for a field of
    `nested` (an object of its own, e.g. SGLang's `sampling_params`) the path inside it
    (`sampling_params.max_new_tokens`, `sampling_params[1].top_p`)."""
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
    inside = field in nested and [err for err in mine if _loc(err["loc"]) != field]
    if inside:  # a wrong value inside the object: the union's other shapes (a list of them) do not fit either
        mine = inside
    # A union reports one error per member; when some are not plain type mismatches, those matter.
    specific = [err for err in mine if not err["type"].endswith("_type")]
    msgs: list[str] = []
    unknown = [_loc((param, *err["loc"][1:])) for err in specific if err["type"] == "extra_forbidden"]
    reported = specific or mine
    for err in reported:
        where = _loc((param, *err["loc"][1:]))
        if err["type"] == "extra_forbidden":
            entry = f"unknown field {where!r}: not part of this endpoint's request schema"
            if str(err["loc"][-1]) in _USE_INSTEAD:  # SGLang's sampling_params name, given at the top level
                entry += f"; use {_USE_INSTEAD[str(err['loc'][-1])]}"
        else:
            msg = _rename_words(str(err["msg"]).removeprefix("Value error, "), rename)
            entry = f"{where}: {msg}"
        if entry not in msgs:
            msgs.append(entry)
    if unknown and len(unknown) == len(specific):  # only unknown names, maybe inside the field: name them
        param = unknown[0]
    elif inside:
        param = _loc((param, *reported[0]["loc"][1:]))
    return ApiError(" or ".join(msgs[:4]), param)


_USE_INSTEAD = {"max_new_tokens": "max_tokens"}
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


def parse(model: type[BaseModel], body: Any, nested: Collection[str] = ()) -> Any:
    """Validate a decoded JSON body (or a handle's dict) against a request model, or ApiError (naming
    the path inside the fields of `nested`: `validation_error`)."""
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    bad = _unencodable(body, "")
    if bad is not None:
        field = None if bad == "body" else re.split(r"[.\[]", bad, maxsplit=1)[0]
        raise ApiError(f"{bad}: a string is not valid Unicode (it holds an unpaired surrogate escape)", field)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e, nested=nested) from None
