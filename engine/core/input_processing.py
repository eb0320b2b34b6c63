"""Input processing: a request's prompt turned into token ids, and every rule it must meet, with
messages that say what to change.

It sees what it checks against -- the tokenizer and the `ModelLimits` of the loaded model and
cache -- never the engine (the HTTP schemas check field ranges first, with the same limits as
`GenerationConfig`; these are the rules that need the model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from configs import GenerationConfig
from configs.knobs import KNOBS, request_knobs, rules_of, unusable
from engine.errors import RequestError


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: the model's vocabulary and paradigm, the engine's lengths."""

    vocab_size: int
    max_model_len: int
    kv_page_size: int
    num_kv_pages: int
    block_length: int | None  # the diffusion block of a block-diffusion model; None for AR
    logprobs_mode: str | None

    @property
    def is_dllm(self) -> bool:
        return self.block_length is not None


def _tokenize(tokenizer: Any, limits: ModelLimits, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty", "prompt")
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise RequestError("input_ids must be a list of integer token ids", "input_ids")
    if not prompt:
        raise RequestError("input_ids is empty", "input_ids")
    vocab = limits.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"input_ids holds ids outside the vocabulary [0, {vocab}): {bad[:5]}", "input_ids")
    return list(prompt)


def _check_trajectory(limits: ModelLimits, prompt: str | list[int], params: GenerationConfig) -> None:
    """The request-level rules of a trajectory (the trajectory's own values are `plan_trajectory`'s)."""
    if not limits.is_dllm:
        raise RequestError("dllm_trajectory scores block-diffusion rollouts and this request decodes "
                           "autoregressively (an autoregressive model, or dllm_mode='ar'): "
                           "score an AR rollout with logprob_start_len (input-token logprobs over prompt + "
                           "output, max_new_tokens=0)", "dllm_trajectory")
    if isinstance(prompt, str):
        raise RequestError("trajectory scoring needs the rollout's prompt as token ids (input_ids), not text: "
                           "positions and blocks are counted in tokens", "input_ids")
    if params.max_new_tokens != 0:
        raise RequestError(f"max_new_tokens={params.max_new_tokens}: a dllm_trajectory request scores and "
                           "generates nothing; set max_new_tokens=0", "max_new_tokens")
    if params.logprob_start_len >= 0:
        raise RequestError("logprob_start_len does not apply to a dllm_trajectory request (block-diffusion "
                           "models have no input-token logprobs); leave it at -1", "logprob_start_len")
    if params.logprobs is None:
        raise RequestError("trajectory scoring returns logprobs: set logprobs >= 0 (return_logprob=true over "
                           "HTTP)", "logprobs")


def _check_scoring(limits: ModelLimits, prompt: str | list[int], ids: list[int], p: GenerationConfig) -> None:
    """max_new_tokens=0 is a scoring request; logprob_start_len >= 0 asks for rows."""
    if p.dllm_trajectory is not None:
        _check_trajectory(limits, prompt, p)
        return
    scoring = p.max_new_tokens == 0
    if not scoring and p.logprob_start_len < 0:
        return
    if limits.is_dllm:
        if p.logprob_start_len >= 0:
            raise RequestError("input-token logprobs (logprob_start_len >= 0) are only available for AR models; "
                               "this model is not autoregressive (it decodes by block diffusion or by renoising a "
                               "canvas) and scores no prompt tokens", "logprob_start_len")
        raise RequestError("max_new_tokens=0 asks for scoring (input-token logprobs), which only AR models "
                           "support; this model is not autoregressive (it decodes by block diffusion or by "
                           "renoising a canvas): ask for at least one new token", "max_new_tokens")
    if scoring and isinstance(prompt, str):
        raise RequestError("scoring (max_new_tokens=0) needs token-id input (input_ids), not text", "input_ids")
    if scoring and p.logprob_start_len < 0:
        raise RequestError("max_new_tokens=0 is only for scoring: set logprob_start_len >= 0 "
                           "or ask for at least one new token", "max_new_tokens")
    if p.logprob_start_len + 1 >= len(ids):
        raise RequestError(f"logprob_start_len={p.logprob_start_len} leaves no input token to score: it "
                           f"must be < len(input_ids) - 1 = {len(ids) - 1}", "logprob_start_len")
    if p.logprobs is None:
        raise RequestError("input-token logprobs need logprobs >= 0 (return_logprob=true over HTTP)", "logprobs")
    if limits.logprobs_mode is None:
        raise RequestError("this engine was started with logprobs_mode=None; restart it with logprobs_mode="
                           "'raw_logprobs' or 'raw_logits' to score inputs", "logprobs_mode")


def _readers(paradigm: str) -> str:
    return ", ".join(k.name for k in request_knobs() if paradigm in k.used_by) or "none"


def check_knobs(params: GenerationConfig, paradigm: str, rule: str | None) -> None:
    """The request's decoding knobs against the model's paradigm and the request's unmasking rule
    (`rule`: the resolved one; None for a paradigm without rules), from the knob table: a knob the
    paradigm does not read, a rule it does not decode with, or a `strict_rules` knob the rule does not
    read is a RequestError naming the field."""
    for knob in unusable(paradigm):
        if knob.per_request and getattr(params, knob.name) is not None:
            what = "this model is autoregressive" if paradigm == "autoregressive" else \
                f"this model decodes with {paradigm} decoding, which reads only {_readers(paradigm)}"
            raise RequestError(f"{knob.name} does not apply to this model: it is read by "
                               f"{' and '.join(knob.used_by)} decoding and {what}; leave it unset", knob.name)
    if rule is None:
        return
    rules = rules_of(paradigm)
    if rule not in rules:
        raise RequestError(f"dllm_unmasking_strategy={rule!r} does not apply to this model ({paradigm} decoding); "
                           f"leave it unset or use {' or '.join(rules)}", "dllm_unmasking_strategy")
    for knob in KNOBS.values():
        if knob.per_request and knob.strict_rules and rule not in knob.rules and getattr(params, knob.name) is not None:
            raise RequestError(f"{knob.name} applies to the unmasking rule {' or '.join(knob.rules)} only and this "
                               f"request decodes with {rule}: set dllm_unmasking_strategy to "
                               f"{' or '.join(map(repr, knob.rules))}, or leave {knob.name} unset", knob.name)


def process_input(tokenizer: Any, limits: ModelLimits, prompt: str | list[int], params: GenerationConfig
                  ) -> list[int]:
    """Token ids of a valid request, or RequestError."""
    ids = _tokenize(tokenizer, limits, prompt)
    _check_scoring(limits, prompt, ids, params)
    total = len(ids) + params.max_new_tokens
    if total > limits.max_model_len:
        raise RequestError(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                           f"exceeds max_model_len={limits.max_model_len}; shorten the prompt or lower "
                           "max_new_tokens", "max_new_tokens")
    if limits.is_dllm:
        b = limits.block_length
        total = -(-total // b) * b
    pages = -(-total // limits.kv_page_size)
    if pages > limits.num_kv_pages:
        raise RequestError(f"the request needs {pages} KV pages but the cache has only {limits.num_kv_pages}; "
                           "it can never fit: shorten it or raise num_kv_blocks", "max_new_tokens")
    vocab = limits.vocab_size
    if params.stop_token_ids and any(t >= vocab for t in params.stop_token_ids):
        raise RequestError(f"stop_token_ids must be < vocab size {vocab}", "stop_token_ids")
    if params.logprobs is not None and params.logprobs > vocab:
        raise RequestError(f"logprobs={params.logprobs} exceeds the vocabulary size {vocab}", "logprobs")
    return ids
