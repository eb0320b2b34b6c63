"""EngineServer: one data-parallel replica owning an AsyncEngine (and, for tp > 1, its TP workers).

It speaks the internal protocol the ingress uses: requests are `schemas.EngineRequest` dicts, results
are *result dicts* (`OutputChunk.to_dict()` deltas, or the folded `Response.to_dict()`; the final one
carries the engine's `matched`), and refusals are error items `ApiError.to_item()` (plain data:
nothing to unpickle on the caller's side). Cancelling a stream (the caller stops iterating, a client
disconnects) aborts the request in the engine, which frees its KV pages. An unexpected exception
ends only its own request (an `internal_error` item before the first delta, a `finish_reason="error"`
delta after it), never the other requests of a batch.

Test hook (`debug_hooks=True` in the app args, off by default): `debug_stall(seconds)` makes the
engine loop sleep, as a hung forward would, so fault drills can watch the health check catch it.
It is a method of this deployment, reachable only through a Ray handle from inside the cluster:
the HTTP ingress has no route to it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from ray import serve

from configs import EngineConfig
from deployments.metrics import RequestMetrics
from deployments.schemas import ApiError, EngineRequest, request_error, validation_error
from engine.async_engine import AsyncEngine, EngineDeadError
from engine.carrier import OutputChunk, Response
from engine.requests import RequestError

log = logging.getLogger(__name__)


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not running under Serve (direct construction in tests)
        return "local"


@serve.deployment(max_ongoing_requests=512, health_check_period_s=5.0, health_check_timeout_s=30.0,
                  graceful_shutdown_timeout_s=5.0)
class EngineServer:
    def __init__(self, model: str, engine: dict[str, Any] | None = None, tp_timeout_s: float = 60.0,
                 stall_timeout_s: float = 60.0, tp_worker_options: dict[str, Any] | None = None,
                 debug_hooks: bool = False, hold_timeout_s: float | None = None):
        config = EngineConfig(**(engine or {}))
        factory = None
        if config.tp > 1:
            from deployments.tp_executor import RayTPExecutor

            factory = functools.partial(RayTPExecutor, timeout_s=tp_timeout_s,
                                        worker_options=tp_worker_options or None)
        self.engine = AsyncEngine(model, config, factory, stall_timeout_s=stall_timeout_s,
                                  hold_timeout_s=hold_timeout_s)
        self.replica = _replica_id()
        self.debug_hooks = debug_hooks
        self.metrics = RequestMetrics()
        log.info("EngineServer %s ready: %s (%s), tp=%d", self.replica, model, self.engine.spec.model_type,
                 config.tp)

    # ---- generation ------------------------------------------------------------------------
    async def _run(self, request: dict[str, Any]) -> AsyncIterator[tuple[OutputChunk, Response] | dict]:
        """Yield (chunk, folded-so-far) per delta, or one error item."""
        try:
            req = EngineRequest.model_validate(request)
            params = req.generation_config()
        except ValidationError as e:
            yield validation_error(e).to_item()
            return
        acc = Response()
        timer = self.metrics.timer()
        stream = self.engine.generate(req.prompt, params, req.request_id)
        started = False
        try:
            async for chunk in stream:
                started = True
                timer.chunk(chunk.token_ids, chunk.step_map, chunk.finished)
                acc.add(chunk)
                yield chunk, acc
        except RequestError as e:  # raised before the first chunk
            yield request_error(e.message, e.param, req.rename).to_item()
        except ValidationError as e:
            yield validation_error(e, req.rename).to_item()
        except EngineDeadError as e:
            yield ApiError(str(e), None, 503, "engine_unavailable").to_item()
        except Exception as e:  # noqa: BLE001 - a bug: fail this request only, never its batch mates
            log.exception("request %s failed", req.request_id)
            message = f"internal error: {type(e).__name__}: {e}"
            if not started:
                yield ApiError(message, None, 500, "internal_error").to_item()
            else:
                chunk = OutputChunk(request_id=req.request_id, finish_reason="error", error=message,
                                    input_token_len=acc.input_token_len, generate_token_len=acc.generate_token_len)
                acc.add(chunk)
                yield chunk, acc
        finally:
            await stream.aclose()

    async def generate_stream(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream result dicts (deltas), or one error item."""
        async for item in self._run(request):
            if isinstance(item, dict):
                yield item
                return
            yield item[0].to_dict()

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """The folded result dict of one request, or an error item."""
        result: dict[str, Any] | None = None
        async for item in self._run(request):
            if isinstance(item, dict):
                return item
            _, acc = item
            if acc.finish_reason is not None:
                result = acc.to_dict()
        return result or ApiError("the engine ended the request without a result", None, 500,
                                  "internal_error").to_item()

    async def generate_batch(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Run a batch of unary requests concurrently (they share engine steps)."""
        return list(await asyncio.gather(*(self.generate(r) for r in requests)))

    # ---- observability ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        cfg = self.engine.config
        executor = self.engine.engine.executor
        info = executor.describe() if hasattr(executor, "describe") else {"executor": "local"}
        return self.engine.stats() | info | {"replica": self.replica, "model_type": self.engine.spec.model_type,
                                             "tp": cfg.tp, "max_model_len": cfg.max_model_len}

    def metric_families(self) -> dict[str, Any]:
        """This replica's request histograms (prometheus_client families) for the ingress's /metrics."""
        return {"replica": self.replica, "families": self.metrics.families()}

    def check_health(self) -> None:
        """Serve's health check: raises when the engine loop is dead or stalled (Serve then replaces
        this replica). A stall also ends the requests in flight with an error at once."""
        self.engine.check_health()

    # ---- test hooks (debug_hooks=True only; Ray handle only, no HTTP route) ---------------------
    async def debug_stall(self, seconds: float) -> bool:
        """Make the engine loop sleep `seconds` (a hung forward, as far as anyone can tell)."""
        if not self.debug_hooks:
            raise PermissionError("debug hooks are off: deploy with debug_hooks=True to use debug_stall")
        log.warning("debug_stall: the engine loop sleeps %.1fs", seconds)
        self._stall = asyncio.ensure_future(self.engine.run(lambda _: time.sleep(seconds)))
        return True

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown
                log.exception("engine shutdown failed")
