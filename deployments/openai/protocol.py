"""OpenAI's request models: /v1/completions and /v1/chat/completions."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from configs.limits import MAX_N, MAX_TOP_LOGPROBS
from deployments.generation import SamplingFields, Strict


class StreamOptions(Strict):
    include_usage: bool = False


class OpenAIFields(SamplingFields):
    """Fields both OpenAI endpoints take."""

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


class CompletionRequest(OpenAIFields):
    """POST /v1/completions: one prompt or a list of prompts, n choices each."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]
    name: str | None = None


class ChatCompletionRequest(OpenAIFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
