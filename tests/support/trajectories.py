"""A rollout sent back for scoring, as a trainer does: the request that scores it under the sampling
parameters it was generated with (shared by the trajectory-scoring tests of every family)."""

from __future__ import annotations

from configs.trajectory import DllmTrajectory
from engine import GenerationConfig, Response


def scoring_config(out: Response, gen: GenerationConfig, **kw) -> GenerationConfig:
    """Score `out` (asked with `return_dllm_replay=True`) under `gen`, the parameters it was generated
    with; `kw` go to its `DllmTrajectory` (e.g. `return_entropy`)."""
    return gen.model_copy(update={"max_new_tokens": 0, "dllm_trajectory": DllmTrajectory.from_response(out, **kw),
                                  "return_dllm_replay": False, "stop_token_ids": gen.stop_token_ids})
