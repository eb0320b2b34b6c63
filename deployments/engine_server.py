"""EngineServer: one data-parallel replica owning an AsyncEngine (and, for tp > 1, its TP workers).

It speaks the internal protocol the ingress uses (`deployments.wire`): requests are `EngineRequest`s,
results are the carrier's `OutputChunk` deltas (streamed) or the folded `Response` (unary; the final
one carries the engine's `matched`), and a refusal is a `Rejection` in their place. Cancelling a
stream (the caller stops iterating, a client disconnects) aborts the request in the engine, which
frees its KV pages. An unexpected exception ends only its own request (an `internal_error`
rejection before the first delta, a `finish_reason="error"` delta after it), never the other
requests of a batch.

RL control: the ingress broadcasts every control call to every replica. A weight update runs in two
phases across replicas (`stage_weights` everywhere, then `commit_weights` everywhere or
`discard_weights` everywhere), so a refusal on any replica leaves all of them on the old weights.
`init_weights_update_group` joins this replica's TP ranks at `rank_offset + rank * tp + tp_rank`,
`rank` being Serve's replica rank (0..replicas-1).

The hooks that make a replica fail on purpose (for fault drills and the soak) are not here: they
live in a subclass of this deployment, `deployments.drills`, which the production application never
builds.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import ray
from pydantic import ValidationError
from ray import serve

from configs import EngineConfig
from deployments.errors import ApiError, request_error, validation_error
from deployments.metrics import RequestMetrics
from deployments.rl.protocol import (
    CONTROL_OPS,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    WeightUpdate,
)
from deployments.single_machine import keep_replica_grpc_on_loopback
from deployments.wire import ControlAnswer, EngineRequest, MetricFamilies, ModelInfo, Rejection, ReplicaStats
from engine.answers import ControlResult
from engine.async_engine import AsyncEngine
from engine.carrier import OutputChunk, Response
from engine.errors import EngineDeadError, EngineHeldError, RequestError
from engine.heap import freeze_startup_heap
from engine.worker.update_group import WEIGHT_OP_TIMEOUT_S
from engine.worker.weight_sources import WeightSource, broadcast_source, disk_source, tensor_source

keep_replica_grpc_on_loopback()  # a replica on a loopback node listens on loopback only

log = logging.getLogger(__name__)


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not running under Serve (direct construction in tests)
        return "local"


def _replica_rank() -> int:
    """This replica's index among the deployment's replicas (Serve keeps ranks 0..n-1; 0 outside Serve)."""
    try:
        rank = serve.get_replica_context().rank
    except Exception:  # noqa: BLE001 - not running under Serve
        return 0
    return int(getattr(rank, "rank", rank))


def weight_source(update: WeightUpdate) -> WeightSource:
    """The engine's weight source for an update from its SGLang payload."""
    if isinstance(update, UpdateWeightsFromDiskRequest):
        return disk_source(update.model_path, update.load_format)
    if isinstance(update, UpdateWeightsFromTensorRequest):
        return tensor_source(update.named_tensors, update.load_format)
    if isinstance(update, UpdateWeightsFromDistributedRequest):
        return broadcast_source(update.names, update.dtypes, update.shapes, update.group_name, update.load_format)
    raise ValueError(f"not a weight update: {type(update).__name__}")


async def _fetched(update: WeightUpdate) -> WeightUpdate:
    """The update with its `named_tensors` fetched when they came by reference (`ray.put(named_tensors)`):
    such tensors travel from the trainer's object store to each replica and never through the
    ingress, which then loads no torch."""
    if isinstance(update, UpdateWeightsFromTensorRequest) and isinstance(update.named_tensors, ray.ObjectRef):
        return update.model_copy(update={"named_tensors": await update.named_tensors})
    return update


@serve.deployment(max_ongoing_requests=512, health_check_period_s=5.0, health_check_timeout_s=30.0,
                  graceful_shutdown_timeout_s=5.0)
