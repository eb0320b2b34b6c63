"""Typed decisions over HTTP: SGLang's `/v1/decisions` (vLLM's names for typed reads in a request body
are `deployments.vllm_names`').

`/v1/decisions` is SGLang's route of that name (sglang 0.5.23, `serving_decisions.py`): each question
is rendered as SGLang renders it (its wording, the chat template, single-token labels A-Z, 0-9 or
yes/no) and answered by a one-slot read (`dllm_template: [-1]`, the labels' ids as the allowed set,
`dllm_read_only`), on autoregressive and diffusion models alike.
"""

from __future__ import annotations

import json
import math
import string
import unicodedata
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Discriminator, Field, Tag, field_validator

from configs import GenerationConfig
from configs.limits import MAX_BATCH
from deployments.errors import ApiError
from deployments.generation import Strict
from deployments.wire import EngineRequest, Result, new_request_id

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
