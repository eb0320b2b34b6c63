"""Fault drills: an EngineServer that can be made to fail on purpose, for the tests and the soak bench.

The production application never builds it (`deployments.app.build_app` serves the plain
EngineServer, which carries no hook). `build_drill_app(args)` builds the same application with this
replica class under the same deployment name, so `serve.get_deployment_handle("EngineServer", app)`
reaches it. The hooks are methods of the replica, reachable only through a Ray handle from inside the
cluster: the HTTP ingress has no route to them.

- `debug_stall(seconds)`: the engine loop sleeps, as a hung forward would (the health check must catch it);
- `debug_fail_next_stage(message)`: this replica refuses the next weight staging (a replica failing mid-update);
- `debug_cut_streams()`: the streams in flight end at their next delta without their finishing one (a
  stream cut short on the way, which the ingress must turn into an explicit error);
- `debug_leak(megabytes)`: memory kept for good (the leak the soak's verdict must catch).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from ray.serve import Application

from deployments.app import build_app_with
from deployments.engine_server import EngineServer, weight_source
from deployments.ingress import Ingress
from deployments.rl.protocol import UpdateWeightsFromDistributedRequest, WeightUpdate
from deployments.wire import ControlAnswer, EngineRequest, Rejection
from engine.carrier import OutputChunk

log = logging.getLogger(__name__)


class DrillEngineServer(EngineServer.func_or_class):
    """EngineServer plus the fault-drill hooks (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._fail_next_stage: str | None = None  # refuse the next stage with this message
        self._cut: set[str] = set()  # streams to end at their next delta, unfinished
        self._ballast: list[bytearray] = []  # memory kept on purpose (a leak to detect)
        self._stall: asyncio.Future | None = None

    async def generate_stream(self, request: EngineRequest | dict[str, Any]
                              ) -> AsyncIterator[OutputChunk | Rejection]:
        async with aclosing(super().generate_stream(request)) as items:
            async for item in items:
                yield item
                if isinstance(item, OutputChunk) and item.request_id in self._cut:  # end it here, unfinished
                    self._cut.discard(item.request_id)
                    return

    async def stage_weights(self, update_id: str, update: WeightUpdate) -> ControlAnswer:
        if self._fail_next_stage is None:
            return await super().stage_weights(update_id, update)
        message, self._fail_next_stage = self._fail_next_stage, None
        try:
            if isinstance(update, UpdateWeightsFromDistributedRequest):  # the trainer's broadcast must still complete
                await self.engine.discard_weights(await self.engine.stage_weights(weight_source(update)))
            raise RuntimeError(message)
        except Exception as e:  # noqa: BLE001 - reported to the ingress, as a real failure would be
            return self._failure(e)

    async def debug_stall(self, seconds: float) -> bool:
        """Make the engine loop sleep `seconds` (a hung forward, as far as anyone can tell)."""
        log.warning("debug_stall: the engine loop sleeps %.1fs", seconds)
        self._stall = asyncio.ensure_future(self.engine.run(lambda _: time.sleep(seconds)))
        return True

    def debug_cut_streams(self) -> int:
        """End every stream in flight here at its next delta without its finishing one (as a transport
        that drops the end of a stream would); returns how many."""
        self._cut |= self._live
        return len(self._live)

    def debug_leak(self, megabytes: float) -> int:
        """Keep `megabytes` more of this process's memory for good; returns the MB kept so far."""
        self._ballast.append(bytearray(b"\x01" * int(megabytes * (1 << 20))))
        return sum(len(b) for b in self._ballast) >> 20

    def debug_fail_next_stage(self, message: str) -> bool:
        """Make this replica refuse the next weight staging with `message`."""
        self._fail_next_stage = message
        return True


DrillServer = EngineServer.options(func_or_class=DrillEngineServer)  # same deployment name: "EngineServer"


def build_drill_app(args: dict[str, Any]) -> Application:
    """`deployments.app.build_app(args)` with the fault-drill replica class."""
    return build_app_with(args, Ingress, server=DrillServer)
