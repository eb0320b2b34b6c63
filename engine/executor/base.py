"""The executor surface: how the engine reaches the model's ranks, whatever runs them.

`LLMEngine` holds one `Executor` and calls nothing else on it. `engine.executor.local` runs the one
rank in the engine's own process (tp=1); `engine.executor.ray_tp` runs rank 0 in-process and ranks
1..tp-1 as Ray actors. A new way to run ranks (another transport, another placement) implements
this Protocol and is passed as the engine's `executor_factory`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from configs import EngineConfig
    from engine.model.checkpoint import ModelSpec
    from engine.worker.forward_batch import ForwardBatch, ForwardOutput


@runtime_checkable
class Executor(Protocol):
    """What the engine needs of its ranks. Every rank holds one shard of the model and of the KV
    cache; calls reach every rank, in the order the engine makes them (the ranks' collectives need
    the same forwards in the same order everywhere)."""

    @property
    def num_pages(self) -> int:
        """The KV-cache pages every rank holds (the smallest count over the ranks): the pages the
        engine's page manager may hand out."""
        ...

    @property
    def kv_groups(self) -> dict[str, tuple[int, int | None]] | None:
        """Per layer group, (its pages, its sliding window or None), when the network's layer groups
        keep their K/V in pools of their own (engine.kv.layer_group_pages); None otherwise."""
        ...

    def set_dllm_block_length(self, block_length: int | None) -> None:
        """Set the block length every rank's model decodes in (None: an autoregressive model), before
        the first forward."""
        ...

    def execute(self, batch: ForwardBatch) -> ForwardOutput:
        """Run one forward of `batch` on every rank; rank 0's output (logits, hidden states). A rank
        that fails or does not answer raises, and the engine then treats the ranks as unusable."""
        ...

    def run_on_ranks(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """`ModelRunner.<method>(*args)` on every rank between forwards (weight updates, update groups,
        memory release); the results in rank order. A rank's exception is raised only once every
        rank has finished. `timeout_s` (None: the executor's own) bounds the wait for the ranks."""
        ...

    def describe(self) -> dict[str, Any]:
        """Plain facts about how the ranks run, merged into the engine's stats (`executor`, ...)."""
        ...

    def shutdown(self) -> None:
        """Free the ranks (actors, process groups); the executor is unusable afterwards."""
        ...


# How the engine builds its executor: (the checkpoint's spec, the engine config) -> an Executor.
ExecutorFactory = Callable[["ModelSpec", "EngineConfig"], Executor]
