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
SGLang route, each run on the loop thread between two steps, every rank or none). They are the
operations of the `RLControl` the engine holds (`control`, engine.rl_control), offered as the
engine's own methods. The loop steps only while *serving*: not paused and nothing released.
Requests that arrive otherwise are queued and wait; with `hold_timeout_s` set, one that has waited
that long without being served ends with `EngineHeldError` (the server answers 503 with
Retry-After). A control operation may run far longer than a forward (a broadcast waits for the
trainer): the stall check gives it `WEIGHT_OP_TIMEOUT_S`.

A weight update that arrives while requests are generating (not paused) waits, as in SGLang: the
requests in flight finish on the old weights, requests that arrive meanwhile are held, and the update
runs once nothing is in flight, before the held requests start. No request is ever generated partly
by two weight versions. Commands are tagged for this: `admit` (a new request: held while an update
waits), `update` (waits for the requests in flight), `aborting_update` (an update with
`abort_all_requests`: ends every request in flight first, then runs) and `op` (everything else: runs
at once).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from configs import EngineConfig, GenerationConfig
from engine.answers import ControlResult, EngineSnapshot
from engine.carrier import OutputChunk
from engine.core.llm_engine import LLMEngine
from engine.delegation import Delegated
from engine.errors import EngineDeadError, EngineHeldError
from engine.executor.base import ExecutorFactory
from engine.rl_control import CommandKind, RLControl
from engine.worker.update_group import WEIGHT_OP_TIMEOUT_S

log = logging.getLogger(__name__)

_Command = tuple[Callable[[], Any], concurrent.futures.Future]


