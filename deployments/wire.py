"""The ingress <-> EngineServer protocol: typed plain data that pickles across processes.

What crosses, and which way:

- ingress -> EngineServer: one `EngineRequest` per request (`generate_stream(request)`, or a list of
  them in `generate_batch`);
- EngineServer -> ingress, per request: its results, `OutputChunk` deltas when streamed or the folded
  `Response` when unary (`engine.carrier`; the final one carries `finish_reason`, and with "stop" the
  stop that `matched`), or a single `Rejection` in their place when the request is refused;
- `ModelInfo`: the model and engine facts the ingress needs (it loads no model code), asked once;
- `ControlAnswer`: one replica's answer to an RL control call or an abort.

Every field is a built-in type, a config model or one of these (no tensors: weights sent by reference
travel beside this protocol, straight to the replicas), so Ray pickles them as they are.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from configs import EngineConfig, GenerationConfig
from engine.carrier import OutputChunk, Response

Prompt = str | list[int]

# What the response builders read: one streamed delta, or the folded result of a request. Both hold
# the carrier's fields, so building each delta and concatenating equals building the whole.
Result = OutputChunk | Response


class EngineRequest(BaseModel):
    """One request, as the ingress sends it to an EngineServer (one per sample of a prompt)."""

    prompt: Prompt  # the text to tokenize, or the token ids as they are
    # what the request asks for, validated; built from a whole dump of the endpoint's config, so every
    # field counts as given (the engine names the given sampling fields when a request's step fails)
    params: GenerationConfig
    request_id: str  # unique among the requests in flight; `abort_request(rid)` finds it by this id
    # engine field name -> this endpoint's field name, so that a refusal names the field as the caller wrote it
    rename: dict[str, str] = Field(default_factory=dict)


@dataclass(frozen=True)
class Rejection:
    """A refused request, in place of its results: the API error the ingress answers."""

    message: str  # what is wrong and what to change, in the endpoint's field names
    param: str | None = None  # the offending field (the endpoint's name), None when no one field is
    status: int = 400  # the HTTP status (400 refused input, 503 no engine to run it, 500 a bug)
    type: str = "invalid_request_error"  # the error object's `type`
    retry_after_s: float | None = None  # a 503's own Retry-After (None: the server's default)


@dataclass(frozen=True)
class ModelInfo:
    """The model and engine facts of an engine replica (the same on every replica)."""

    model_path: str  # the checkpoint directory the replica loaded
    model_type: str  # config.json's model_type
    architectures: list[str] | None  # config.json's architectures (None: absent or unreadable)
    is_dllm: bool  # a block-diffusion LM (False: autoregressive)
    max_model_len: int  # the most tokens (prompt + output) one request may hold
    tp: int  # tensor-parallel ranks per replica
    max_total_num_tokens: int  # the KV cache's capacity in tokens (pages x page size)
    engine: EngineConfig  # the replica's engine config, with the family's decoding defaults applied
    weight_op_timeout_s: float  # how long the engine waits on a trainer in a weight operation
    paradigm: str  # how the model decodes: autoregressive, block, sub_block or renoising (configs.knobs)


@dataclass(frozen=True)
class ControlAnswer:
    """One replica's answer to an RL control call (or an abort)."""

    success: bool  # the call did what it was asked on this replica
    message: str  # what was done, or why it was not
    replica: str = "local"  # the replica's Serve id
    rank: int | None = None  # the replica's rank among the deployment's replicas (None: not a replica's)
    refused: bool = False  # failed because the input was refused (400), not because the replica failed (500)
    requests: int | None = None  # requests aborted or paused, where the call affects requests
    ranks: list[int] = field(default_factory=list)  # init_weights_update_group: the group ranks joined
    weight_version: str | None = None  # commit_weights: the version now served

    @classmethod
    def of(cls, answer: dict[str, Any], replica: str = "local", rank: int | None = None) -> ControlAnswer:
        """The answer from the engine's own (a dict: `success`, `message` and the call's extras)."""
        return cls(bool(answer.get("success")), str(answer.get("message", "")), replica, rank,
                   bool(answer.get("refused", False)), answer.get("requests"), list(answer.get("ranks", ())),
                   answer.get("weight_version"))


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
