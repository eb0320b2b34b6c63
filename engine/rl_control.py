"""RL control: the operations a trainer runs between rollouts, one method per SGLang route.

`RLControl` is held by AsyncEngine (engine.async_engine), which offers its operations as its own
methods. Each operation runs on the engine's loop thread between two steps, on every tensor-parallel
rank or none, and answers a `ControlResult` (engine.answers; a refusal raises, and the servers turn it
into `{"success": false}` and a 4xx). Weight updates are two-phase (stage everywhere, then commit or
discard everywhere), so a deployment can update all of its replicas or none (`stage_weights` /
`commit_weights` / `discard_weights`); pausing and releasing memory stop the step loop until undone:
whether the loop steps (`serving`) is this object's to say.

As in SGLang: an update (one-shot, or the commit of a staged one) made while requests generate waits
for them to finish on the old weights and holds new requests until it is done, unless
`abort_all_requests` ends the requests in flight first; staging overlaps generation. An update
that names no `weight_version` leaves it as it was.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from engine.answers import ControlResult, ExecutorFacts
from engine.errors import WeightUpdateError
from engine.worker.runner import MEMORY_TAGS, resolve_device
from engine.worker.update_group import GROUP_JOIN_TIMEOUT_S
from engine.worker.weight_sources import WeightSource, broadcast_source, disk_source, tensor_source

if TYPE_CHECKING:
    from engine.core.llm_engine import LLMEngine

# How the loop treats a command (engine.async_engine): `admit` a new request (held while an update
# waits), `update` (waits for the requests in flight), `aborting_update` (ends them first), `op` (at once)
CommandKind = Literal["op", "admit", "update", "aborting_update"]
# Queue `fn` on the engine's loop thread as a command of that kind; its future answers what `fn` returns
Submit = Callable[[Callable[[], Any], CommandKind], concurrent.futures.Future]

PAUSE_MODES = ("abort", "retract", "in_place")
# SGLang's memory tags. The runner's captured CUDA graphs (engine.worker.cuda_graphs, on by default on CUDA)
# hold no memory of their own to free by tag: every release drops them, and steps capture them again. A runner
# without graphs (CPU, `cuda_graphs` off) has none to drop, and the answer's message says so.
SGLANG_MEMORY_TAGS = (*MEMORY_TAGS, "cuda_graph")


class RLControl:
    """The trainer-facing operations of one engine, and the state they leave it in (paused, memory
    released, weights staged). It runs them through the engine's loop (`submit`); `abort_everything`
    ends every request in flight (a pause in `abort` mode), and `on_serving` is called when the engine
    serves again after a continue or a resume (the requests held meanwhile wait no longer)."""

    def __init__(self, engine: LLMEngine, submit: Submit, abort_everything: Callable[[], int],
                 on_serving: Callable[[], None]):
        self.engine = engine
        self._submit = submit
        self._abort_everything = abort_everything
        self._on_serving = on_serving
        self.paused: str | None = None  # the pause mode while paused
        self.released: set[str] = set()  # memory tags released
        self.since: float | None = None  # when the operation in progress started (None: none runs)
        self._staged: str | None = None  # the token of the weights staged by stage_weights, not yet committed

    @property
    def serving(self) -> bool:
        """Whether the engine steps: not paused, nothing released."""
        return self.paused is None and not self.released

    @property
    def state(self) -> str:
        return "released" if self.released else "paused" if self.paused else "serving"

    async def _control(self, fn: Callable[[], ControlResult], kind: CommandKind = "op") -> ControlResult:
        """Run a control operation on the loop thread, between two steps (an update once no request
        is in flight; see engine.async_engine)."""
        def run() -> ControlResult:
            self.since = time.monotonic()
            try:
                return fn()
            finally:
                self.since = None

        return await asyncio.wrap_future(self._submit(run, kind))

    async def _update(self, fn: Callable[[], ControlResult], abort_all_requests: bool) -> ControlResult:
        return await self._control(fn, "aborting_update" if abort_all_requests else "update")

    def _resumed(self) -> None:
        if self.serving:
            self._on_serving()

    def _check_weights_live(self) -> None:
        if "weights" in self.released:
            raise WeightUpdateError("the weights are released: resume_memory_occupation(['weights']) first")

    def _drop_staged(self) -> None:
        if self._staged is not None:
            self._staged = None
            self.engine.discard_weights()

    @staticmethod
    def _weights_updated(version: str) -> ControlResult:
        return ControlResult(f"weights updated to version {version!r}", weight_version=version)

    def _updated(self, source: WeightSource, weight_version: str | None) -> ControlResult:
        self._check_weights_live()
        self._drop_staged()
        return self._weights_updated(self.engine.update_weights(source, weight_version))

    # Two-phase across engines (the replicas of a deployment): stage everywhere, then commit
    # everywhere or discard everywhere. Generation goes on while weights are staged.
    async def stage_weights(self, source: WeightSource) -> str:
        """Check and stage `source` on every rank without serving it; returns the token that
        `commit_weights` / `discard_weights` take. Raises WeightUpdateError (nothing staged) when
        refused. Staging again drops what an earlier stage left uncommitted."""
        token = uuid.uuid4().hex

        def stage() -> ControlResult:
            self._check_weights_live()
            self._drop_staged()
            self.engine.stage_weights(source)
            self._staged = token
            return ControlResult("weights staged")

        await self._control(stage)
        return token

    async def commit_weights(self, token: str, weight_version: str | None = None,
                             abort_all_requests: bool = False) -> ControlResult:
        """Serve the weights staged under `token` once the requests in flight finished (or, with
        `abort_all_requests`, ended now); requests arriving meanwhile wait for it. The prefix cache
        is flushed."""
        def commit() -> ControlResult:
            if token != self._staged:
                raise WeightUpdateError(f"no weights staged under token {token!r} (staged: {self._staged!r})")
            self._check_weights_live()
            self._staged = None
            return self._weights_updated(self.engine.commit_weights(weight_version))

        return await self._update(commit, abort_all_requests)

    async def discard_weights(self, token: str) -> ControlResult:
        """Drop the weights staged under `token` (a no-op when they are already gone)."""
        def discard() -> ControlResult:
            dropped = token == self._staged
            if dropped:
                self._drop_staged()
            return ControlResult("staged weights discarded" if dropped else "nothing staged under this token")

        return await self._control(discard)

    # One-shot updates: every one waits for the requests in flight (or ends them first with
    # `abort_all_requests`), holds new ones until done, and keeps `weight_version` when given none.
    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       abort_all_requests: bool = False,
                                       load_format: str | None = None) -> ControlResult:
        """Load every tensor of a checkpoint directory of the same architecture. Raises
        WeightUpdateError (nothing changed) naming the config field or tensor that does not fit, or
        a `load_format` other than None, "auto" or "safetensors"."""
        source = disk_source(model_path, load_format)
        return await self._update(lambda: self._updated(source, weight_version), abort_all_requests)

    async def update_weights_from_tensor(self, named_tensors: Any, weight_version: str | None = None,
                                         load_format: str | None = None,
                                         abort_all_requests: bool = False) -> ControlResult:
        """Full tensors by checkpoint name ((name, tensor) pairs), or SGLang's `flattened_bucket`
        payload with `load_format="flattened_bucket"`; any subset of the model's tensors."""
        source = tensor_source(named_tensors, load_format)
        return await self._update(lambda: self._updated(source, weight_version), abort_all_requests)

    async def init_weights_update_group(self, master_address: str, master_port: int | str, rank_offset: int | str,
                                        world_size: int | str, group_name: str, backend: str = "gloo",
                                        timeout_s: float = GROUP_JOIN_TIMEOUT_S) -> ControlResult:
        """Every rank joins the trainer's group (the trainer is rank 0) as `rank_offset` + its
        tensor-parallel rank; returns once the whole group has met. A group that has not met within
        `timeout_s` raises WeightUpdateError naming who did not join (nothing is left joined)."""
        def join() -> ControlResult:
            self.engine.init_update_group(master_address, int(master_port), int(rank_offset), int(world_size),
                                          group_name, backend, float(timeout_s))
            return ControlResult(f"joined weight update group {group_name!r}")

        return await self._control(join)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list,
                                              group_name: str, weight_version: str | None = None,
                                              load_format: str | None = None,
                                              abort_all_requests: bool = False) -> ControlResult:
        """Receive the tensors the trainer (rank 0 of `group_name`) broadcasts: one per name in
        `names` order, or with `load_format="flattened_bucket"` one broadcast of SGLang's flattened
        bucket (every tensor's bytes in `names` order). Every byte is received even when the update
        is refused; an unknown `load_format` is refused before anything is received."""
        source = broadcast_source(names, dtypes, shapes, group_name, load_format)
        return await self._update(lambda: self._updated(source, weight_version), abort_all_requests)

    async def destroy_weights_update_group(self, group_name: str) -> ControlResult:
        def destroy() -> ControlResult:
            self.engine.destroy_update_group(group_name)
            return ControlResult(f"left weight update group {group_name!r}")

        return await self._control(destroy)

    async def flush_cache(self) -> ControlResult:
        """Drop the prefix cache. Always allowed: requests in flight keep their own pages and never
        publish them (unlike SGLang, which refuses while requests run)."""
        def flush() -> ControlResult:
            self.engine.flush_cache()
            return ControlResult("prefix cache flushed")

        return await self._control(flush)

    async def pause_generation(self, mode: str = "abort") -> ControlResult:
        """Stop stepping. `abort`: every request in the engine ends now (finish_reason "abort", with
        its partial output). `retract`: running requests give back their KV pages and wait, keeping
        their tokens (recomputed on continue). `in_place`: everything stays as it is. `requests`
        in the answer counts the requests the pause touched: those ended, retracted, or (in place)
        every request the engine holds, running or waiting."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode={mode!r}: pause_generation takes one of {', '.join(PAUSE_MODES)}")

        def pause() -> ControlResult:
            if mode == "abort":
                affected = self._abort_everything()
            elif mode == "retract":
                affected = self.engine.retract_all()
            else:
                affected = len(self.engine.seqs)
            self.paused = mode
            return ControlResult(f"generation paused ({mode})", requests=affected)

        return await self._control(pause)

    async def continue_generation(self) -> ControlResult:
        def resume() -> ControlResult:
            self.paused = None
            self._resumed()
            return ControlResult("generation continues" if self.serving else
                                 f"unpaused; memory still released: {sorted(self.released)}")

        return await self._control(resume)

    @staticmethod
    def _tags(tags: list[str] | None) -> tuple[list[str], bool]:
        """SGLang's tags (None or [] = all) -> (the tags this engine frees, whether `cuda_graph` is named)."""
        named = list(tags) if tags else list(SGLANG_MEMORY_TAGS)
        unknown = [t for t in named if t not in SGLANG_MEMORY_TAGS]
        if unknown:
            raise ValueError(f"memory tags {unknown}: known tags are {', '.join(SGLANG_MEMORY_TAGS)}")
        return [t for t in MEMORY_TAGS if t in named], "cuda_graph" in named

    def _no_graphs(self) -> str | None:
        """Why this engine's runners hold no captured CUDA graphs; None when they hold them. From what the
        executor reports of its runners (`cuda_graphs` in `describe()`), else from the engine's device and
        `cuda_graphs` setting (where graphs can run at all)."""
        graphs = ExecutorFacts.of(self.engine.executor.describe()).cuda_graphs
        if graphs is not None:
            return None if graphs.state == "on" else graphs.why or "they are off"
        device = resolve_device(self.engine.config).type
        if device != "cuda":
            return f"the device is {device}, not CUDA"
        return None if self.engine.config.cuda_graphs else "cuda_graphs is false"

    def _graphs_note(self, op: Literal["release", "resume"]) -> str:
        """The message's note on the `cuda_graph` tag, true of this engine: graphs it holds are dropped by
        every release and captured again when steps run; an engine without any has nothing to do."""
        why = self._no_graphs()
        if why is None:
            return "; cuda_graph: captured CUDA graphs dropped (as by every release; captured again when steps run)"
        return f"; cuda_graph: nothing to {op} (no CUDA graphs: {why})"

    async def release_memory_occupation(self, tags: list[str] | None = None) -> ControlResult:
        """Free the weights and/or the KV cache on every rank (SGLang's tags; None or [] = all);
        generation stops until both are back. Releasing the KV cache retracts the running requests
        and flushes the prefix cache."""
        tags, graphs = self._tags(tags)

        def release() -> ControlResult:
            todo = [t for t in tags if t not in self.released]
            note = self._graphs_note("release") if graphs else ""
            self.engine.release_memory(todo)
            self.released |= set(todo)
            return ControlResult(f"released {todo}{note}", released=sorted(self.released))

        return await self._control(release)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> ControlResult:
        """Restore what `release_memory_occupation` freed (SGLang's tags; None or [] = all): the
        weights exactly as they were."""
        tags, graphs = self._tags(tags)

        def resume() -> ControlResult:
            todo = [t for t in tags if t in self.released]
            note = self._graphs_note("resume") if graphs else ""
            self.engine.resume_memory(todo)
            self.released -= set(todo)
            self._resumed()
            return ControlResult(f"resumed {todo}{note}", released=sorted(self.released))

        return await self._control(resume)
