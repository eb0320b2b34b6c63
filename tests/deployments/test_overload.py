"""Overload control on Serve's own limits: 4x the admitted load gets only 200, or 429/503 with
Retry-After at once, never a hang. Two places to set the limit:
- `engine`: the EngineServer's max_ongoing_requests + max_queued_requests (the ingress gets Serve's
  BackPressureError from the engine handle and answers it);
- `ingress`: ingress.max_concurrent_requests, the generation requests the ingress admits (beyond it
  429 + Retry-After), with the ingress deployment's own Serve queue bounded too.
The p99 latency of the admitted requests is printed and recorded (not asserted: timing never decides)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.support.ray_env import QUIET, SERVE_ENGINE
from tests.support.serve import ServedApp

ADMITTED = 4  # running; as many again may wait in the queue
LIMITS = {
    "overload_engine": {"max_ongoing_requests": ADMITTED, "max_queued_requests": ADMITTED},
    "overload_ingress": {"ingress": {"max_concurrent_requests": ADMITTED, "max_queued_requests": ADMITTED}},
}
BODY = {"prompt": "Tell me a story.", "max_tokens": 64, "temperature": 1.0, "seed": 3, "ignore_eos": True,
        "stream": True}


@pytest.fixture(scope="module")
def overload_apps(serve_cluster, tiny_checkpoints) -> dict[str, ServedApp]:
    from ray import serve

    from deployments.app import build_app

    model = tiny_checkpoints["sdar"]
    serve.run_many([serve.RunTarget(build_app({"model": str(model), "engine": SERVE_ENGINE, **args}), name=name,
                                    route_prefix=f"/{name}", logging_config=QUIET) for name, args in LIMITS.items()])
    yield {name: ServedApp(name, f"{serve_cluster.url}/{name}", str(model), SERVE_ENGINE) for name in LIMITS}
    for name in LIMITS:
        serve.delete(name, _blocking=False)


async def _burst(url: str, n: int) -> list[tuple[int, str | None, float, bool]]:
    """n streams at once: (status, Retry-After, seconds, stream complete) each."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(120), limits=httpx.Limits(max_connections=n + 4)) as client:
        async def one() -> tuple[int, str | None, float, bool]:
            t0 = time.monotonic()
            async with client.stream("POST", url + "/generate", json=BODY) as r:
                text = "".join([line async for line in r.aiter_lines()])
            return r.status_code, r.headers.get("retry-after"), time.monotonic() - t0, text.endswith("[DONE]")

        return list(await asyncio.gather(*(one() for _ in range(n))))


@pytest.mark.parametrize("name", list(LIMITS))
def test_four_times_the_admitted_load_is_refused_with_retry_after(overload_apps, name, record_property):
    results = asyncio.run(_burst(overload_apps[name].url, 4 * 2 * ADMITTED))
    admitted = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] != 200]
    assert all(status in (429, 503) and retry_after is not None for status, retry_after, _, _ in refused), refused
    assert all(complete for *_, complete in admitted)  # admitted streams are served in full
    assert ADMITTED <= len(admitted) < len(results)
    latencies = sorted(s for _, _, s, _ in admitted)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    refusal = max(s for _, _, s, _ in refused)
    record_property("admitted_p99_s", round(p99, 3))
    print(f"{name}: {len(admitted)} admitted (p99 {p99:.2f}s), {len(refused)} refused "
          f"({sorted({r[0] for r in refused})}, slowest refusal {refusal:.2f}s)")
    # and once the burst is over, requests are admitted again
    assert asyncio.run(_burst(overload_apps[name].url, 1))[0][0] == 200
