"""Faults: a stalled engine loop. The pool's `sdar_drills` app runs with the fault-drill hooks
(deployments.drills), stall_timeout_s=10 and a 1 s health check; `debug_stall` (a Ray-handle-only test
hook) makes its engine loop sleep as a hung forward would. The health check catches it: the requests in
flight end with an explicit error, Serve replaces the replica, and later requests succeed. (A TP
worker killed mid-stream: tests/deployments/test_serve_tp.py.)"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from ray import serve

from configs import EngineConfig, GenerationConfig
from engine.async_engine import AsyncEngine
from engine.errors import EngineDeadError
from tests.support.http import in_flight_then
from tests.support.ray_env import SERVE_ENGINE

LONG = {"prompt": "Tell me a long story.", "max_tokens": 480, "temperature": 0.9, "seed": 5, "ignore_eos": True}
SHORT = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def replicas(app: str) -> list[str]:
    return [s["replica"] for s in serve.get_app_handle(app).engine_stats.remote().result()]


def test_production_app_has_no_debug_hook_and_no_http_route_to_one(serve_pool):
    with pytest.raises(Exception, match="debug_stall' that does not exist"):
        serve.get_deployment_handle("EngineServer", serve_pool["sdar"].name).debug_stall.remote(30).result()
    for app in ("sdar", "sdar_drills"):
        url = serve_pool[app].url
        for method in ("GET", "POST"):
            r = httpx.request(method, url + "/debug_stall", json={"seconds": 30}, timeout=30)
            assert r.status_code in (404, 405), r.text
    r = httpx.post(serve_pool["sdar"].url + "/generate", json=SHORT, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 6


def test_stalled_engine_loop_errors_in_flight_requests_and_replica_is_replaced(serve_pool):
    app = serve_pool["sdar_drills"]
    (before,) = replicas(app.name)
    h = serve.get_deployment_handle("EngineServer", app.name)

    def stall() -> None:
        assert h.debug_stall.remote(120).result() is True

    elapsed, endings = asyncio.run(in_flight_then(app.url, LONG, stall))
    print(f"in-flight requests ended {elapsed:.1f}s after the fault")
    for kind, result in endings:
        if kind == "stream":
            assert result[-1] == "[DONE]", result[-3:]
            final = result[-2]["meta_info"]["finish_reason"]
            assert final["type"] == "error" and "stuck" in final["message"], final
        else:
            status, retry_after, body = result
            assert status == 503 and retry_after is not None, (status, body)
            assert body["error"]["type"] == "engine_unavailable" and "stuck" in body["error"]["message"], body
    # Serve sees the failing health check, replaces the replica, and requests succeed again
    deadline = time.monotonic() + 120
    while True:
        r = httpx.post(app.url + "/generate", json=SHORT, timeout=60)
        if r.status_code == 200:
            break
        assert r.status_code == 503 and time.monotonic() < deadline, r.text
        time.sleep(0.5)
    assert r.json()["meta_info"]["completion_tokens"] == 6
    (after,) = replicas(app.name)
    assert after != before
    assert httpx.get(app.url + "/health", timeout=30).json()["status"] == "ok"


def test_async_engine_declares_a_stuck_loop_dead_and_ends_its_streams(tiny_checkpoints):
    """In-process (no Ray): what the health check relies on. A loop stuck past stall_timeout_s fails
    check_health, which ends the open streams with an error at once and refuses new requests."""
    engine = AsyncEngine(str(tiny_checkpoints["sdar"]), EngineConfig(**SERVE_ENGINE), stall_timeout_s=0.5)
    try:
        async def main() -> None:
            stream = engine.generate("Hello", GenerationConfig(max_new_tokens=400, ignore_eos=True))
            first = await stream.__anext__()
            assert first.finish_reason is None
            engine.check_health()
            stuck = asyncio.ensure_future(engine.run(lambda _: time.sleep(3)))
            await asyncio.sleep(0.8)
            with pytest.raises(EngineDeadError, match="stuck"):
                engine.check_health()
            rest = [c async for c in stream]
            assert rest[-1].finish_reason == "error" and "stuck" in rest[-1].error
            with pytest.raises(EngineDeadError):
                await engine.generate("Hi", GenerationConfig(max_new_tokens=2)).__anext__()
            with pytest.raises(EngineDeadError):
                engine.check_health()
            await asyncio.gather(stuck, return_exceptions=True)

        asyncio.run(main())
    finally:
        engine.shutdown()