class AsyncEngine:
    # The trainer's operations (engine.rl_control), offered as the engine's own methods
    update_weights_from_disk = Delegated("control")
    update_weights_from_tensor = Delegated("control")
    init_weights_update_group = Delegated("control")
    update_weights_from_distributed = Delegated("control")
    destroy_weights_update_group = Delegated("control")
    flush_cache = Delegated("control")
    pause_generation = Delegated("control")
    continue_generation = Delegated("control")
    release_memory_occupation = Delegated("control")
    resume_memory_occupation = Delegated("control")
    stage_weights = Delegated("control")
    commit_weights = Delegated("control")
    discard_weights = Delegated("control")

    def __init__(self, model_path: str, config: EngineConfig | None = None,
                 executor_factory: ExecutorFactory | None = None, stall_timeout_s: float = 60.0,
                 hold_timeout_s: float | None = None):
        self.engine = LLMEngine(model_path, config, executor_factory)
        self.stall_timeout_s = stall_timeout_s
        self.hold_timeout_s = hold_timeout_s
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future, CommandKind]] = queue.Queue()
        self._waiting_updates: list[_Command] = []  # updates waiting for the requests in flight to finish
        self._held_admissions: list[_Command] = []  # new requests held until those updates are done
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._running = True
        self._heartbeat = time.monotonic()
        self._fatal: BaseException | None = None
        self._held: dict[str, float] = {}  # requests that arrived while not serving -> arrival time
        self.control = RLControl(self.engine, self._call, self._abort_everything, self._held.clear)
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

    @property
    def paradigm(self) -> str:
        """How the model decodes (a paradigm of configs.knobs)."""
        return self.engine.paradigm

    # ---- the loop thread --------------------------------------------------------------------
    def _call(self, fn: Callable[[], Any], kind: CommandKind = "op") -> concurrent.futures.Future:
        if not self._running or not self._thread.is_alive():
            raise EngineDeadError(f"the engine loop is not running: {self._fatal!r}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut, kind))
        if not self._running:  # the loop died while we queued: nobody else will answer it
            self._fail_pending()
        return fut

    def _fail_pending(self) -> None:
        """Answer every queued, waiting or held command with EngineDeadError (the loop is gone)."""
        futures = [fut for _, fut in self._waiting_updates + self._held_admissions]
        self._waiting_updates, self._held_admissions = [], []
        while True:
            try:
                futures.append(self._commands.get_nowait()[1])
            except queue.Empty:
                break
        for fut in futures:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError(f"the engine loop is not running: {self._fatal!r}"))

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, fut, kind = command
            if kind == "aborting_update":
                self._abort_everything()
            if kind in ("update", "aborting_update") and (self._waiting_updates or self._busy()):
                self._waiting_updates.append((fn, fut))  # runs once the requests in flight finished
            elif kind == "admit" and self._waiting_updates:
                self._held_admissions.append((fn, fut))  # starts after the waiting updates
            else:
                self._execute(fn, fut)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _execute(self, fn: Callable[[], Any], fut: concurrent.futures.Future) -> None:
        if fut.set_running_or_notify_cancel():  # False: the caller was cancelled first; skip it
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
        self._deliver(self.engine.take_ready())  # forwards in flight the command applied (overlap schedule)

    def _run_waiting_updates(self) -> None:
        """Once no request is in flight (or generation stopped), run the updates that waited, in
        order, then admit the requests held meanwhile."""
        if not self._waiting_updates or self._busy():
            return
        updates, self._waiting_updates = self._waiting_updates, []
        for fn, fut in updates:
            self._execute(fn, fut)
        self._admit_held()

    def _admit_held(self) -> None:
        held, self._held_admissions = self._held_admissions, []
        for fn, fut in held:
            self._execute(fn, fut)

    @property
    def serving(self) -> bool:
        return self.control.serving

    @property
    def state(self) -> str:
        return self.control.state

    def _busy(self) -> bool:
        return self.serving and self.engine.has_unfinished()

    def _loop(self) -> None:
        try:
            while self._running:
                self._heartbeat = time.monotonic()
                self._run_commands(block=not self._busy() and not self._waiting_updates)
                self._run_waiting_updates()
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
                self._deliver(chunks)
        except BaseException as e:  # noqa: BLE001 - recorded for the health check
            self._fatal = e
            log.exception("engine loop died")
        finally:
            self._running = False
            self._end_everything()

    def _end_everything(self) -> None:
        """Fail queued commands and end every open stream with an error (the loop is gone)."""
        self._fail_pending()
        self._deliver([OutputChunk(request_id=rid, finish_reason="error", error=f"engine loop stopped: {self._fatal!r}")
                       for rid in list(self._streams)])

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

    def _deliver(self, chunks: list[OutputChunk]) -> None:
        """Hand a step's chunks to their callers: one wake-up of each caller's event loop per step (a
        thread-safe call writes to the loop's wake-up pipe), which then puts each chunk into its queue."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, OutputChunk]]] = {}
        for chunk in chunks:
            target = self._streams.get(chunk.request_id)
            if target is None:
                continue
            if chunk.finished:
                self._streams.pop(chunk.request_id, None)
                self._held.pop(chunk.request_id, None)
            by_loop.setdefault(target[0], []).append((target[1], chunk))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_each, items)
            except RuntimeError:  # the caller's event loop is closed: nobody reads these streams any more
                for _, chunk in items:
                    self._streams.pop(chunk.request_id, None)
                    if not chunk.finished and self._running:
                        self.engine.abort(chunk.request_id)

    # ---- the caller's side ------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: GenerationConfig | None = None,
                       request_id: str | None = None, streamed: bool = True, batch_interval_s: float = 0.0
                       ) -> AsyncIterator[OutputChunk]:
        """Stream a request's chunks. Raises RequestError (ValueError) before the first chunk, and
        EngineHeldError when it waited `hold_timeout_s` while the engine was not serving. `streamed=False`
        (a caller that folds the chunks into one result): the chunk of its first tokens, then the last.
        `batch_interval_s` > 0: a chunk that comes sooner than that after the caller took the previous
        delta waits out the rest of the interval, and goes with the chunks that came meanwhile as one
        delta (their fold); the first chunk never waits."""
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def add() -> str:
            rid = self.engine.add_request(prompt, params, request_id, streamed)
            self._streams[rid] = (loop, q)
            if not self.serving:
                self._held[rid] = time.monotonic()
            return rid

        added = self._call(add, "admit")
        try:
            rid = await asyncio.wrap_future(added)
        except asyncio.CancelledError:  # cancelled while the add was in flight: abort it if it ran
            added.add_done_callback(lambda f: f.cancelled() or f.exception() or self.abort(f.result()))
            raise
        finished, sent_at = False, None  # when the previous delta went out (loop time)
        try:
            while True:
                chunk = await q.get()
                if isinstance(chunk, EngineHeldError):  # only ever a stream's first item
                    finished = True  # the loop already took it out of the engine
                    raise chunk
                if batch_interval_s and sent_at is not None and not chunk.finished:
                    wait = sent_at + batch_interval_s - loop.time()
                    if wait > 0:  # sooner than the interval after the previous delta: gather what comes
                        await asyncio.sleep(wait)
                    while not chunk.finished and not q.empty():
                        chunk = chunk.absorb(q.get_nowait())
                finished = chunk.finished
                yield chunk
                sent_at = loop.time()
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def _abort_everything(self) -> int:
        """End every request now with finish_reason "abort" and its partial output, the ones held for
        a waiting update included (admitted, then ended). Returns how many ended."""
        self._admit_held()
        chunks = [chunk for rid in list(self.engine.seqs) if (chunk := self.engine.abort(rid)) is not None]
        self._deliver(chunks)
        return len(chunks)

    async def abort_all(self) -> ControlResult:
        """End every request in flight now (finish_reason "abort", with its partial output), as
        SGLang's `/abort_request {"abort_all": true}`."""
        aborted = await asyncio.wrap_future(self._call(self._abort_everything))
        return ControlResult(f"aborted {aborted} requests", requests=aborted)

    def abort(self, request_id: str) -> None:
        def do_abort() -> None:
            chunk = self.engine.abort(request_id)
            if chunk is not None:
                self._deliver([chunk])

        if self._running:
            self._call(do_abort)

    async def run(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the loop thread (for stats that must be read consistently)."""
        return await asyncio.wrap_future(self._call(lambda: fn(self.engine)))

    def stats(self) -> EngineSnapshot:
        e, s = self.engine, self.engine.stats
        return EngineSnapshot(e.load(), s.steps, s.forwards, s.prompt_tokens, s.generated_tokens,
                              s.unmasking_steps, s.forward_seconds, s.step_seconds, self.state, e.weight_version)

    def check_health(self) -> None:
        """Raise if the loop died or has been stuck for stall_timeout_s. A stuck loop is declared
        dead here: new requests are refused and the ones in flight end with an error now."""
        if not self._thread.is_alive() or not self._running:
            raise EngineDeadError(f"the engine loop is not running: {self._fatal!r}")
        stuck = time.monotonic() - self._heartbeat
        allowed = self.stall_timeout_s + (WEIGHT_OP_TIMEOUT_S if self.control.since is not None else 0.0)
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
        self.engine.shutdown()


def _put_each(items: list[tuple[asyncio.Queue, OutputChunk]]) -> None:
    """On a caller's event loop: each chunk into its request's queue."""
    for q, chunk in items:
        q.put_nowait(chunk)
