"""Unary requests batched into one engine call, and what happens when one of their clients leaves: the
request is aborted in the engine, as a stream's is, so no replica decodes an answer nobody reads.

The ingress sends the unary requests of one `@serve.batch` window as one `EngineServer.generate_batch`
call, which ends when its last request does; Serve does not cancel it when one caller goes away (it
only drops callers that leave before the window closes). So a caller that leaves abandons its
request: once every request of a call is abandoned, the call is cancelled (the engine replica aborts
them all, or drops the call still waiting for a replica); otherwise the request is aborted by id on
the engine replicas (`abort_request`), again every `ABORT_RETRY_S` until an abort finds it or the call
is over, since the call may still be on its way to a replica. The call is made outside the context
of the request that happens to run the batching, so that nothing but `abandon` cancels it.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from deployments.errors import ApiError
from deployments.wire import ControlAnswer, EngineRequest, Rejection
from engine.carrier import Response

log = logging.getLogger(__name__)

ABORT_RETRY_S = 0.25
Broadcast = Callable[..., Awaitable[list[Any]]]  # EngineClient.broadcast


@dataclass
class _Call:
    """One generate_batch call in flight: its response and the requests whose callers still wait."""

    response: Any  # DeploymentResponse
    waiting: set[str]
    cancelled: bool = False
    done: bool = False


def _left() -> ApiError:
    return ApiError("the client left", None, 499, "client_closed_request")


class BatchCalls:
    """The generate_batch calls in flight in one ingress replica, by request id."""

    def __init__(self, broadcast: Broadcast):
        self._broadcast = broadcast
        self._calls: dict[str, _Call] = {}
        self._aborts: set[asyncio.Task] = set()

    async def run(self, method: Any, requests: list[EngineRequest]) -> list[Response | Rejection]:
        """Call `method` (the handle's generate_batch) for `requests` and await it. The call is made
        outside any request's context: Serve and Ray would otherwise tie it to the request that
        happened to start the batching task and cancel it, batch mates and all, when that one's
        client leaves; here only `abandon` cancels a call. A cancelled call answers a rejection per
        request, so no caller waits forever."""
        ids = [r.request_id for r in requests]
        call = _Call(contextvars.Context().run(method.remote, requests), set(ids))
        self._calls.update(dict.fromkeys(ids, call))
        try:
            return await call.response
        except asyncio.CancelledError:  # by `abandon`, or by Serve (the engine replica going away)
            error = _left() if call.cancelled else ApiError("the engine call was cancelled", None, 503,
                                                            "engine_unavailable")
        except Exception:  # after `abandon` cancelled it, how Ray reports a cancelled task
            if not call.cancelled:
                raise
            error = _left()
        finally:
            call.done = True
            for i in ids:
                if self._calls.get(i) is call:
                    del self._calls[i]
        return [error.to_rejection()] * len(requests)

    def abandon(self, request_id: str) -> None:
        """The caller of `request_id` left: abort the request in the engine (see the module's docstring).
        A request not in a call was never sent: Serve drops it from its batch window."""
        call = self._calls.pop(request_id, None)
        if call is None:
            return
        call.waiting.discard(request_id)
        if not call.waiting:
            call.cancelled = True
            call.response.cancel()
            return
        task = asyncio.ensure_future(self._abort_until_found(request_id, call))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort_until_found(self, request_id: str, call: _Call) -> None:
        while not call.done:
            try:
                answers = await self._broadcast("abort_request", request_id, False, return_exceptions=True)
            except Exception:  # noqa: BLE001 - no replica reachable now: try again while the call lasts
                log.warning("aborting request %s failed; retrying", request_id, exc_info=True)
                answers = []
            if any(isinstance(a, ControlAnswer) and a.requests for a in answers):
                return
            await asyncio.sleep(ABORT_RETRY_S)
