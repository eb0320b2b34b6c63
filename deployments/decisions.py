"""Typed decisions over HTTP: vLLM's names for them, and SGLang's `/v1/decisions`.

vLLM (0.34) names a typed read with its own fields, given at the top of a request body (OpenAI's
completions and chat, SGLang's flat /generate) or of SGLang's `sampling_params`, or inside
`vllm_xargs` / `extra_args` there. `vllm_body` maps them, in this one place for every endpoint, onto
the engine's `dllm_*` fields (`configs.generation_config.DecisionFields`); `VllmNames.errors` puts the
names the client wrote back into any refusal, so that a 400 names the field as it was given.

`/v1/decisions` is SGLang's route of that name (sglang 0.5.23, `serving_decisions.py`): each question
is rendered as SGLang renders it (its wording, the chat template, single-token labels A-Z, 0-9 or
yes/no) and answered by a one-slot read (`dllm_template: [-1]`, the labels' ids as the allowed set,
`dllm_read_only`), on autoregressive and diffusion models alike.
"""

from __future__ import annotations

import json
import math
import re
import string
import unicodedata
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Discriminator, Field, Tag, field_validator

from configs import GenerationConfig
from configs.limits import MAX_BATCH
from deployments.errors import ApiError
from deployments.generation import Strict
from deployments.wire import EngineRequest, Result, new_request_id

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


# ---- /v1/decisions: the request ------------------------------------------------------------------
PROMPT_FORMAT_VERSION = 1  # SGLang's version of the wording and labels below


def _blank(value: Any) -> bool:
    return not (value.strip() if isinstance(value, str) else value)


def _nonblank(value: Any) -> Any:
    if _blank(value):
        raise ValueError("must not be blank")
    return value


# text, or an object / array rendered into the prompt as compact JSON
DecisionText = str | dict[str, Any] | list[Any]
RequiredText = Annotated[DecisionText, AfterValidator(_nonblank)]
QuestionId = Annotated[str, AfterValidator(_nonblank)]


class DecisionOption(Strict):
    name: str
    description: DecisionText | None = None


class DecisionChoiceQuestion(Strict):
    """Options labelled A to Z; the answer names the likeliest (`choice`)."""

    id: QuestionId
    type: Literal["choice"]
    question: RequiredText
    options: list[DecisionOption] = Field(min_length=2, max_length=26)

    @field_validator("options")
    @classmethod
    def _distinct_names(cls, options: list[DecisionOption]) -> list[DecisionOption]:
        """Each option is one prompt line: names nonblank, on one line, distinct."""
        seen = set()
        for option in options:
            key = option.name.strip().casefold()
            if not key:
                raise ValueError("option names must be nonempty")
            if any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in option.name):
                raise ValueError(f"option name {option.name!r} must not contain control or line break characters")
            if key in seen:
                raise ValueError(f"option name {option.name!r} repeats another option")
            seen.add(key)
        return options


class DecisionScoreQuestion(Strict):
    """Levels labelled 0 to 9; the answer's `score` is the expected level."""

    id: QuestionId
    type: Literal["score"]
    question: RequiredText
    levels: list[RequiredText] = Field(min_length=2, max_length=10)


class DecisionYesNoQuestion(Strict):
    id: QuestionId
    type: Literal["yes_no"]
    question: RequiredText
    yes: DecisionText | None = None
    no: DecisionText | None = None


_KINDS = {"choice": "DecisionChoiceQuestion", "score": "DecisionScoreQuestion", "yes_no": "DecisionYesNoQuestion"}


def _kind(value: Any) -> str | None:
    """A question's union member, by its `type` (tagged by class name, so errors name the field path)."""
    return _KINDS.get(value.get("type") if isinstance(value, dict) else getattr(value, "type", None))


DecisionQuestion = Annotated[
    Annotated[DecisionChoiceQuestion, Tag("DecisionChoiceQuestion")]
    | Annotated[DecisionScoreQuestion, Tag("DecisionScoreQuestion")]
    | Annotated[DecisionYesNoQuestion, Tag("DecisionYesNoQuestion")],
    Discriminator(_kind, custom_error_type="invalid_question_type",
                  custom_error_message="type must be 'choice', 'score' or 'yes_no'")]


class DecisionRequest(Strict):
    """POST /v1/decisions (SGLang's request): questions about one input, each answered with its
    labels' probabilities. `temperature` scales those probabilities only (not label_mass)."""

    input: RequiredText
    questions: list[DecisionQuestion] = Field(min_length=1, max_length=MAX_BATCH)
    temperature: float = Field(1.0, gt=0.0)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    prompt_format_version: int | None = None
    return_prompt_token_ids: bool = False
    model: str | None = None
    images: list[Any] = Field(default_factory=list, description="not supported: must be empty")

    @field_validator("questions")
    @classmethod
    def _distinct_ids(cls, questions: list[Any]) -> list[Any]:
        seen = set()
        for question in questions:
            if question.id in seen:
                raise ValueError(f"question id {question.id!r} repeats another question")
            seen.add(question.id)
        return questions


