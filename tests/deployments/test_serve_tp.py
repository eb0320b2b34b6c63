"""Tensor parallelism on CPU through Serve (tp=2: the replica is rank 0, one TPWorker actor is rank 1,
joined with gloo), the optional API key, and a dead TP worker ending its requests with an error."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import ray
from ray import serve

from tests.support.http import in_flight_then, sse_events
from tests.support.serve_pool import TP2_KEY as KEY

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tp2_app(serve_pool):
    """The pool's `sdar_tp2`: tp=2, behind an API key."""
    return serve_pool["sdar_tp2"]


def tp_stats(app) -> list[dict]:
    return serve.get_app_handle(app.name).engine_stats.remote().result()


BODIES = [
    {"prompt": "Hello world", "max_tokens": 24, "temperature": 0},
    {"prompt": "Question: what is 7 * 8? Answer:", "max_tokens": 30, "temperature": 0, "return_logprob": True},
    {"input_ids": [5, 17, 200, 33, 91], "max_tokens": 13, "temperature": 0},
]


def test_tp2_matches_tp1(served_apps, tp2_app):
    stats = tp_stats(tp2_app)
    assert [(s["tp"], s["executor"], s["tp_workers"], s["tp_backend"]) for s in stats] == [(2, "ray_tp", 1, "gloo")]
    for body in BODIES:
        one = httpx.post(served_apps["sdar"].url + "/generate", json=body, timeout=120).json()
        two = httpx.post(tp2_app.url + "/generate", json=body, headers=AUTH, timeout=120).json()
        assert two["output_ids"] == one["output_ids"]
        assert two["meta_info"]["step_map"] == one["meta_info"]["step_map"]
        assert two["text"] == one["text"]
        if body.get("return_logprob"):
            assert [row[1] for row in two["meta_info"]["output_token_logprobs"]] == two["output_ids"]
            assert [row[0] for row in two["meta_info"]["output_token_logprobs"]] == pytest.approx(
                [row[0] for row in one["meta_info"]["output_token_logprobs"]], abs=1e-4)


def test_api_key_enforced_on_every_route_but_health(tp2_app):
    url = tp2_app.url
    body = {"prompt": "Hi", "max_tokens": 4}
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    routes = (("POST", "/generate", body), ("POST", "/v1/completions", body), ("POST", "/v1/chat/completions", chat),
              ("GET", "/v1/models", None), ("GET", "/metrics", None))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, route, payload in routes:
            r = httpx.request(method, url + route, json=payload, headers=headers, timeout=60)
            assert r.status_code == 401, (route, headers, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/health", timeout=60).status_code == 200
    for method, route, payload in routes:
        assert httpx.request(method, url + route, json=payload, headers=AUTH, timeout=60).status_code == 200
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and sse_events(r.iter_lines())[-1] == "[DONE]"


def test_dead_tp_worker_errors_in_flight_requests_and_replica_is_replaced(tp2_app):
    (before,) = tp_stats(tp2_app)
    worker = ray.get_actor(before["tp_worker_names"][0], namespace=before["tp_namespace"])
    body = {"prompt": "Tell me a long story.", "max_tokens": 480, "temperature": 3.0, "seed": 1, "ignore_eos": True}
    elapsed, endings = asyncio.run(in_flight_then(tp2_app.url, body, lambda: ray.kill(worker), AUTH))
    print(f"in-flight requests ended {elapsed:.1f}s after the fault")
    for kind, result in endings:  # every one ends with an explicit error, none hangs or vanishes
        if kind == "stream":
            assert result[-1] == "[DONE]"
            assert result[-2]["meta_info"]["finish_reason"]["type"] == "error", result[-2]
        else:
            status, retry_after, err = result
            assert status == 503 and retry_after is not None, (status, err)
            assert err["error"]["type"] == "engine_unavailable", err
    # the health check fails, Serve replaces the replica (a fresh TP group), and requests succeed again
    deadline = time.monotonic() + 90
    while True:
        r = httpx.post(tp2_app.url + "/generate", json=BODIES[0], headers=AUTH, timeout=60)
        if r.status_code == 200:
            break
        assert r.status_code == 503 and time.monotonic() < deadline, r.text
        time.sleep(1)
    (after,) = tp_stats(tp2_app)
    assert after["replica"] != before["replica"] and after["tp_workers"] == 1
