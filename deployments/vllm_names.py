"""vLLM's names for typed decisions in a request body.

vLLM (0.34) names a typed read with its own fields, given at the top of a request body (OpenAI's
completions and chat, SGLang's flat /generate) or of SGLang's `sampling_params`, or inside
`vllm_xargs` / `extra_args` there. `vllm_body` maps them, in this one place for every endpoint, onto
the engine's `dllm_*` fields (`configs.generation_config.DecisionFields`); `VllmNames.errors` puts the
names the client wrote back into any refusal, so that a 400 names the field as it was given.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from deployments.errors import ApiError

# ---- vLLM's names --------------------------------------------------------------------------------
# the objects vLLM passes its extra sampling fields in: vllm_xargs (its OpenAI server), extra_args
# (SamplingParams)
EXTRA_ARGS = ("vllm_xargs", "extra_args")
VLLM_NAMES = ("diffusion_seed_canvas", "diffusion_pinned", "diffusion_constrained", "logprob_token_ids",
              "diffusion_read_only", "diffusion_max_steps", "diffusion_canvas_length")
# a vLLM name -> the engine field it sets as it is
TWINS = {"diffusion_read_only": "dllm_read_only", "diffusion_max_steps": "dllm_max_steps",
         "diffusion_canvas_length": "dllm_canvas_length"}


@dataclass
class VllmNames:
    """What a body gave under vLLM's names: the engine field each name set, by the name (within its
    level: `diffusion_seed_canvas`, `vllm_xargs.diffusion_seed_canvas`) the client wrote it under."""

    given: dict[str, str] = field(default_factory=dict)

    def rename(self, e: ApiError) -> ApiError:
        """A refusal naming an engine field the client gave under a vLLM name, in the client's words."""
        if not self.given:
            return e
        words = re.compile(r"\b(" + "|".join(map(re.escape, self.given)) + r")\b")

        def swap(text: str) -> str:
            return words.sub(lambda m: self.given[m.group(1)], text)

        return ApiError(swap(e.message), e.param and swap(e.param), e.status, e.type, e.retry_after_s)

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Refusals raised inside, in the client's names (`rename`)."""
        try:
            yield
        except ApiError as e:
            raise self.rename(e) from None


def _gathered(level: Mapping[str, Any], where: str) -> dict[str, tuple[str, Any]]:
    """The vLLM fields of one level (top, or inside vllm_xargs / extra_args): name -> (the name as
    written within the level, value). The same name twice with different values is refused."""
    found = {name: (name, level[name]) for name in VLLM_NAMES if level.get(name) is not None}
    for box in EXTRA_ARGS:
        extra = level.get(box)
        if extra is None:
            continue
        if not isinstance(extra, dict):
            raise ApiError(f"{where}{box} must be an object of vLLM's extra sampling fields", where + box)
        for name, value in extra.items():
            path = f"{box}.{name}"
            if name not in VLLM_NAMES:
                raise ApiError(f"{where}{path} is not supported: {box} takes vLLM's typed-read fields "
                               f"({', '.join(VLLM_NAMES)})", where + path)
            if value is None:
                continue
            if name in found and found[name][1] != value:
                raise ApiError(f"{where}{found[name][0]} and {where}{path} disagree; give one of them", where + path)
            found[name] = (path, value)
    return found


def _template(found: dict[str, tuple[str, Any]], where: str) -> tuple[str, Any] | None:
    """vLLM's seed canvas (and pinned positions) as a dllm_template: (the name it came as, template)."""
    pinned = found.get("diffusion_pinned")
    if "diffusion_seed_canvas" not in found:
        if pinned is not None:
            raise ApiError(f"{where}{pinned[0]} names positions of diffusion_seed_canvas, which is not given",
                           where + pinned[0])
        return None
    path, seed = found["diffusion_seed_canvas"]
    if pinned is None or not isinstance(seed, list):  # the canvas as it is (a wrong one: refused as dllm_template)
        return path, seed
    keep = pinned[1]
    if not (isinstance(keep, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in keep)
            and all(0 <= i < len(seed) for i in keep)):
        raise ApiError(f"{where}{pinned[0]} must be a list of positions of diffusion_seed_canvas, each in "
                       f"[0, {len(seed)})", where + pinned[0])
    keep = set(keep)
    return path, [t if i in keep else -1 for i, t in enumerate(seed)]


def _allowed(found: dict[str, tuple[str, Any]], where: str) -> tuple[str, Any] | None:
    """vLLM's constrained read (`diffusion_constrained` over `logprob_token_ids`) as one allowed set."""
    constrained, ids = found.get("diffusion_constrained"), found.get("logprob_token_ids")
    if constrained is not None and not isinstance(constrained[1], bool):
        raise ApiError(f"{where}{constrained[0]}: must be true or false", where + constrained[0])
    if constrained is not None and constrained[1]:
        if ids is None:
            raise ApiError(f"{where}{constrained[0]} restricts each slot to logprob_token_ids, which is not "
                           "given: give the ids", where + constrained[0])
        return ids
    if ids is not None:
        raise ApiError(f"{where}{ids[0]} is taken only as the allowed set of a constrained read: set "
                       "diffusion_constrained: true (or give dllm_allowed_token_ids)", where + ids[0])
    return None


def _level(level: Mapping[str, Any], where: str, names: VllmNames) -> dict[str, Any]:
    """One level of a body with vLLM's fields replaced by the engine's (recorded in `names`)."""
    found = _gathered(level, where)
    out = {k: v for k, v in level.items() if k not in VLLM_NAMES and k not in EXTRA_ARGS}
    if not found:
        return out
    mapped = {"dllm_template": _template(found, where), "dllm_allowed_token_ids": _allowed(found, where),
              **{TWINS[name]: found[name] for name in TWINS if name in found}}
    for target, given in mapped.items():
        if given is None:
            continue
        path, value = given
        if out.get(target) is not None and out[target] != value:
            raise ApiError(f"{where}{path} and {where}{target} disagree; give one of them", where + path)
        out[target] = value
        names.given[target] = path
    return out


def vllm_body(body: Any, nested: str | None = None) -> tuple[Any, VllmNames]:
    """A request body with vLLM's typed-read fields as the engine's: at its top level, or (`nested`,
    SGLang's `sampling_params`) inside that object or each object of that list. vLLM's meaning:
    `diffusion_seed_canvas` is the template, and with `diffusion_pinned` only those positions keep its
    ids (the others are slots); `diffusion_constrained: true` makes `logprob_token_ids` every slot's
    allowed set; `diffusion_read_only` and `diffusion_max_steps` are `dllm_read_only` and
    `dllm_max_steps`. A name and its engine twin given with different values are refused."""
    names = VllmNames()
    if not isinstance(body, dict):
        return body, names
    if nested is None:
        return _level(body, "", names), names
    inner = body.get(nested)
    if isinstance(inner, dict):
        inner = _level(inner, f"{nested}.", names)
    elif isinstance(inner, list):
        inner = [_level(p, f"{nested}[{i}].", names) if isinstance(p, dict) else p for i, p in enumerate(inner)]
    return {**body, nested: inner} if nested in body else body, names


