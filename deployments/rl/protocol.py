"""The RL control routes' payloads: SGLang's names and fields, with SGLang's lax types (a port as
"29500", a `weight_version` as any scalar)."""

from __future__ import annotations

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


CONTROL_REQUESTS: dict[str, type[_Control]] = {
    "update_weights_from_disk": UpdateWeightsFromDiskRequest,
    "update_weights_from_tensor": UpdateWeightsFromTensorRequest,
    "init_weights_update_group": InitWeightsUpdateGroupRequest,
    "update_weights_from_distributed": UpdateWeightsFromDistributedRequest,
    "destroy_weights_update_group": DestroyWeightsUpdateGroupRequest,
    "flush_cache": EmptyControlRequest,
    "pause_generation": PauseGenerationRequest,
    "continue_generation": EmptyControlRequest,
    "release_memory_occupation": MemoryOccupationRequest,
    "resume_memory_occupation": MemoryOccupationRequest,
}
