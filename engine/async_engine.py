"""AsyncEngine: the step loop on a background thread, requests as asyncio streams of OutputChunks.

Only the loop thread touches the LLMEngine. Callers send commands (add, abort) through a queue and
receive chunks on a per-request asyncio.Queue of their own event loop. A caller that stops
iterating (client disconnect, cancellation) aborts its request, which frees its KV pages.

The loop beats a heartbeat on every iteration (at least every 0.5 s when idle). `check_health`
declares the engine dead when the loop died, or when the heartbeat is older than `stall_timeout_s`
(a hung forward or command): the requests in flight then end with `finish_reason="error"` at once,
from the caller's thread, instead of waiting on a loop that may never come back.

RL control: between rollouts a trainer pauses generation, pushes new weights, frees and restores
memory (`pause_generation`, `update_weights_from_*`, `release_memory_occupation`, ... one method per
SGLang route, each run on the loop thread between two steps, every rank or none). The loop steps only
while *serving*: not paused and nothing released. Requests that arrive otherwise are queued and wait;
with `hold_timeout_s` set, one that has waited that long without being served ends with
`EngineHeldError` (the server answers 503 with Retry-After). A control operation may run far longer
than a forward (a broadcast waits for the trainer): the stall check gives it `WEIGHT_OP_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from configs import EngineConfig, GenerationConfig
from engine.carrier import OutputChunk
from engine.engine import LLMEngine
from engine.runner import MEMORY_TAGS
from engine.weight_sync import (
    WEIGHT_OP_TIMEOUT_S,
    DiskWeights,
    WeightSource,
    WeightUpdateError,
    broadcast_source,
    commit_update,
    discard_update,
    stage_update,
    tensor_source,
    update_weights,
)

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


class EngineDeadError(RuntimeError):
    """The step loop is not running; the replica needs a restart."""


class EngineHeldError(RuntimeError):
    """A request waited `hold_timeout_s` while generation was paused or memory released; retry later."""

    def __init__(self, state: str, waited_s: float, retry_after_s: float):
        super().__init__(f"the engine is {state}: the request waited {waited_s:.1f}s without being served; "
                         f"retry in {retry_after_s:.0f}s")
        self.state, self.waited_s, self.retry_after_s = state, waited_s, retry_after_s


class AsyncEngine:
    def __init__(self, model_path: str, config: EngineConfig | None = None, executor_factory=None,
                 stall_timeout_s: float = 60.0, hold_timeout_s: float | None = None):
        self.engine = LLMEngine(model_path, config, executor_factory)
        self.stall_timeout_s = stall_timeout_s
        self.hold_timeout_s = hold_timeout_s
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._running = True
        self._heartbeat = time.monotonic()
        self._fatal: BaseException | None = None
        self._paused: str | None = None  # the pause mode while paused
        self._released: set[str] = set()  # memory tags released
        self._held: dict[str, float] = {}  # requests that arrived while not serving -> arrival time
        self._control_since: float | None = None  # when the control operation in progress started
        self._staged: str | None = None  # the token of the weights staged by stage_weights, not yet committed
        self._thread = threading.Thread(target=self._loop, name="blockserve-engine", daemon=True)
        self._thread.start()

    # ---- properties the deployments read ----------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def spec(self):
        return self.engine.spec

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def is_dllm(self) -> bool:
        return self.engine.is_dllm

    # ---- the loop thread --------------------------------------------------------------------
    def _call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        if not self._running or not self._thread.is_alive():
            raise EngineDeadError(f"the engine loop is not running: {self._fatal!r}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut))
        if not self._running:  # the loop died while we queued: nobody else will answer it
            self._fail_pending()
        return fut

    def _fail_pending(self) -> None:
        """Answer every queued command with EngineDeadError (the loop is gone)."""
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError(f"the engine loop is not running: {self._fatal!r}"))

    def _run_commands(self, block: bool) -> None:
        try:
            fn, fut = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if fut.set_running_or_notify_cancel():  # False: the caller was cancelled first; skip it
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return

    @property
    def serving(self) -> bool:
        return self._paused is None and not self._released

    @property
    def state(self) -> str:
        return "released" if self._released else "paused" if self._paused else "serving"

    def _busy(self) -> bool:
        return self.serving and self.engine.has_unfinished()

    def _loop(self) -> None:
        try:
            while self._running:
                self._heartbeat = time.monotonic()
                self._run_commands(block=not self._busy())
                if not self.serving:
                    self._refuse_held()
                if not self._running or not self._busy():
                    continue
                try:
                    chunks = self.engine.step()
                except Exception as e:  # a failed forward ends what was in it, not the replica
                    log.exception("engine step failed")
                    chunks = [c for rid in list(self.engine.seqs)
                              if (c := self.engine.fail(rid, f"engine step failed: {e}")) is not None]
                    if getattr(e, "fatal", False):
                        raise
                self._heartbeat = time.monotonic()
                for chunk in chunks:
                    self._deliver(chunk)
        except BaseException as e:  # noqa: BLE001 - recorded for the health check
            self._fatal = e
            log.exception("engine loop died")
        finally:
            self._running = False
            self._end_everything()

    def _end_everything(self) -> None:
        """Fail queued commands and end every open stream with an error (the loop is gone)."""
        self._fail_pending()
        for rid in list(self._streams):
            self._deliver(OutputChunk(request_id=rid, finish_reason="error",
                                      error=f"engine loop stopped: {self._fatal!r}"))

    def _refuse_held(self) -> None:
        """End the requests that have waited `hold_timeout_s` for generation to resume."""
        if self.hold_timeout_s is None:
            return
        now = time.monotonic()
        for rid, since in list(self._held.items()):
            if now - since >= self.hold_timeout_s:
                del self._held[rid]
                self.engine.abort(rid)
                target = self._streams.pop(rid, None)
                if target is not None:
                    error = EngineHeldError(self.state, now - since, retry_after_s=self.hold_timeout_s)
                    target[0].call_soon_threadsafe(target[1].put_nowait, error)

    def _deliver(self, chunk: OutputChunk) -> None:
        target = self._streams.get(chunk.request_id)
        if target is None:
            return
        if chunk.finished:
            self._streams.pop(chunk.request_id, None)
            self._held.pop(chunk.request_id, None)
        loop, q = target
        try:
            loop.call_soon_threadsafe(q.put_nowait, chunk)
        except RuntimeError:  # the caller's event loop is closed: nobody reads this stream any more
            self._streams.pop(chunk.request_id, None)
            if not chunk.finished and self._running:
                self.engine.abort(chunk.request_id)

    # ---- the caller's side ------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: GenerationConfig | None = None,
                       request_id: str | None = None) -> AsyncIterator[OutputChunk]:
        """Stream a request's chunks. Raises RequestError (ValueError) before the first chunk, and
        EngineHeldError when it waited `hold_timeout_s` while the engine was not serving."""
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def add() -> str:
            rid = self.engine.add_request(prompt, params, request_id)
            self._streams[rid] = (loop, q)
            if not self.serving:
                self._held[rid] = time.monotonic()
            return rid

        added = self._call(add)
        try:
            rid = await asyncio.wrap_future(added)
        except asyncio.CancelledError:  # cancelled while the add was in flight: abort it if it ran
            added.add_done_callback(lambda f: f.cancelled() or f.exception() or self.abort(f.result()))
            raise
        finished = False
        try:
            while True:
                chunk = await q.get()
                if isinstance(chunk, EngineHeldError):
                    finished = True  # the loop already took it out of the engine
                    raise chunk
                finished = chunk.finished
                yield chunk
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        def do_abort() -> None:
            chunk = self.engine.abort(request_id)
            if chunk is not None:
                self._deliver(chunk)

        if self._running:
            self._call(do_abort)

    async def run(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the loop thread (for stats that must be read consistently)."""
        return await asyncio.wrap_future(self._call(lambda: fn(self.engine)))

    # ---- RL control: one method per SGLang route, each answering {"success": True, ...} --------
    async def _control(self, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run a control operation on the loop thread, between two steps."""
        def run() -> dict[str, Any]:
            self._control_since = time.monotonic()
            try:
                return {"success": True, **fn()}
            finally:
                self._control_since = None

        return await asyncio.wrap_future(self._call(run))

    def _check_weights_live(self) -> None:
        if "weights" in self._released:
            raise WeightUpdateError("the weights are released: resume_memory_occupation(['weights']) first")

    def _drop_staged(self) -> None:
        if self._staged is not None:
            self._staged = None
            discard_update(self.engine)

    def _updated(self, source: WeightSource, weight_version: str | None) -> dict[str, Any]:
        self._check_weights_live()
        self._drop_staged()
        version = update_weights(self.engine, source, weight_version)
        return {"message": f"weights updated to version {version!r}", "weight_version": version}

    # Two-phase across engines (the replicas of a deployment): stage everywhere, then commit
    # everywhere or discard everywhere. Generation goes on while weights are staged.
    async def stage_weights(self, source: WeightSource) -> str:
        """Check and stage `source` on every rank without serving it; returns the token that
        `commit_weights` / `discard_weights` take. Raises WeightUpdateError (nothing staged) when
        refused. Staging again drops what an earlier stage left uncommitted."""
        def stage() -> dict[str, Any]:
            self._check_weights_live()
            self._drop_staged()
            stage_update(self.engine, source)
            self._staged = uuid.uuid4().hex
            return {"token": self._staged}

        return (await self._control(stage))["token"]

    async def commit_weights(self, token: str, weight_version: str | None = None) -> dict[str, Any]:
        """Serve the weights staged under `token` from the next step on (the prefix cache is flushed)."""
        def commit() -> dict[str, Any]:
            if token != self._staged:
                raise WeightUpdateError(f"no weights staged under token {token!r} (staged: {self._staged!r})")
            self._check_weights_live()
            self._staged = None
            version = commit_update(self.engine, weight_version)
            return {"message": f"weights updated to version {version!r}", "weight_version": version}

        return await self._control(commit)

    async def discard_weights(self, token: str) -> dict[str, Any]:
        """Drop the weights staged under `token` (a no-op when they are already gone)."""
        def discard() -> dict[str, Any]:
            dropped = token == self._staged
            if dropped:
                self._drop_staged()
            return {"message": "staged weights discarded" if dropped else "nothing staged under this token"}

        return await self._control(discard)

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> dict[str, Any]:
        """Load every tensor of a checkpoint directory of the same architecture. Raises
        WeightUpdateError (nothing changed) naming the config field or tensor that does not fit."""
        return await self._control(lambda: self._updated(DiskWeights(str(model_path)), weight_version))

    async def update_weights_from_tensor(self, named_tensors: Any, weight_version: str | None = None,
                                         load_format: str | None = None) -> dict[str, Any]:
        """Full tensors by checkpoint name ((name, tensor) pairs), or SGLang's `flattened_bucket`
        payload with `load_format="flattened_bucket"`; any subset of the model's tensors."""
        source = tensor_source(named_tensors, load_format)
        return await self._control(lambda: self._updated(source, weight_version))

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str = "gloo") -> dict[str, Any]:
        """Every rank joins the trainer's group (the trainer is rank 0) as `rank_offset` + its
        tensor-parallel rank; returns once the whole group has met."""
        def join() -> dict[str, Any]:
            self.engine.executor.run_on_ranks("init_update_group", master_address, int(master_port),
                                              int(rank_offset), int(world_size), group_name, backend,
                                              timeout_s=WEIGHT_OP_TIMEOUT_S)
            return {"message": f"joined weight update group {group_name!r}"}

        return await self._control(join)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list,
                                              group_name: str, weight_version: str | None = None) -> dict[str, Any]:
        """Receive one full tensor per name, broadcast in `names` order by the trainer (rank 0 of
        `group_name`); every tensor is received even when the update is refused."""
        source = broadcast_source(names, dtypes, shapes, group_name)
        return await self._control(lambda: self._updated(source, weight_version))

    async def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        def destroy() -> dict[str, Any]:
            self.engine.executor.run_on_ranks("destroy_update_group", group_name)
            return {"message": f"left weight update group {group_name!r}"}

        return await self._control(destroy)

    async def flush_cache(self) -> dict[str, Any]:
        """Drop the prefix cache. Always allowed: requests in flight keep their own pages and never
        publish them (unlike SGLang, which refuses while requests run)."""
        def flush() -> dict[str, Any]:
            self.engine.flush_cache()
            return {"message": "prefix cache flushed"}

        return await self._control(flush)

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """Stop stepping. `abort`: every request in the engine ends now (finish_reason "abort", with
        its partial output). `retract`: running requests give back their KV pages and wait, keeping
        their tokens (recomputed on continue). `in_place`: everything stays as it is."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode={mode!r}: pause_generation takes one of {', '.join(PAUSE_MODES)}")

        def pause() -> dict[str, Any]:
            affected = 0
            if mode == "abort":
                for rid in list(self.engine.seqs):
                    chunk = self.engine.abort(rid)
                    if chunk is not None:
                        self._deliver(chunk)
                        affected += 1
            elif mode == "retract":
                affected = self.engine.scheduler.retract_all()
            self._paused = mode
            return {"message": f"generation paused ({mode})", "requests": affected}

        return await self._control(pause)

    async def continue_generation(self) -> dict[str, Any]:
        def resume() -> dict[str, Any]:
            self._paused = None
            self._serve_held()
            return {"message": "generation continues" if self.serving else
                    f"unpaused; memory still released: {sorted(self._released)}"}

        return await self._control(resume)

    def _serve_held(self) -> None:
        if self.serving:
            self._held.clear()

    @staticmethod
    def _tags(tags: list[str] | None) -> list[str]:
        tags = list(MEMORY_TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise ValueError(f"memory tags {unknown}: known tags are {', '.join(MEMORY_TAGS)}")
        return tags

    async def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Free the weights and/or the KV cache on every rank; generation stops until both are back.
        Releasing the KV cache retracts the running requests and flushes the prefix cache."""
        tags = self._tags(tags)

        def release() -> dict[str, Any]:
            todo = [t for t in tags if t not in self._released]
            if "kv_cache" in todo:
                self.engine.scheduler.retract_all()
                self.engine.flush_cache()
            self.engine.executor.run_on_ranks("release_memory", todo)
            self._released |= set(todo)
            return {"message": f"released {todo}", "released": sorted(self._released)}

        return await self._control(release)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Restore what `release_memory_occupation` freed: the weights exactly as they were."""
        tags = self._tags(tags)

        def resume() -> dict[str, Any]:
            todo = [t for t in tags if t in self._released]
            self.engine.executor.run_on_ranks("resume_memory", todo, timeout_s=WEIGHT_OP_TIMEOUT_S)
            self._released -= set(todo)
            self._serve_held()
            return {"message": f"resumed {todo}", "released": sorted(self._released)}

        return await self._control(resume)

    def stats(self) -> dict[str, Any]:
        e = self.engine
        s = e.stats
        return {
            "running": len(e.scheduler.running),
            "waiting": len(e.scheduler.waiting),
            "kv_pages_total": e.kv.num_pages,
            "kv_pages_free": e.kv.num_free_pages,
            "steps": s.steps,
            "forwards": s.forwards,
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "unmasking_steps": s.unmasking_steps,
            "forward_seconds": s.forward_seconds,
            "step_seconds": s.step_seconds,
            "preemptions": e.scheduler.num_preemptions,
            "prefix_hit_tokens": e.kv.prefix_hit_tokens,
            "state": self.state,
            "weight_version": e.weight_version,
        }

    def check_health(self) -> None:
        """Raise if the loop died or has been stuck for stall_timeout_s. A stuck loop is declared
        dead here: new requests are refused and the ones in flight end with an error now."""
        if not self._thread.is_alive() or not self._running:
            raise EngineDeadError(f"the engine loop is not running: {self._fatal!r}")
        stuck = time.monotonic() - self._heartbeat
        allowed = self.stall_timeout_s + (WEIGHT_OP_TIMEOUT_S if self._control_since is not None else 0.0)
        if stuck > allowed:
            self._fatal = EngineDeadError(f"the engine loop has been stuck for {stuck:.1f}s "
                                          f"(stall_timeout_s={self.stall_timeout_s})")
            self._running = False
            log.error("%s", self._fatal)
            self._end_everything()
            raise self._fatal

    def shutdown(self) -> None:
        self._running = False
        self._thread.join(timeout=5)
        self.engine.executor.shutdown()
