"""What a long RL run relies on, over a real Serve application on the tiny SDAR checkpoint:
a request that spans an in-place pause and a weight update names every version it ran under (each
chunk its own, the final body all of them, `weight_version` the last); the pause answer counts the
requests it paused; tensors sent by reference reach the engine replicas without the ingress loading
torch; a stream the engine side cuts short still ends with an explicit error."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest
from ray import serve

from bench.soak.probe import app_processes
from tests.support.http import in_flight_then
from tests.support.serve import wait_idle

LONG = {"input_ids": [5, 17, 200, 33, 9], "max_tokens": 480, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def wv_app(serve_pool):
    """The pool's `sdar_drills` (the fault-drill hooks hold the loop still and cut a stream short)."""
    return serve_pool["sdar_drills"]


def test_a_request_spanning_an_in_place_update_names_every_version(wv_app):
    """Two streams and two unary requests in flight; the engine loop held still (so none can finish
    meanwhile), then pause in_place, an update from disk, continue."""
    old = httpx.get(wv_app.url + "/get_weight_version").json()["weight_version"]
    engine = serve.get_deployment_handle("EngineServer", wv_app.name)
    answers = {}

    def pause_update_continue() -> None:
        engine.debug_stall.remote(1.0).result()
        answers["pause"] = httpx.post(wv_app.url + "/pause_generation", json={"mode": "in_place"}, timeout=60).json()
        answers["update"] = httpx.post(wv_app.url + "/update_weights_from_disk", timeout=120, json={
            "model_path": wv_app.model, "weight_version": "after-pause"}).json()
        answers["continue"] = httpx.post(wv_app.url + "/continue_generation", timeout=60).json()

    _, endings = asyncio.run(in_flight_then(wv_app.url, LONG, pause_update_continue))
    assert answers["update"]["success"] and answers["continue"]["success"], answers
    assert answers["pause"]["success"] and answers["pause"]["requests"] == 4, answers["pause"]  # all in flight
    bodies = []
    for kind, result in endings:
        if kind == "unary":
            assert result[0] == 200, result
            bodies.append(result[2])
            continue
        assert result[-1] == "[DONE]"
        chunks = result[:-1]
        per_chunk = [c["meta_info"]["weight_version"] for c in chunks]
        assert per_chunk[0] == old and per_chunk[-1] == "after-pause", per_chunk
        switch = per_chunk.index("after-pause")
        assert set(per_chunk[:switch]) == {old} and set(per_chunk[switch:]) == {"after-pause"}
        bodies.append(chunks[-1])  # cumulative stream: the last chunk is the whole body
    for body in bodies:
        meta = body["meta_info"]
        assert meta["finish_reason"]["type"] == "length"
        assert meta["weight_versions"] == [old, "after-pause"] and meta["weight_version"] == "after-pause"
    # a request that ran under one version lists just that one
    after = httpx.post(wv_app.url + "/generate", json={**LONG, "max_tokens": 8}, timeout=120).json()["meta_info"]
    assert after["weight_versions"] == ["after-pause"] and after["weight_version"] == "after-pause"


def test_tensors_by_reference_reach_the_engine_without_torch_in_the_ingress(wv_app):
    import ray
    from safetensors.torch import load_file

    tensors = load_file(str(Path(wv_app.model) / "model.safetensors"))
    name = "model.norm.weight"
    h = serve.get_app_handle(wv_app.name)
    answer = h.update_weights_from_tensor.remote(
        {"named_tensors": ray.put([[name, tensors[name]]]), "weight_version": "by-ref"}).result()
    assert answer["success"] and answer["weight_version"] == "by-ref", answer
    body = httpx.post(wv_app.url + "/generate", json={**LONG, "max_tokens": 4}, timeout=120).json()
    assert body["meta_info"]["weight_version"] == "by-ref"
    (ingress,) = [p.pid for p in app_processes(wv_app.name, os.getpid()) if p.role == "ingress"]
    maps = Path(f"/proc/{ingress}/maps").read_text()
    assert "libtorch" not in maps, "the ingress process loaded torch"


def test_a_stream_cut_short_on_the_engine_side_ends_with_an_explicit_error(wv_app):
    """The engine side ends a stream without its finishing delta: the client still gets a last chunk
    with a finish reason, an explicit error, before [DONE]; the engine holds nothing afterwards."""
    engine = serve.get_deployment_handle("EngineServer", wv_app.name)
    events = []
    with httpx.stream("POST", wv_app.url + "/generate", json={**LONG, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if len(events) == 1:
                    assert engine.debug_cut_streams.remote().result() == 1
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])["meta_info"]
    assert last["finish_reason"] is not None, "the stream ended without a finish reason"
    assert last["finish_reason"]["type"] == "error" and "without finishing" in last["finish_reason"]["message"]
    assert wait_idle(wv_app.name)["running"] == 0
