"""The ingress <-> EngineServer protocol: typed plain data that pickles across processes.

What crosses, and which way:

- ingress -> EngineServer: one `EngineRequest` per request (`generate_stream(request)`, or a list of
  them in `generate_batch`);
- EngineServer -> ingress, per request: its results, `OutputChunk` deltas when streamed or the folded
  `Response` when unary (`engine.carrier`; the final one carries `finish_reason`, and with "stop" the
  stop that `matched`), or a single `Rejection` in their place when the request is refused;
- `ModelInfo`: the model and engine facts the ingress needs (it loads no model code), asked once;
- `ControlAnswer`: one replica's answer to an RL control call or an abort;
- `ReplicaStats` and `MetricFamilies`: one replica's stats (the engine's `EngineSnapshot`, typed in
  `engine.answers`) and its request histograms, for /metrics, /server_info and the handle API.

Every field is a built-in type, a config model, a prometheus_client family or one of these (no tensors:
weights sent by reference travel beside this protocol, straight to the replicas), so Ray pickles them
as they are.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.metrics_core import Metric
from pydantic import BaseModel, Field

from configs import EngineConfig, GenerationConfig
from engine.answers import ControlResult, EngineSnapshot
from engine.carrier import OutputChunk, Response

Prompt = str | list[int]

# What the response builders read: one streamed delta, or the folded result of a request. Both hold
# the carrier's fields, so building each delta and concatenating equals building the whole.
Result = OutputChunk | Response


class EngineRequest(BaseModel):
    """One request, as the ingress sends it to an EngineServer (one per sample of a prompt)."""

    prompt: Prompt  # the text to tokenize, or the token ids as they are
    # what the request asks for, validated; its `model_fields_set` are the fields the client set (and
    # those the endpoint sets itself): a field left unset stays unset in the engine (a rule that only
    # decodes greedily takes an unset temperature as greedy; a failed step names the fields given)
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
    def of(cls, result: ControlResult, replica: str = "local", rank: int | None = None,
           ranks: Sequence[int] = ()) -> ControlAnswer:
        """A replica's answer from what the operation did on its engine."""
        return cls(True, result.message, replica, rank, requests=result.requests, ranks=list(ranks),
                   weight_version=result.weight_version)

    @classmethod
    def failure(cls, e: Exception, replica: str = "local", rank: int | None = None,
                ranks: Sequence[int] = ()) -> ControlAnswer:
        """A replica's answer from the exception of the operation: `refused` when it refused the input
        (a ValueError, WeightUpdateError included) rather than failed."""
        refused = isinstance(e, ValueError)
        return cls(False, str(e) if refused else f"{type(e).__name__}: {e}", replica, rank, refused,
                   ranks=list(ranks))


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's stats (`EngineServer.stats`)."""

    replica: str  # the replica's Serve id
    rank: int  # its rank among the deployment's replicas
    model_type: str  # config.json's model_type
    tp: int  # tensor-parallel ranks per replica
    max_model_len: int  # the most tokens (prompt + output) one request may hold
    engine: EngineSnapshot  # its engine's load and counters

    def to_dict(self) -> dict[str, Any]:
        """The handle API's JSON (`Ingress.engine_stats`): the engine's stats, then the replica's facts."""
        return self.engine.to_dict() | {"replica": self.replica, "rank": self.rank, "model_type": self.model_type,
                                        "tp": self.tp, "max_model_len": self.max_model_len}


@dataclass(frozen=True)
class MetricFamilies:
    """One replica's request histograms (`EngineServer.metric_families`), for the ingress's /metrics."""

    replica: str  # the replica's Serve id
    families: list[Metric]  # its prometheus_client families (RequestMetrics)


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
