"""How the ingress calls the EngineServer replicas: unary requests batched (`@serve.batch`) into one
`generate_batch` call, streams one `generate_stream` each (cancelled when their reader goes away,
which aborts the request in the engine and frees its KV pages), broadcasts to every replica, and the
model facts the ingress needs, asked of the engine once (the ingress loads no model code). What
crosses is `deployments.wire`'s types: the results are the carrier's `OutputChunk` / `Response`, the
stats `ReplicaStats`. The ingress holds one `EngineClient` and gives it to each of its route groups."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from deployments.batch_calls import BatchCalls
from deployments.errors import ApiError, unavailable
from deployments.http import engine_call_error
from deployments.metrics import IngressMetrics
from deployments.wire import EngineRequest, ModelInfo, Rejection, ReplicaStats, Result
from engine.carrier import OutputChunk, Response

log = logging.getLogger(__name__)

ENGINE_CHECK_INTERVAL_S = 1.0  # how often the ingress re-checks that an engine replica runs


def _error_result(request_id: str, message: str, last: OutputChunk) -> OutputChunk:
    """The final delta of a stream the engine side could not finish (replica died)."""
    return OutputChunk(request_id=request_id, finish_reason="error", error=message,
                       input_token_len=last.input_token_len, generate_token_len=last.generate_token_len)


async def _merge(streams: list[AsyncIterator[OutputChunk]]) -> AsyncIterator[tuple[int, OutputChunk]]:
    """Interleave several requests' deltas as (index, delta), each as soon as it arrives. Closing the
    merged iterator closes (and so cancels) every stream."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, OutputChunk | None]] = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[OutputChunk]) -> None:
        try:
            async for out in it:
                await queue.put((i, out))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            i, out = await queue.get()
            if out is None:
                open_streams -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for it in streams:
            await it.aclose()