# ---- /v1/decisions: rendering, as SGLang renders it ----------------------------------------------
@dataclass(frozen=True)
class QuestionView:
    """A question as rendered and answered: its kind, text, candidate names and their details."""

    kind: str
    question: Any
    names: list[str]
    details: list[Any]

    @classmethod
    def of(cls, q: DecisionChoiceQuestion | DecisionScoreQuestion | DecisionYesNoQuestion) -> QuestionView:
        if isinstance(q, DecisionChoiceQuestion):
            return cls("choice", q.question, [o.name for o in q.options], [o.description for o in q.options])
        if isinstance(q, DecisionScoreQuestion):
            return cls("score", q.question, [str(i) for i in range(len(q.levels))], list(q.levels))
        return cls("yes_no", q.question, ["yes", "no"], [q.yes, q.no])

    @property
    def labels(self) -> list[str]:
        """Its answer labels, in candidate order: A to Z, the level indices, or yes and no."""
        return list(string.ascii_uppercase[:len(self.names)]) if self.kind == "choice" else list(self.names)


def render_text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def render_question(text: str, view: QuestionView) -> str:
    """The user message of one question (SGLang's wording of PROMPT_FORMAT_VERSION)."""
    question = "" if _blank(view.question) else render_text(view.question)
    if view.kind == "yes_no":
        lines = [f"Is the following true? {question}" if question else "Is the following true?"]
        lines += [f"{label}: {render_text(d)}" for label, d in zip(view.labels, view.details) if render_text(d)]
        lines.append("Answer with yes or no only.")
    else:
        lines = [f"Question: {question}"] if question else []
        if view.kind == "choice":
            lines += [f"{label}: {name} - {render_text(d)}" if render_text(d) else f"{label}: {name}"
                      for label, name, d in zip(view.labels, view.names, view.details)]
            lines.append("Answer with the letter of one option only.")
        else:
            lines += [f"{label}: {render_text(level)}" for label, level in zip(view.labels, view.details)]
            lines.append("Answer with the number of one level only.")
    return "\n".join([text, "", *lines])


def reasoning_toggle(tokenizer: Any) -> str | None:
    """The chat template's switch for reasoning (Qwen3's `enable_thinking`), which decisions turn off."""
    template = getattr(tokenizer, "chat_template", None)
    return "enable_thinking" if isinstance(template, str) and "enable_thinking" in template else None


def label_ids(tokenizer: Any, prompt: str, prompt_ids: list[int], labels: list[str], param: str) -> list[int]:
    """Each label's one token after the rendered prompt, checked as SGLang checks it: the prompt's text
    after its last added token (or the whole prompt) plus the label tokenizes to that text's ids plus
    exactly one more, a different one for each label. Otherwise a 400 naming `param`."""
    added = {i: t for t, i in tokenizer.get_added_vocab().items()}
    text, text_ids = prompt, prompt_ids
    last = next((i for i in reversed(range(len(prompt_ids))) if prompt_ids[i] in added), None)
    if last is not None:
        start = prompt.rfind(added[prompt_ids[last]])
        suffix = prompt[start + len(added[prompt_ids[last]]):]
        if start >= 0 and tokenizer.encode(suffix, add_special_tokens=False) == prompt_ids[last + 1:]:
            text, text_ids = suffix, prompt_ids[last + 1:]
    out: list[int] = []
    for label in labels:
        ids = tokenizer.encode(text + label, add_special_tokens=False)
        if len(ids) != len(text_ids) + 1 or ids[:-1] != text_ids or ids[-1] in out:
            raise ApiError(f"{param}: the answer label {label!r} is not one distinct token after the chat prompt "
                           "for this model's tokenizer, so this model cannot answer this question type", param)
        out.append(ids[-1])
    return out


@dataclass(frozen=True)
class DecisionRead:
    """One question as a read: its view, prompt ids, its labels' ids, and the engine request."""

    id: str
    view: QuestionView
    prompt_ids: list[int]
    label_ids: list[int]
    request: EngineRequest


