"""The RL control operations, declared once in `CONTROL_OPS`: each one's SGLang name, payload (SGLang's
fields, with SGLang's lax types: a port as "29500", a `weight_version` as any scalar), HTTP route
shape and how the ingress runs it on the engine replicas. The HTTP routes and the ingress's handle
methods (`deployments.rl.routes`), the run across the replicas (`deployments.rl.control`) and the
replica's own dispatch (`deployments.engine_server`) all come from that table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def _version(value: Any) -> Any:
    """A weight version as its string (verl sends numbers); None stays None (the version is kept)."""
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


WeightVersion = Annotated[str | None, BeforeValidator(_version)]


class _Control(BaseModel):
    # Unknown fields are ignored, not refused: trainers written for SGLang send SGLang's own extras
    # (flush_cache, ...), and the same code must work here unchanged.
    model_config = ConfigDict(extra="ignore", strict=False, allow_inf_nan=False)


class EmptyControlRequest(_Control):
    """flush_cache, continue_generation: no fields."""


class _Update(_Control):
    weight_version: WeightVersion = Field(None, description="the version to serve after it (None: unchanged)")
    abort_all_requests: bool = Field(False, description="end the requests in flight instead of letting them finish")


class UpdateWeightsFromDiskRequest(_Update):
    model_path: str
    load_format: str | None = Field(None, description="None, auto or safetensors (others are refused)")


class UpdateWeightsFromTensorRequest(_Update):
    """Handle only: `named_tensors` are [[name, torch.Tensor], ...] (or SGLang's flattened_bucket payload
    with load_format="flattened_bucket"), carried by Ray; given as `ray.put(named_tensors)` (an
    ObjectRef) they are fetched by each engine replica and never deserialized in the ingress, which
    then never loads torch. SGLang's HTTP `serialized_named_tensors` (pickles) are refused."""

    model_config = ConfigDict(extra="ignore", strict=False, arbitrary_types_allowed=True)

    named_tensors: Any = None
    serialized_named_tensors: Any = None
    load_format: str | None = None


class InitWeightsUpdateGroupRequest(_Control):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(1, ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["nccl", "gloo"] = "nccl"
    timeout_s: float | None = Field(None, gt=0.0, description="the group must meet within it (None: the engine's)")


class UpdateWeightsFromDistributedRequest(_Update):
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    load_format: Literal["flattened_bucket"] | None = Field(
        None, description="None: one broadcast per name; flattened_bucket: one broadcast of every tensor's bytes")


class DestroyWeightsUpdateGroupRequest(_Control):
    group_name: str = "weight_update_group"


class PauseGenerationRequest(_Control):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class MemoryOccupationRequest(_Control):
    tags: list[str] | None = Field(None, description="weights, kv_cache, cuda_graph (none or []: all)")


# A weight update's payload, as the ingress sends it to every replica to stage
WeightUpdate = UpdateWeightsFromDiskRequest | UpdateWeightsFromTensorRequest | UpdateWeightsFromDistributedRequest

# How the ingress runs an operation on the engine replicas: `call` every replica runs it as it is;
# `update` a weight update in two phases (stage everywhere, then commit or discard everywhere); `join`
# every replica joins the trainer's group at ranks of its own
Reach = Literal["call", "update", "join"]


@dataclass(frozen=True)
class ControlOp:
    """One RL control operation."""

    name: str  # SGLang's route and method name, the ingress's handle method and the engine's method
    request: type[_Control]  # its payload
    summary: str  # its route's summary
    reach: Reach  # how the ingress runs it on the engine replicas
    methods: tuple[str, ...] = ("POST",)  # its route's HTTP methods
    body: bool = True  # whether the route reads a JSON body (those without one take none)


CONTROL_OPS: dict[str, ControlOp] = {op.name: op for op in (
    ControlOp("update_weights_from_disk", UpdateWeightsFromDiskRequest, "RL: load a checkpoint on every replica",
              "update"),
    ControlOp("update_weights_from_tensor", UpdateWeightsFromTensorRequest, "RL: handle only (tensors travel by Ray)",
              "update"),
    ControlOp("init_weights_update_group", InitWeightsUpdateGroupRequest, "RL: join the trainer's broadcast group",
              "join"),
    ControlOp("update_weights_from_distributed", UpdateWeightsFromDistributedRequest,
              "RL: receive weights by broadcast", "update"),
    ControlOp("destroy_weights_update_group", DestroyWeightsUpdateGroupRequest, "RL: leave the broadcast group",
              "call"),
    ControlOp("flush_cache", EmptyControlRequest, "RL: drop the prefix cache", "call", ("GET", "POST"), body=False),
    ControlOp("pause_generation", PauseGenerationRequest, "RL: stop generating (abort | retract | in_place)", "call"),
    ControlOp("continue_generation", EmptyControlRequest, "RL: generate again after pause_generation", "call",
              body=False),
    ControlOp("release_memory_occupation", MemoryOccupationRequest, "RL: free weights and/or KV cache", "call"),
    ControlOp("resume_memory_occupation", MemoryOccupationRequest, "RL: restore weights and/or KV cache", "call"),
)}
