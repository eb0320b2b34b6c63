"""Security on the `secure` app: it serves a *hostile* checkpoint (code that would leave
marker files if anything ran it), requires an API key, and admits at most 2 generation requests at a
time. Checks: no code from the checkpoint ever runs; the key guards every route but /health;
the local config binds to loopback; a full ingress answers 429 with Retry-After instead of queueing,
and frees its slots however requests end."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import yaml
from fastapi.routing import APIRoute
from pydantic import ValidationError
from ray import serve

from configs import EngineConfig, GenerationConfig
from deployments.app import AppArgs
from deployments.ingress import app as ingress_app
from deployments.rl.protocol import CONTROL_OPS
from engine.offline import pipeline
from tests.support.hostile import write_hostile_checkpoint
from tests.support.http import sse_events
from tests.support.paths import ROOT
from tests.support.serve import engine_totals
from tests.support.serve_pool import KEY

AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"prompt": "Tell me a long story.", "max_tokens": 480, "temperature": 0.9, "seed": 2, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
BODIES = {"/generate": {"prompt": "Hi", "max_tokens": 4}, "/v1/completions": {"prompt": "Hi", "max_tokens": 4},
          "/v1/chat/completions": CHAT}
# the other routes that read a body
OTHER_BODIES = {"/abort_request": {"rid": "no-such-request"},
                "/v1/decisions": {"input": "Hi", "questions": [{"id": "q", "type": "choice", "question": "Which?",
                                                                  "options": [{"name": "a"}, {"name": "b"}]}]}}


def test_checkpoint_code_is_never_run(reliability_apps, hostile_checkpoint, tmp_path):
    ckpt, markers = hostile_checkpoint
    app = reliability_apps["secure"]  # EngineServer and Ingress both loaded it (config, weights, tokenizer)
    r = httpx.post(app.url + "/generate", json={"prompt": "Hello", "max_tokens": 8, "ignore_eos": True},
                   headers=AUTH, timeout=60)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 8, r.text
    with pipeline(str(ckpt), EngineConfig(max_model_len=64, num_kv_blocks=32, kv_block_size=4)) as pipe:
        assert len(pipe("Hello", gen_config=GenerationConfig(max_new_tokens=4, ignore_eos=True)).token_ids) == 4
    assert sorted(p.name for p in markers.iterdir()) == []
    # the payloads are live: importing / unpickling them *would* leave the markers
    probe = write_hostile_checkpoint(ckpt, tmp_path / "probe", tmp_path / "probe_markers")
    import pickle
    import runpy

    runpy.run_path(str(probe / "modeling_sdar.py"))
    pickle.loads((probe / "pytorch_model.bin").read_bytes())
    assert sorted(p.name for p in (tmp_path / "probe_markers").iterdir()) == ["modeling_sdar", "pytorch_model.bin"]


def _routes() -> list[tuple[str, str]]:
    """Every (method, path) the ingress serves, read from its FastAPI app (Serve nests the class's
    routes in an included router): a route added later is covered without editing this test."""
    found: set[tuple[str, str]] = set()

    def walk(routes) -> None:
        for r in routes:
            if isinstance(r, APIRoute):
                found.update((m, r.path) for m in r.methods)
            for attr in ("original_router", "router"):
                sub = getattr(r, attr, None)
                if sub is not None and hasattr(sub, "routes"):
                    walk(sub.routes)

    walk(ingress_app.routes)
    return sorted(found)


def test_api_key_guards_every_route_but_health(reliability_apps):
    url = reliability_apps["secure"].url
    routes = _routes()
    assert {("POST", "/generate"), ("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models")} <= set(routes)
    bad_headers = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                   {"X-Api-Key": KEY}, {"Authorization": f"Bearer {KEY}x"}]
    for method, path in routes:
        body = BODIES.get(path, OTHER_BODIES.get(path))
        if path == "/health":
            assert httpx.request(method, url + path, timeout=30).status_code == 200
            continue
        for headers in bad_headers:
            r = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.json()["error"]["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"
        r = httpx.request(method, url + path, params={"api_key": KEY}, json=body, timeout=30)  # not in the URL
        assert r.status_code == 401, (path, r.text)
        if path.lstrip("/") in CONTROL_OPS:  # RL control: with the key, it would pause / release this app
            continue
        assert httpx.request(method, url + path, json=body, headers=AUTH, timeout=60).status_code == 200, path
    # the key is checked before the body is even read: streams, garbage and oversized bodies alike
    for content in (b'{"prompt": "Hi", "stream": true}', b"\xff{not json", b"x" * (9 << 20)):
        r = httpx.post(url + "/generate", content=content, timeout=60)
        assert r.status_code == 401, r.text
    with httpx.stream("POST", url + "/generate", json={"prompt": "Hi", "max_tokens": 4, "stream": True},
                      headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and sse_events(r.iter_lines())[-1] == "[DONE]"


def test_local_config_binds_loopback_with_limits():
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    assert config["http_options"]["host"] == "127.0.0.1"
    (app,) = config["applications"]
    ingress = app["args"]["ingress"]
    assert ingress["max_body_bytes"] > 0 and "api_key" in ingress and "max_concurrent_requests" in ingress
    AppArgs.model_validate(app["args"])  # the shipped config is valid as written
    with pytest.raises(ValidationError, match="debug_hooks"):  # the production app has no test hooks
        AppArgs.model_validate(app["args"] | {"debug_hooks": True})


def _ingress_gauges(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=30).text

    def value(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    return value("blockserve_ingress_requests_in_flight"), value("blockserve_ingress_rejected_total")


def _wait_in_flight(url: str, n: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while _ingress_gauges(url)[0] != n:
        assert time.monotonic() < deadline, f"in-flight gauge stuck at {_ingress_gauges(url)[0]}, expected {n}"
        time.sleep(0.1)


async def _saturate_and_probe(url: str) -> None:
    """Fill both slots with streams the engine holds (its loop is paused for a few seconds, as a
    busy engine would), then probe every generation route."""
    engine = serve.get_deployment_handle("EngineServer", "secure")
    assert await asyncio.to_thread(lambda: engine.debug_stall.remote(5).result())
    async with httpx.AsyncClient(timeout=60, headers=AUTH) as client:
        async def stream() -> list:
            async with client.stream("POST", url + "/generate", json={**LONG, "stream": True}) as r:
                assert r.status_code == 200
                return sse_events([line async for line in r.aiter_lines()])

        streams = [asyncio.ensure_future(stream()) for _ in range(2)]
        await asyncio.to_thread(_wait_in_flight, url, 2)
        # full: every generation route refuses with 429 + Retry-After, streams included
        for path, body in BODIES.items():
            for stream_it in (False, True):
                r = await client.post(url + path, json={**body, "stream": stream_it})
                assert r.status_code == 429, (path, r.text)
                assert r.headers["retry-after"] == "2"
                err = r.json()["error"]
                assert err["type"] == "rate_limit_exceeded" and "2 concurrent" in err["message"], err
        # ... but only after the key check, and the other routes still answer
        assert (await client.post(url + "/generate", json=BODIES["/generate"], headers={"Authorization": ""})
                ).status_code == 401
        assert (await client.get(url + "/v1/models")).status_code == 200
        assert (await client.get(url + "/health")).status_code == 200
        # handles get the same refusal as JSON
        h = serve.get_app_handle("secure")
        body = await asyncio.to_thread(lambda: h.generate.remote(BODIES["/generate"]).result())
        assert body["error"]["type"] == "rate_limit_exceeded", body
        stream_handle = h.options(stream=True)
        items = await asyncio.to_thread(lambda: list(stream_handle.generate_stream.remote(BODIES["/generate"])))
        assert len(items) == 1 and items[0]["error"]["type"] == "rate_limit_exceeded", items
        assert not any(s.done() for s in streams), "the engine did not hold the streams"
        streams[0].cancel()  # one client leaves while its request waits; the other is served in full
        events = await streams[1]
        assert events[-1] == "[DONE]" and len(events[-2]["output_ids"]) == LONG["max_tokens"]  # cumulative chunks
        await asyncio.gather(streams[0], return_exceptions=True)


def test_full_ingress_answers_429_with_retry_after(reliability_apps):
    url = reliability_apps["secure"].url
    _wait_in_flight(url, 0)
    rejected0 = _ingress_gauges(url)[1]
    asyncio.run(_saturate_and_probe(url))
    _wait_in_flight(url, 0)
    assert _ingress_gauges(url)[1] - rejected0 == 8  # 6 HTTP + 2 handle refusals
    # clients that leave before the response starts give their slot back as well
    async def flaky() -> None:
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as client:
            for i in range(12):
                task = asyncio.ensure_future(client.post(url + "/generate", json={**LONG, "stream": i % 2 == 0}))
                await asyncio.sleep(0.01 * (i % 4))
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    asyncio.run(flaky())
    _wait_in_flight(url, 0)
    # and two at a time are served again
    async def two() -> list[int]:
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as client:
            rs = await asyncio.gather(*(client.post(url + "/generate", json=BODIES["/generate"]) for _ in range(2)))
            return [r.status_code for r in rs]

    assert asyncio.run(two()) == [200, 200]
    t = engine_totals("secure")
    deadline = time.monotonic() + 300  # a hang guard: the verdict is the page count
    while t["running"] + t["waiting"] and time.monotonic() < deadline:
        time.sleep(0.1)
        t = engine_totals("secure")
    assert t["kv_pages_free"] == t["kv_pages_total"]


@pytest.mark.parametrize("limit", [0, -1])
def test_max_concurrent_requests_must_be_positive(limit, tiny_checkpoints):
    from deployments.app import build_app

    with pytest.raises(ValueError, match="max_concurrent_requests"):
        build_app({"model": str(tiny_checkpoints["sdar"]), "ingress": {"max_concurrent_requests": limit}})