class EngineServer:
    def __init__(self, model: str, engine: dict[str, Any] | None = None, tp_timeout_s: float = 60.0,
                 stall_timeout_s: float = 60.0, tp_worker_options: dict[str, Any] | None = None,
                 hold_timeout_s: float | None = None, stream_batching_interval_ms: float = 0.0):
        config = EngineConfig(**(engine or {}))
        factory = None
        if config.tp > 1:
            from engine.executor.ray_tp import RayTPExecutor

            factory = functools.partial(RayTPExecutor, timeout_s=tp_timeout_s,
                                        worker_options=tp_worker_options or None)
        self.engine = AsyncEngine(model, config, factory, stall_timeout_s=stall_timeout_s,
                                  hold_timeout_s=hold_timeout_s)
        freeze_startup_heap()  # this replica's process is the engine's own
        self.model_path = model
        # a stream's deltas that come within this long of the previous one go as one (0: each as it comes)
        self.stream_batching_interval_s = stream_batching_interval_ms / 1000
        self.replica = _replica_id()
        self.metrics = RequestMetrics()
        self.rank = _replica_rank()
        self._staged: dict[str, str] = {}  # update id (the ingress's) -> the engine's staging token
        self._live: set[str] = set()  # the ids of the requests in flight here (for abort_request by rid)
        log.info("EngineServer %s ready: %s (%s), tp=%d", self.replica, model, self.engine.spec.model_type,
                 config.tp)

    # ---- generation ------------------------------------------------------------------------
    async def _run(self, request: EngineRequest | dict[str, Any], streamed: bool = True
                   ) -> AsyncIterator[OutputChunk | Rejection]:
        """Yield the request's deltas, or one rejection. A request made by hand (a dict of EngineRequest's
        fields) is validated here. `streamed=False` (a unary call): the engine sends the chunk of the
        first tokens and the last only, which fold to the same result."""
        try:
            req = EngineRequest.model_validate(request)
        except ValidationError as e:
            yield validation_error(e).to_rejection()
            return
        params = req.params
        timer = self.metrics.timer()
        stream = self.engine.generate(req.prompt, params, req.request_id, streamed,
                                      self.stream_batching_interval_s if streamed else 0.0)
        last: OutputChunk | None = None  # the last delta yielded
        self._live.add(req.request_id)
        try:
            async for chunk in stream:
                timer.chunk(chunk.token_ids, chunk.step_map, chunk.finished, chunk.queue_time_s)
                yield chunk
                last = chunk
        except RequestError as e:  # raised before the first chunk
            yield request_error(e.message, e.param, req.rename).to_rejection()
        except ValidationError as e:
            yield validation_error(e, req.rename).to_rejection()
        except EngineDeadError as e:
            yield ApiError(str(e), None, 503, "engine_unavailable").to_rejection()
        except EngineHeldError as e:
            yield ApiError(str(e), None, 503, "engine_held", retry_after_s=e.retry_after_s).to_rejection()
        except Exception as e:  # noqa: BLE001 - a bug: fail this request only, never its batch mates
            log.exception("request %s failed", req.request_id)
            message = f"internal error: {type(e).__name__}: {e}"
            if last is None:
                yield ApiError(message, None, 500, "internal_error").to_rejection()
            else:
                yield OutputChunk(request_id=req.request_id, finish_reason="error", error=message,
                                  input_token_len=last.input_token_len, generate_token_len=last.generate_token_len)
        finally:
            self._live.discard(req.request_id)
            await stream.aclose()

    async def generate_stream(self, request: EngineRequest | dict[str, Any]
                              ) -> AsyncIterator[OutputChunk | Rejection]:
        """Stream the request's deltas, or one rejection."""
        async for item in self._run(request):
            yield item

    async def generate(self, request: EngineRequest | dict[str, Any]) -> Response | Rejection:
        """The folded result of one request, or its rejection."""
        result = Response()
        async for item in self._run(request, streamed=False):
            if isinstance(item, Rejection):
                return item
            result.add(item)
        if result.finish_reason is None:
            return ApiError("the engine ended the request without a result", None, 500, "internal_error").to_rejection()
        return result

    async def generate_batch(self, requests: list[EngineRequest | dict[str, Any]]) -> list[Response | Rejection]:
        """Run a batch of unary requests concurrently (they share engine steps)."""
        return list(await asyncio.gather(*(self.generate(r) for r in requests)))

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> ControlAnswer:
        """SGLang's /abort_request on this replica: every request in flight (`abort_all`), or those
        of `rid` (its samples and batch entries too: `rid-i`, `rid_i`). They end with finish_reason
        "abort" and what they generated so far."""
        if abort_all:
            return self._answer(await self.engine.abort_all())
        ids = [r for r in self._live if r == rid or r.startswith((f"{rid}-", f"{rid}_"))] if rid else []
        for request_id in ids:
            self.engine.abort(request_id)
        return self._answer(ControlResult(f"aborted {len(ids)} requests", requests=len(ids)))

    # ---- RL control (the ingress broadcasts each call to every replica) -----------------------
    def _answer(self, result: ControlResult, ranks: Sequence[int] = ()) -> ControlAnswer:
        """What the operation did on the engine, as this replica's answer."""
        return ControlAnswer.of(result, self.replica, self.rank, ranks)

    def _failure(self, e: Exception, ranks: Sequence[int] = ()) -> ControlAnswer:
        """The operation's exception, as this replica's answer (the ingress answers it)."""
        return ControlAnswer.failure(e, self.replica, self.rank, ranks)

    async def control(self, method: str, kwargs: dict[str, Any]) -> ControlAnswer:
        """Run a control operation that every replica runs as it is (`reach` "call" in CONTROL_OPS) on
        this replica's engine: its answer, or `success: False`."""
        op = CONTROL_OPS.get(method)
        if op is None or op.reach != "call":
            raise ValueError(f"{method!r} is not a control method")
        try:
            return self._answer(await getattr(self.engine, method)(**kwargs))
        except Exception as e:  # noqa: BLE001 - every failure is reported to the ingress, which answers it
            return self._failure(e)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str,
                                        timeout_s: float | None = None) -> ControlAnswer:
        """Join the trainer's group: this replica's TP ranks are `rank_offset + rank * tp + tp_rank`.
        A group that has not met within `timeout_s` (None: the engine's default) fails naming who
        did not join."""
        first = rank_offset + self.rank * self.engine.config.tp
        ranks = list(range(first, first + self.engine.config.tp))
        timeout = {} if timeout_s is None else {"timeout_s": timeout_s}
        try:
            return self._answer(await self.engine.init_weights_update_group(
                master_address, master_port, first, world_size, group_name, backend, **timeout), ranks)
        except Exception as e:  # noqa: BLE001 - reported to the ingress
            return self._failure(e, ranks)

    async def stage_weights(self, update_id: str, update: WeightUpdate) -> ControlAnswer:
        """Phase one of an update across replicas: stage the new weights on every TP rank without
        serving them. `success: False` names what was refused (nothing is staged then)."""
        try:
            source = weight_source(await _fetched(update))
            self._staged[update_id] = await self.engine.stage_weights(source)
            return self._answer(ControlResult("weights staged"))
        except Exception as e:  # noqa: BLE001 - reported to the ingress, which discards everywhere
            return self._failure(e)

    async def commit_weights(self, update_id: str, weight_version: str | None,
                             abort_all_requests: bool = False) -> ControlAnswer:
        """Phase two: serve the staged weights (`weight_version` None keeps the version). Requests in
        flight finish on the old weights first and new ones wait, unless `abort_all_requests`."""
        token = self._staged.pop(update_id, None)
        if token is None:
            return ControlAnswer(False, f"no weights staged for update {update_id!r}", self.replica, self.rank)
        try:
            return self._answer(await self.engine.commit_weights(token, weight_version, abort_all_requests))
        except Exception as e:  # noqa: BLE001 - reported to the ingress
            return self._failure(e)

    async def discard_weights(self, update_id: str) -> ControlAnswer:
        token = self._staged.pop(update_id, None)
        if token is None:
            return self._answer(ControlResult("nothing staged"))
        return self._answer(await self.engine.discard_weights(token))

    # ---- observability ---------------------------------------------------------------------
    def stats(self) -> ReplicaStats:
        cfg = self.engine.config
        return ReplicaStats(self.replica, self.rank, self.engine.spec.model_type, cfg.tp, cfg.max_model_len,
                            self.engine.stats())

    def model_info(self) -> ModelInfo:
        """What the ingress needs to know of the model and the engine (it loads no model code itself)."""
        cfg, spec = self.engine.config, self.engine.spec
        try:
            architectures = json.loads((Path(self.model_path) / "config.json").read_text()).get("architectures")
        except (OSError, ValueError):
            architectures = None
        return ModelInfo(self.model_path, spec.model_type, architectures, self.engine.is_dllm, cfg.max_model_len,
                         cfg.tp, self.engine.stats().load.kv_pages_total * cfg.kv_block_size, cfg,
                         WEIGHT_OP_TIMEOUT_S, self.engine.paradigm)

    def metric_families(self) -> MetricFamilies:
        """This replica's request histograms (prometheus_client families) for the ingress's /metrics."""
        return MetricFamilies(self.replica, self.metrics.families())

    def check_health(self) -> None:
        """Serve's health check: raises when the engine loop is dead or stalled (Serve then replaces
        this replica). A stall also ends the requests in flight with an error at once."""
        self.engine.check_health()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown
                log.exception("engine shutdown failed")
