"""OpenAI's completions and chat: requests as engine requests (echo, chat templates, list prompts),
and the engine's results as OpenAI's JSON and stream chunks."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from configs.limits import MAX_BATCH
from deployments.errors import ApiError
from deployments.generation import (
    HTTP_RENAME,
    dllm_steps,
    engine_requests,
    on_request_meta,
    output_fields,
    rows,
    top_rows,
    weight_meta,
)
from deployments.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIFields
from deployments.wire import EngineRequest, Prompt, Result


# ---- requests -------------------------------------------------------------------------------
def _check_openai(req: OpenAIFields, served_model: str) -> None:
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


def _decode(tokenizer, ids: list[int]) -> str:
    """An echoed token-id prompt's text; ids the tokenizer cannot take are the prompt's fault."""
    if any(not 0 <= i < len(tokenizer) for i in ids):
        raise ApiError(f"prompt holds token ids outside the vocabulary [0, {len(tokenizer)})", "prompt")
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False)


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
                       "autoregressive models give; this model is not autoregressive (it decodes by block "
                       "diffusion or by renoising a canvas)", "echo")
    rename = dict(HTTP_RENAME, logprobs="logprobs", input_ids="prompt", prompt="prompt", logprob_start_len="echo")
    fields = dict(max_new_tokens=req.max_tokens, min_new_tokens=req.min_tokens, logprobs=req.logprobs)
    if score_prompt:  # max_tokens=0 without logprobs: rows computed, not shown
        fields.update(logprob_start_len=0, logprobs=req.logprobs if req.logprobs is not None else 0)
    out = []
    for prompt in prompts:
        echo = None
        if req.echo:
            ids = list(tokenizer.encode(prompt, add_special_tokens=False)) if isinstance(prompt, str) else prompt
            text = prompt if isinstance(prompt, str) else _decode(tokenizer, ids)
            echo, prompt = Echo(text, ids), ids if score_prompt else prompt
        out.append((echo, engine_requests(prompt, req, rename, "cmpl", n=req.n, **fields, **output_fields(req))))
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
    return engine_requests(ids, req, rename, "chatcmpl", max_new_tokens=max_tokens, min_new_tokens=req.min_tokens,
                            n=req.n, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                            **output_fields(req))


def shown_logprobs(asked: int | None, reqs: list[EngineRequest]) -> int | None:
    """The logprob rows a response shows: those asked for, and a read's rows (every id of its allowed
    sets), which are its answer, even when none were asked for."""
    reads = [r.params.logprobs or 0 for r in reqs if r.params.is_read]
    return max([asked or 0, *reads]) if reads else asked


# ---- responses ------------------------------------------------------------------------------
class ChoiceFormatter:
    """One OpenAI choice (completion or chat) from its results; one instance per choice, so that
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

    def _completion_logprobs(self, out: Result) -> dict[str, Any]:
        """OpenAI's completion logprobs; with echo the prompt's tokens come first (the first has no
        logprob: nothing precedes it)."""
        k = self.k or 0
        entries: list[tuple[int, float | None, dict[str, float] | None]] = []
        if self.echo is not None and out.input_token_logprobs and not self.prompt_listed:
            self.prompt_listed = True
            scored = out.input_token_logprobs
            tops = out.input_top_logprobs or [None] * len(scored)
            entries.append((self.echo.ids[0], None, None))
            entries += [(t, v, self._tops(rows(top)) if k > 0 else None) for (v, t), top in zip(scored, tops)]
        for e in out.logprobs or []:
            entries.append((next(iter(e)), next(iter(e.values())), self._tops(top_rows(e, k)) if k > 0 else None))
        tokens, offsets = [], []
        for t, _, _ in entries:
            tokens.append(self.token_text(t))
            offsets.append(self.offset)
            self.offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [v for _, v, _ in entries],
                "top_logprobs": [top for _, _, top in entries] if k > 0 else None, "text_offset": offsets}

    def _chat_logprobs(self, out: Result) -> dict[str, Any]:
        def item(t: int, v: float) -> dict[str, Any]:
            s = self.token_text(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

        content = []
        for e in out.logprobs or []:
            entry = item(next(iter(e)), next(iter(e.values())))
            entry["top_logprobs"] = [item(t, v) for v, t in top_rows(e, self.k or 0)]
            content.append(entry)
        return {"content": content}

    def choice(self, out: Result, delta: bool) -> dict[str, Any]:
        text = out.text
        if self.first and self.echo is not None:
            text = self.echo.text + text
        choice: dict[str, Any] = {"index": self.index}
        if self.kind == "completion":
            choice["text"] = text
        elif delta:
            choice["delta"] = {"role": "assistant", "content": text} if self.first else {"content": text}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        if self.k is None or out.logprobs is None:
            choice["logprobs"] = None
        else:
            choice["logprobs"] = (self._completion_logprobs(out) if self.kind == "completion"
                                  else self._chat_logprobs(out))
        choice["finish_reason"] = out.finish_reason
        choice["step_map"] = None if out.step_map is None else list(out.step_map)
        choice.update(weight_meta(out))
        choice.update(dllm_steps(out))
        choice.update(on_request_meta(out))
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
        self.finals: dict[int, Result] = {}  # streamed: each choice's last delta

    def _usage(self, outs: Mapping[int, Result]) -> dict[str, int]:
        """Prompt tokens once per prompt, completion tokens over every choice."""
        p = sum(o.input_token_len for i, o in outs.items() if i % self.n == 0)
        c = sum(o.generate_token_len for o in outs.values())
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def full(self, outs: list[Result]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion" if self.kind == "completion" else "chat.completion",
                "created": self.created, "model": self.model,
                "choices": [f.choice(o, delta=False) for f, o in zip(self.choices, outs)],
                "usage": self._usage(dict(enumerate(outs)))}

    def chunks(self, index: int, out: Result) -> list[dict[str, Any]]:
        """The stream chunks for one delta of choice `index` (none when it carries nothing OpenAI
        shows); the usage chunk follows the last choice's last delta when asked for."""
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        base = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        finished = out.finish_reason is not None
        if finished:
            self.finals[index] = out
        if not (out.text or out.token_ids or out.input_token_logprobs or finished):
            return []
        result = [dict(base, choices=[self.choices[index].choice(out, delta=True)])]
        if out.finish_reason == "error":
            result.append({"error": {"message": out.error or "the engine failed this request",
                                     "type": "internal_error", "param": None}})
        if self.include_usage:
            result[0]["usage"] = None
            if len(self.finals) == len(self.choices):
                result.append(dict(base, choices=[], usage=self._usage(self.finals)))
        return result