def _check(req: DecisionRequest, served_model: str, tokenizer: Any) -> dict[str, Any]:
    """Refuse what this server does not do; the chat template's kwargs (reasoning off by default)."""
    if req.model is not None and req.model != served_model:
        raise ApiError(f"model {req.model!r} is not served here; this server serves {served_model!r}",
                       "model", status=404, type="model_not_found")
    if req.images:
        raise ApiError("images are not supported: this server answers decisions about text only", "images")
    if req.prompt_format_version not in (None, PROMPT_FORMAT_VERSION):
        raise ApiError(f"prompt_format_version {req.prompt_format_version} is not served, this server uses "
                       f"version {PROMPT_FORMAT_VERSION}", "prompt_format_version")
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError("/v1/decisions renders the chat template, and this model's tokenizer has none", "input")
    toggle = reasoning_toggle(tokenizer)
    kwargs = {toggle: False} if toggle else {}
    if toggle in req.chat_template_kwargs and req.chat_template_kwargs[toggle] is not False:
        raise ApiError(f"chat_template_kwargs sets {toggle!r} to {req.chat_template_kwargs[toggle]!r}, but "
                       "decisions need it false or unset", "chat_template_kwargs")
    return kwargs | req.chat_template_kwargs


def decision_reads(req: DecisionRequest, served_model: str, tokenizer: Any) -> list[DecisionRead]:
    """Each question as a one-slot read of its labels after its rendered chat prompt."""
    kwargs = _check(req, served_model, tokenizer)
    text = render_text(req.input)
    reads = []
    for i, question in enumerate(req.questions):
        view = QuestionView.of(question)
        messages = [{"role": "user", "content": render_question(text, view)}]
        try:
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception as e:  # noqa: BLE001 - a template (or its kwargs) rejecting the input is the input's fault
            raise ApiError(f"the chat template failed: {type(e).__name__}: {e}", "chat_template_kwargs") from None
        ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        labels = label_ids(tokenizer, prompt, ids, view.labels, f"questions[{i}].type")
        params = GenerationConfig(max_new_tokens=1, dllm_template=[-1], dllm_allowed_token_ids=labels,
                                  dllm_read_only=True)
        request = EngineRequest(prompt=ids, params=params, request_id=new_request_id("decision"),
                                rename={"input_ids": "input", "prompt": "input", "max_new_tokens": "input"})
        reads.append(DecisionRead(question.id, view, ids, labels, request))
    return reads


# ---- /v1/decisions: the answer --------------------------------------------------------------------
def softmax(logprobs: list[float], temperature: float) -> list[float]:
    """Probabilities over the labels: softmax of their logprobs / temperature (the same whether the
    logprobs are over the vocabulary or renormalised over the labels: they differ by a constant)."""
    scaled = [v / temperature for v in logprobs]
    top = max(scaled)
    if top == -math.inf:  # no label has any mass: nothing to tell them apart
        return [1.0 / len(scaled)] * len(scaled)
    exps = [math.exp(v - top) for v in scaled]
    total = math.fsum(exps)
    return [e / total for e in exps]


def answer(read: DecisionRead, out: Result, temperature: float, with_ids: bool) -> dict[str, Any]:
    """SGLang's answer to one question from its read: the labels' probabilities by candidate name,
    `label_mass` (the labels' raw probability over the whole vocabulary), and for a choice the likeliest
    option's name, for a score the expected level."""
    entry = (out.logprobs or [{}])[0]
    mass = (out.label_mass or [None])[0]
    if out.finish_reason != "read" or any(i not in entry for i in read.label_ids) or mass is None:
        raise ApiError(f"the read of question {read.id!r} came back without its labels' logprobs and label_mass "
                       f"(finish_reason {out.finish_reason!r})", None, 500, "internal_error")
    probabilities = softmax([entry[i] for i in read.label_ids], temperature)
    body: dict[str, Any] = {"type": read.view.kind, "probabilities": dict(zip(read.view.names, probabilities)),
                            "label_mass": mass}
    if read.view.kind == "choice":
        body["choice"] = read.view.names[probabilities.index(max(probabilities))]
    elif read.view.kind == "score":
        body["score"] = math.fsum(i * p for i, p in enumerate(probabilities))
    if with_ids:
        body |= {"prompt_token_ids": read.prompt_ids, "label_token_ids": read.label_ids}
    return body


def decisions_response(req: DecisionRequest, reads: list[DecisionRead], outs: list[Result],
                       served_model: str) -> dict[str, Any]:
    """SGLang's DecisionResponse: every question's answer by its id, and the prompts' tokens as usage."""
    prompt_tokens = sum(o.input_token_len for o in outs)
    return {"object": "decisions", "model": served_model, "prompt_format_version": PROMPT_FORMAT_VERSION,
            "answers": {r.id: answer(r, o, req.temperature, req.return_prompt_token_ids)
                        for r, o in zip(reads, outs)},
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
                      "reasoning_tokens": 0}}
