"""Autoscaling of EngineServer replicas from the app args: load raises the replica count, idleness
lowers it, and a replica being removed drains its requests first (none is lost). Short autoscaling
delays; every wait is for a condition, bounded by a generous timeout."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from ray import serve

from tests.support.ray_env import SERVE_ENGINE
from tests.support.serve import deploy

NAME = "autoscale"
SCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 0.5,
           "downscale_delay_s": 3.0, "metrics_interval_s": 0.5, "look_back_period_s": 1.0}
BODY = {"prompt": "Tell me a story.", "max_tokens": 96, "temperature": 1.0, "seed": 1, "ignore_eos": True,
        "stream": True}


@pytest.fixture(scope="module")
def app(serve_cluster, tiny_checkpoints):
    served = deploy(serve_cluster, NAME, tiny_checkpoints["sdar"], SERVE_ENGINE, autoscaling_config=SCALING,
                    graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=60)
    yield served
    serve.delete(NAME, _blocking=False)


def running_replicas() -> int:
    status = serve.status().applications[NAME].deployments["EngineServer"]
    return status.replica_states.get("RUNNING", 0)


class Load:
    """`streams` concurrent streaming requests, each replaced when it ends, until stopped; outcomes counted."""

    def __init__(self, url: str, streams: int):
        self.url, self.streams = url, streams
        self.outcomes: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    async def _one(self, client: httpx.AsyncClient) -> str:
        try:
            async with client.stream("POST", self.url + "/generate", json=BODY) as r:
                text = "".join([line async for line in r.aiter_lines()])
        except httpx.HTTPError:
            return "lost"
        if r.status_code != 200:
            return f"status {r.status_code}"
        return "ok" if text.endswith("[DONE]") and '"type": "error"' not in text else "error"

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            async def worker() -> None:
                while not self.stop.is_set():
                    self.outcomes.append(await self._one(client))

            await asyncio.gather(*(worker() for _ in range(self.streams)))

    def finish(self) -> list[str]:
        self.stop.set()
        self.thread.join(timeout=180)
        assert not self.thread.is_alive(), "requests still unanswered 180 s after the load stopped"
        return self.outcomes


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_load_scales_up_idleness_scales_down_nothing_lost(app):
    wait_for(lambda: running_replicas() == 1, 60, "one replica at rest")
    heavy = Load(app.url, streams=8)  # 4x target_ongoing_requests on one replica
    wait_for(lambda: running_replicas() == 2, 120, "a second replica under load")
    outcomes = heavy.finish()
    # a trickle below the target keeps requests in flight while the extra replica is removed
    trickle = Load(app.url, streams=1)
    wait_for(lambda: running_replicas() == 1, 120, "scale-down to one replica")
    outcomes += trickle.finish()
    print({o: outcomes.count(o) for o in set(outcomes)})
    assert outcomes and set(outcomes) == {"ok"}, {o: outcomes.count(o) for o in set(outcomes)}
