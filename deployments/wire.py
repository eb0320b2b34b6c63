"""The ingress <-> EngineServer protocol: plain data that pickles across processes.

A request is an `EngineRequest` dict. Results are *result dicts*: `OutputChunk.to_dict()` (a
streamed delta) or `Response.to_dict()` (the folded unary result); the final one carries `matched`
(what stopped the request). A refusal is an error item (`ApiError.to_item()`).
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, Field

from configs import GenerationConfig

Prompt = str | list[int]


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
