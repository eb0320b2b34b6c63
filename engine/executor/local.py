"""The in-process executor (tp=1): the runner lives in the engine's own process.

It implements `engine.executor.base.Executor`, the surface the engine uses;
engine.executor.ray_tp runs tensor-parallel ranks as Ray actors behind the same one.
"""

from __future__ import annotations

from typing import Any

from configs import EngineConfig
from engine.model.checkpoint import ModelSpec
from engine.worker.forward_batch import ForwardBatch, ForwardOutput
from engine.worker.runner import ModelRunner


class LocalExecutor:
    """An `Executor` running the model in this process (tp=1)."""

    def __init__(self, spec: ModelSpec, config: EngineConfig):
        if config.tp != 1:
            raise ValueError(f"tp={config.tp}: the in-process engine runs tp=1; serve with "
                             "deployments.app:build_app for tensor parallelism over Ray")
        self.runner = ModelRunner(spec, config)

    @property
    def num_pages(self) -> int:
        return self.runner.num_pages

    @property
    def kv_groups(self) -> dict[str, tuple[int, int | None]] | None:
        return self.runner.kv_groups

    def set_dllm_block_length(self, block_length: int | None) -> None:
        self.runner.set_dllm_block_length(block_length)

    def execute(self, batch: ForwardBatch) -> ForwardOutput:
        return self.runner.execute(batch)

    def run_on_ranks(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """`ModelRunner.<method>(*args)` on every rank (here the only one); the results in rank order."""
        return [getattr(self.runner, method)(*args)]

    def describe(self) -> dict[str, Any]:
        return {"executor": "local", **self.runner.describe()}

    def shutdown(self) -> None:
        pass