class EngineClient:
    """The ingress's calls into the EngineServer deployment (`engine`: its handle); `metrics` counts
    the batches and the tokens of the finished requests."""

    def __init__(self, engine: DeploymentHandle, metrics: IngressMetrics, max_batch_size: int,
                 batch_wait_timeout_s: float):
        self.engine = engine
        self.metrics = metrics
        self._engine_seen_at = 0.0  # when an engine replica was last seen running
        self._info: ModelInfo | None = None
        self._batch_calls = BatchCalls(self.broadcast)  # aborts the requests whose callers left
        self._batched_generate.set_max_batch_size(max_batch_size)
        self._batched_generate.set_batch_wait_timeout_s(batch_wait_timeout_s)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005, max_concurrent_batches=64)
    async def _batched_generate(self, requests: list[EngineRequest]) -> list[Response | Rejection]:
        self.metrics.batches.inc()
        self.metrics.batched.inc(len(requests))
        try:
            return await self._batch_calls.run(self.engine.generate_batch, requests)
        except Exception as e:  # full, died or unreachable: every request in the batch fails
            if not isinstance(e, BackPressureError):
                log.exception("generate_batch failed")
            return [engine_call_error(e).to_rejection()] * len(requests)

    async def broadcast(self, method: str, *args: Any, timeout_s: float = 10.0,
                        return_exceptions: bool = False) -> list[Any]:
        """Call `method(*args)` on every running EngineServer replica (Serve's `broadcast`)."""
        return await self.engine.broadcast(method, *args).results_async(timeout_s=timeout_s,
                                                                         return_exceptions=return_exceptions)

    async def info(self) -> ModelInfo:
        """The model facts of the engine (`EngineServer.model_info`), the same on every replica, asked
        once; 503 while no engine replica runs."""
        if self._info is None:
            try:
                answers = await self.broadcast("model_info", return_exceptions=True)
            except DeploymentUnavailableError:
                answers = []
            info = next((a for a in answers if isinstance(a, ModelInfo)), None)
            if info is None:
                raise unavailable()
            self._info = info
        return self._info

    async def replica_stats(self) -> list[ReplicaStats]:
        """The stats of the engine replicas that answer."""
        return [s for s in await self.broadcast("stats", return_exceptions=True) if isinstance(s, ReplicaStats)]

    async def weight_version(self) -> str | list[str] | None:
        """The weights being served: a list when the replicas disagree (e.g. one restarted since an
        update), None when no replica answers."""
        versions = sorted({s.engine.weight_version for s in await self.replica_stats()})
        return versions[0] if len(versions) == 1 else versions or None

    def _count(self, out: Result) -> None:
        if out.finish_reason is not None:
            self.metrics.prompt_tokens.inc(out.input_token_len)
            self.metrics.generation_tokens.inc(out.generate_token_len)

    async def _require_engine(self) -> None:
        """503 at once while no engine replica runs (one that cannot be scheduled, or all being
        replaced): Serve's router would otherwise hold the request until one starts. Looked up at
        most once a second."""
        if time.monotonic() - self._engine_seen_at < ENGINE_CHECK_INTERVAL_S:
            return
        try:
            answers = await self.broadcast("check_health", return_exceptions=True)
        except DeploymentUnavailableError:  # Serve's word for "no replica of it runs"
            answers = []
        if not answers:
            raise unavailable("no engine replica is running (starting, being replaced, or waiting for resources: "
                              "see `serve status`)")
        self._engine_seen_at = time.monotonic()

    async def unary(self, req: EngineRequest) -> Response:
        """The folded result of one request; ApiError for refusals and engine failures (503: the
        engine replica failed under the request; Serve replaces it, so a retry is the remedy)."""
        await self._require_engine()
        try:
            out = await self._batched_generate(req)
        except asyncio.CancelledError:  # the client left: abort the request in the engine, as a stream's
            self._batch_calls.abandon(req.request_id)
            raise
        if isinstance(out, Rejection):
            raise ApiError.from_rejection(out)
        self._count(out)
        if out.finish_reason == "error":
            raise unavailable(f"the engine failed this request: {out.error}")
        return out

    async def stream(self, req: EngineRequest) -> AsyncIterator[OutputChunk]:
        """The request's deltas. Refusals raise ApiError here, before anything is sent;
        a failure later ends the stream with a finish_reason "error" delta. Closing the iterator
        (client disconnect, cancellation) cancels the engine-side stream."""
        await self._require_engine()
        gen = self.engine.options(stream=True).generate_stream.remote(req)
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            raise ApiError("the engine ended the request without a result", None, 500, "internal_error") from None
        except asyncio.CancelledError:  # the client left before the first delta
            gen.cancel()
            raise
        except Exception as e:
            raise engine_call_error(e) from None
        if isinstance(first, Rejection):
            raise ApiError.from_rejection(first)

        async def deltas() -> AsyncIterator[OutputChunk]:
            last, message = first, "the engine replica ended the stream without finishing the request"
            try:
                yield first
                if first.finish_reason is None:
                    async for item in gen:
                        if isinstance(item, Rejection):  # a refusal after the first delta ends the request
                            message = item.message or message
                            break
                        last = item
                        yield item
                if last.finish_reason is None:  # every request ends with a finish reason or an error
                    log.error("stream %s ended without a finish reason: %s", req.request_id, message)
                    last = _error_result(req.request_id, message, last)
                    yield last
            except Exception as e:  # noqa: BLE001 - the replica died mid-stream
                log.exception("stream %s failed", req.request_id)
                last = _error_result(req.request_id, f"the engine replica failed: {type(e).__name__}: {e}", last)
                yield last
            finally:
                if last.finish_reason is None:
                    gen.cancel()
                self._count(last)

        return deltas()

    async def streams(self, reqs: list[EngineRequest]) -> AsyncIterator[tuple[int, OutputChunk]]:
        """Several requests streamed together as (index, delta); a refusal of any raises ApiError
        before anything is sent (and closes the others)."""
        started = await asyncio.gather(*(self.stream(r) for r in reqs), return_exceptions=True)
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            for it in started:
                if not isinstance(it, BaseException):
                    await it.aclose()
            raise failed[0]
        return _merge(started)

    async def unaries(self, reqs: list[EngineRequest]) -> list[Response]:
        return list(await asyncio.gather(*(self.unary(r) for r in reqs)))
