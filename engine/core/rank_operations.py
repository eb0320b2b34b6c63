"""The engine's operations on every rank: memory release and resume, the trainer's update group, and
two-phase weight updates (see engine.worker.weight_staging). Held by `LLMEngine` (as `ranks`, its
methods offered as the engine's own), whose step loop runs them between steps; forwards in flight are
applied first (`land_all`), so none runs on weights or pages that change under it."""

from __future__ import annotations

from collections.abc import Callable

from engine.core.model_settings import EngineStats
from engine.errors import WeightUpdateError
from engine.executor.base import Executor
from engine.model.checkpoint import load_model_spec
from engine.model.spec import ModelSpec
from engine.worker.update_group import GROUP_JOIN_TIMEOUT_S, WEIGHT_OP_TIMEOUT_S
from engine.worker.weight_sources import DiskWeights, WeightSource, check_same_architecture


class RankOperations:
    """What a trainer asks of every rank of one replica (the engine's part of RL control), and the name
    of the weights it serves."""

    def __init__(self, executor: Executor, spec: ModelSpec, stats: EngineStats, land_all: Callable[[], None],
                 retract_all: Callable[[], int], flush_cache: Callable[[], None]):
        """`land_all`, `retract_all`, `flush_cache`: the engine's (apply the forwards in flight; give
        back every running request's pages; drop the prefix cache)."""
        self.executor, self.spec, self.stats = executor, spec, stats
        self._land_all, self._retract_all, self._flush_cache = land_all, retract_all, flush_cache
        self.weight_version = "default"  # names the weights in every output; an update sets it

    # ---- memory and the trainer's update group, on every rank ---------------------------------
    def release_memory(self, tags: list[str]) -> None:
        """Free the weights and/or the KV cache on every rank. Releasing the KV cache first retracts
        the running requests and flushes the prefix cache."""
        self._land_all()
        if "kv_cache" in tags:
            self._retract_all()
            self._flush_cache()
        self.executor.run_on_ranks("release_memory", tags)

    def resume_memory(self, tags: list[str]) -> None:
        self.executor.run_on_ranks("resume_memory", tags, timeout_s=WEIGHT_OP_TIMEOUT_S)

    def init_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                          group_name: str, backend: str, timeout_s: float = GROUP_JOIN_TIMEOUT_S) -> None:
        """Every rank joins the trainer's group as `rank_offset` + its tensor-parallel rank. A group
        that does not form within `timeout_s` raises WeightUpdateError naming who did not join; the
        ranks that had joined leave it again."""
        try:
            self.executor.run_on_ranks("init_update_group", master_address, master_port, rank_offset, world_size,
                                       group_name, backend, timeout_s, timeout_s=timeout_s + 60.0)
        except Exception as e:
            if getattr(e, "fatal", False):
                raise
            self.executor.run_on_ranks("destroy_update_group", group_name, True)
            raise

    def destroy_update_group(self, group_name: str) -> None:
        self.executor.run_on_ranks("destroy_update_group", group_name)

    # ---- weight updates (two phases over every rank; see engine.worker.weight_staging) -----------
    def stage_weights(self, source: WeightSource) -> None:
        """Phase one: every rank stages its slices of `source`. Raises WeightUpdateError when any rank
        refuses; every rank has then discarded what it staged (nothing changed)."""
        if isinstance(source, DiskWeights):
            check_same_architecture(self.spec, load_model_spec(source.path))
        self._land_all()
        try:
            self.executor.run_on_ranks("stage_weights", source, timeout_s=WEIGHT_OP_TIMEOUT_S)
        except Exception as e:
            if getattr(e, "fatal", False):
                raise
            self.discard_weights()
            if isinstance(e, WeightUpdateError):
                raise
            raise WeightUpdateError(f"weight update failed while staging ({type(e).__name__}: {e})") from e

    def commit_weights(self, weight_version: str | None = None) -> str:
        """Phase two: every rank swaps its staged slices in; the prefix cache is flushed. Returns the
        `weight_version` now served: the given one, else the previous one unchanged (as SGLang; a
        trainer sending one update per bucket names the version on the last)."""
        self._land_all()
        self.executor.run_on_ranks("commit_weights")
        self._flush_cache()
        self.stats.weight_updates += 1
        if weight_version is not None:
            self.weight_version = str(weight_version)
        return self.weight_version

    def discard_weights(self) -> None:
        """Phase two of a refused update: every rank drops what it staged."""
        self.executor.run_on_ranks("discard_weights")

    def update_weights(self, source: WeightSource, weight_version: str | None = None) -> str:
        """Stage on every rank, then commit on every rank (or, refused, discard on every rank and raise
        WeightUpdateError: nothing changed). Returns the new `weight_version`."""
        self.stage_weights(source)
        return self.commit_weights(weight_version)
