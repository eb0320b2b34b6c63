"""Request validation: every rule a request must meet, with messages that say what to change."""

from __future__ import annotations

from typing import TYPE_CHECKING

from configs import GenerationConfig

if TYPE_CHECKING:
    from engine.engine import LLMEngine


class RequestError(ValueError):
    """A request the engine refuses; `param` names the offending field (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


def _tokenize(engine: LLMEngine, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty", "prompt")
        return list(engine.tokenizer.encode(prompt, add_special_tokens=False))
    if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise RequestError("input_ids must be a list of integer token ids", "input_ids")
    if not prompt:
        raise RequestError("input_ids is empty", "input_ids")
    vocab = engine.spec.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"input_ids holds ids outside the vocabulary [0, {vocab}): {bad[:5]}", "input_ids")
    return list(prompt)


def _check_scoring(engine: LLMEngine, prompt: str | list[int], ids: list[int], p: GenerationConfig) -> None:
    """max_new_tokens=0 is a scoring request; logprob_start_len >= 0 asks for rows."""
    scoring = p.max_new_tokens == 0
    if not scoring and p.logprob_start_len < 0:
        return
    if engine.is_dllm:
        if p.logprob_start_len >= 0:
            raise RequestError("input-token logprobs (logprob_start_len >= 0) are only available for AR models; "
                               "this model is a block-diffusion LM", "logprob_start_len")
        raise RequestError("max_new_tokens=0 asks for scoring (input-token logprobs), which only AR models "
                           "support; this model is a block-diffusion LM: ask for at least one new token",
                           "max_new_tokens")
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
    if engine.config.logprobs_mode is None:
        raise RequestError("this engine was started with logprobs_mode=None; restart it with logprobs_mode="
                           "'raw_logprobs' or 'raw_logits' to score inputs", "logprobs_mode")


def validate_request(engine: LLMEngine, prompt: str | list[int], params: GenerationConfig) -> list[int]:
    """Token ids of a valid request, or RequestError."""
    ids = _tokenize(engine, prompt)
    _check_scoring(engine, prompt, ids, params)
    total = len(ids) + params.max_new_tokens
    cfg = engine.config
    if total > cfg.max_model_len:
        raise RequestError(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                           f"exceeds max_model_len={cfg.max_model_len}; shorten the prompt or lower "
                           "max_new_tokens", "max_new_tokens")
    if engine.is_dllm:
        b = engine.block_length
        total = -(-total // b) * b
    pages = -(-total // cfg.kv_block_size)
    if pages > engine.kv.num_pages:
        raise RequestError(f"the request needs {pages} KV pages but the cache has only {engine.kv.num_pages}; "
                           "it can never fit: shorten it or raise num_kv_blocks", "max_new_tokens")
    vocab = engine.spec.vocab_size
    if params.stop_token_ids and any(t >= vocab for t in params.stop_token_ids):
        raise RequestError(f"stop_token_ids must be < vocab size {vocab}", "stop_token_ids")
    if params.logprobs is not None and params.logprobs > vocab:
        raise RequestError(f"logprobs={params.logprobs} exceeds the vocabulary size {vocab}", "logprobs")
    return ids
