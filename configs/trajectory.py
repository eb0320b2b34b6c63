"""A block-diffusion rollout to score: what `GenerationConfig.dllm_trajectory` (and the `/generate`
field of the same name) carries. Only the shape of each field is checked here; whether the values
form a valid trajectory for the loaded model (block length, step order, replay) is the engine's
check, which names the offending field."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class DllmTrajectory(BaseModel):
    """The values a rollout returned: `output_ids` and their global `step_map`, and, when the output
    ended inside a block, the final-block replay (`dllm_replay_token_ids`, `dllm_replay_step_maps`,
    `dllm_stop_length` of the rollout's response)."""

    model_config = ConfigDict(extra="forbid")

    output_ids: list[int] = Field(min_length=1)
    step_map: list[int]
    replay_token_ids: list[int] | None = None
    replay_step_maps: list[int] | None = None
    stop_length: int | None = Field(None, ge=0)
    return_entropy: bool = Field(False, description="also return the entropy (nats) of each scored row")

    @classmethod
    def from_response(cls, rollout: Any, **fields: Any) -> DllmTrajectory:
        """The trajectory of a rollout's response (an `engine.Response`, asked with
        `return_dllm_replay=True`), as a trainer sends it back; `fields` add e.g. `return_entropy`."""
        return cls(output_ids=rollout.token_ids, step_map=rollout.step_map,
                   replay_token_ids=rollout.dllm_replay_token_ids, replay_step_maps=rollout.dllm_replay_step_maps,
                   stop_length=rollout.dllm_stop_length, **fields)
