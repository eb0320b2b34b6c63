"""RL control over Ray Serve: a trainer in another Ray driver updates the weights of every engine
replica by disk (HTTP), tensors (handle) and a gloo broadcast; refused updates change nothing
anywhere; pause modes with requests in flight; the per-request fields over every hop.

One application, two tp=1 engine replicas (tp=2 on two replicas is too heavy for a 2-core runner;
tests/engine/test_weight_sync.py covers tp=2 ranks of one engine)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from ray import serve

from configs import EngineConfig, GenerationConfig
from deployments.sglang.serving import merge_generate_deltas
from engine.offline import pipeline
from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint
from tests.support.http import sse_events, without_ids
from tests.support.paths import ROOT
from tests.support.ray_env import SERVE_ENGINE
from tests.support.serve import deploy

PROMPT = [5, 17, 200, 33, 9, 41]
ROLLOUT = {"input_ids": PROMPT, "max_tokens": 12, "temperature": 0, "return_logprob": True}

TRAINER = r"""
import json, socket, sys, threading
import httpx, ray, torch
import torch.distributed as dist
from ray import serve
from safetensors.torch import load_file
from engine.worker.update_group import init_custom_process_group

app, url, address, disk, tensors_dir, broadcast_dir, body = sys.argv[1:8]
body = json.loads(body)
ray.init(address=address, logging_level="error", log_to_driver=False)
h = serve.get_app_handle(app)
out = {"before": h.generate.remote(body).result()}

out["disk"] = httpx.post(url + "/update_weights_from_disk", json={"model_path": disk, "weight_version": "v-disk"},
                         timeout=300).json()
out["after_disk"] = [r.result() for r in [h.generate.remote(body) for _ in range(4)]]

tensors = load_file(tensors_dir + "/model.safetensors")
out["tensor"] = h.update_weights_from_tensor.remote(
    {"named_tensors": [[n, t] for n, t in tensors.items()], "weight_version": "v-tensor"}).result()
out["after_tensor"] = [r.result() for r in [h.generate.remote(body) for _ in range(4)]]

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
group_args = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "group_name": "g",
              "backend": "gloo"}
out["bad_world"] = h.init_weights_update_group.remote({**group_args, "world_size": 2}).result()
joined = h.init_weights_update_group.remote({**group_args, "world_size": 3})  # 1 trainer + 2 replicas x tp=1
group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 3, 0, "g", timeout_s=120)
out["init"] = joined.result()
new = {n: t.float() for n, t in load_file(broadcast_dir + "/model.safetensors").items()}
pushed = h.update_weights_from_distributed.remote({"names": list(new), "dtypes": ["float32"] * len(new),
                                                   "shapes": [list(t.shape) for t in new.values()],
                                                   "group_name": "g", "weight_version": "v-dist"})
for t in new.values():
    dist.broadcast(t, src=0, group=group)
out["distributed"] = pushed.result()
out["after_distributed"] = [r.result() for r in [h.generate.remote(body) for _ in range(4)]]

# over HTTP, one flattened broadcast (SGLang's flattened_bucket: every tensor's bytes in `names` order)
flat = {n: t.float() for n, t in load_file(disk + "/model.safetensors").items()}
answer = {}
posted = threading.Thread(target=lambda: answer.update(httpx.post(url + "/update_weights_from_distributed", json={
    "names": list(flat), "dtypes": ["float32"] * len(flat), "shapes": [list(t.shape) for t in flat.values()],
    "group_name": "g", "load_format": "flattened_bucket", "weight_version": "v-flat"}, timeout=300).json()))
posted.start()
dist.broadcast(torch.cat([t.flatten().view(torch.uint8) for t in flat.values()]), src=0, group=group)
posted.join()
out["flattened"] = answer
out["after_flattened"] = [r.result() for r in [h.generate.remote(body) for _ in range(4)]]
out["destroy"] = h.destroy_weights_update_group.remote({"group_name": "g"}).result()
out["version"] = h.get_weight_version.remote({}).result()

fields = json.loads(sys.argv[8])
out["fields"] = h.generate.remote(fields).result()
out["fields_deltas"] = list(h.options(stream=True).generate_stream.remote(fields))
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("rl")
    return {name: str(write_tiny_checkpoint(root / name, model_type="sdar", seed=seed,
                                            logit_scale=DLLM_TEST_LOGIT_SCALE))
            for name, seed in (("old", 5), ("disk", 11), ("tensor", 12), ("broadcast", 13))}


@pytest.fixture(scope="module")
def rl_app(serve_cluster, ckpts):
    # streams deltas (SGLang's incremental_streaming_output): they concatenate to the unary body
    app = deploy(serve_cluster, "rl", Path(ckpts["old"]), dict(SERVE_ENGINE), num_replicas=2, drills=True,
                 hold_timeout_s=3.0, incremental_streaming_output=True)
    yield app
    serve.delete(app.name)


def _reference(ckpt: str, body: dict) -> dict:
    """A fresh offline engine on `ckpt`: the rollout the served replicas must now give."""
    with pipeline(ckpt, EngineConfig(**SERVE_ENGINE)) as pipe:
        r = pipe(body["input_ids"], GenerationConfig(max_new_tokens=body["max_tokens"], do_sample=False, logprobs=0))
    return {"ids": r.token_ids, "step_map": r.step_map, "logprobs": [next(iter(e.values())) for e in r.logprobs]}


def _assert_rollout(body: dict, ref: dict, version: str) -> None:
    meta = body["meta_info"]
    assert body["output_ids"] == ref["ids"] and meta["step_map"] == ref["step_map"]
    rows = meta["output_token_logprobs"]
    assert [t for _, t, _ in rows] == ref["ids"]
    assert [v for v, _, _ in rows] == pytest.approx(ref["logprobs"], abs=1e-5)
    assert meta["weight_version"] == version


def _stats(app) -> list[dict]:
    return serve.get_app_handle(app.name).engine_stats.remote().result()


FIELDS = {"input_ids": PROMPT, "max_tokens": 10, "temperature": 0, "return_block_step_map": True,
          "return_dllm_replay": True, "return_logprob": True, "dllm_unmasking_strategy": "low_confidence_static",
          "dllm_denoising_steps": 2}


def test_trainer_updates_every_replica_by_disk_tensor_and_broadcast(serve_cluster, rl_app, ckpts):
    proc = subprocess.run([sys.executable, "-c", TRAINER, rl_app.name, rl_app.url, serve_cluster.address,
                           ckpts["disk"], ckpts["tensor"], ckpts["broadcast"], json.dumps(ROLLOUT), json.dumps(FIELDS)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    _assert_rollout(out["before"], _reference(ckpts["old"], ROLLOUT), "default")  # prefix cache warm from here on
    for path, ckpt, version in (("disk", "disk", "v-disk"), ("tensor", "tensor", "v-tensor"),
                                ("distributed", "broadcast", "v-dist"), ("flattened", "disk", "v-flat")):
        assert out[path]["success"] is True and out[path]["num_replicas"] == 2, out[path]
        assert out[path]["weight_version"] == version
        ref = _reference(ckpts[ckpt], ROLLOUT)
        for body in out[f"after_{path}"]:
            _assert_rollout(body, ref, version)
    assert out["bad_world"]["success"] is False and out["bad_world"]["error"]["param"] == "world_size"
    assert out["init"]["ranks"] == [1, 2] and out["destroy"]["success"] is True
    assert out["version"] == {"weight_version": "v-flat"}
    assert sorted(s["weight_version"] for s in _stats(rl_app)) == ["v-flat", "v-flat"]
    # the same fields from another Ray job as over HTTP (unary, SSE deltas)
    http = httpx.post(rl_app.url + "/generate", json=FIELDS, timeout=120).json()
    assert without_ids(out["fields"]) == without_ids(http)
    assert without_ids(merge_generate_deltas(out["fields_deltas"])) == without_ids(http)


def test_refused_update_changes_nothing_anywhere(rl_app, ckpts):
    before = httpx.post(rl_app.url + "/generate", json=ROLLOUT, timeout=120).json()
    version = before["meta_info"]["weight_version"]
    h = serve.get_app_handle(rl_app.name)
    import torch

    wrong = h.update_weights_from_tensor.remote(
        {"named_tensors": [["model.norm.weight", torch.ones(64)], ["model.embed_tokens.weight", torch.ones(3, 3)]],
         "weight_version": "never"}).result()
    assert wrong["success"] is False and "model.embed_tokens.weight" in wrong["message"], wrong
    # one replica fails while staging a valid checkpoint: the other staged it, and discards it
    serve.get_deployment_handle("EngineServer", rl_app.name).debug_fail_next_stage.remote("injected failure").result()
    r = httpx.post(rl_app.url + "/update_weights_from_disk", json={"model_path": ckpts["disk"],
                                                                  "weight_version": "never"}, timeout=300)
    assert r.status_code == 400 and r.json()["success"] is False
    assert "injected failure" in r.json()["message"] and "replica" in r.json()["message"]
    http_tensor = httpx.post(rl_app.url + "/update_weights_from_tensor", json={"serialized_named_tensors": ["x"]})
    assert http_tensor.status_code == 400 and "handle" in http_tensor.json()["message"]
    assert [s["weight_version"] for s in _stats(rl_app)] == [version, version]
    for _ in range(4):
        after = httpx.post(rl_app.url + "/generate", json=ROLLOUT, timeout=120).json()
        assert without_ids(after) == without_ids(before)


LONG = {"input_ids": [7, 8, 9], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "dllm_denoising_steps": 4}


async def _pause_with_requests_in_flight(app, mode: str) -> tuple[list[dict], bool]:
    """Two HTTP streams, two HTTP unary, one handle stream and one handle unary request in flight,
    then pause_generation(mode) (and continue_generation after a while). Returns their bodies
    (streams: deltas concatenated) and whether any request ended while paused (retract, in_place)."""
    h = serve.get_app_handle(app.name)
    async with httpx.AsyncClient(timeout=300) as client:
        started = asyncio.Event()

        async def http_stream() -> dict:
            async with client.stream("POST", app.url + "/generate", json={**LONG, "stream": True}) as r:
                lines = []
                async for line in r.aiter_lines():
                    lines.append(line)
                    started.set()
            return merge_generate_deltas(sse_events(lines)[:-1])

        async def http_unary() -> dict:
            return (await client.post(app.url + "/generate", json=LONG)).json()

        async def handle_stream() -> dict:
            return merge_generate_deltas([d async for d in h.options(stream=True).generate_stream.remote(LONG)])

        async def handle_unary() -> dict:
            return await h.generate.remote(LONG)

        tasks = [asyncio.ensure_future(c()) for c in (http_stream, http_stream, http_unary, http_unary,
                                                      handle_stream, handle_unary)]
        await asyncio.wait_for(started.wait(), 120)
        await asyncio.sleep(0.3)
        paused = (await client.post(app.url + "/pause_generation", json={"mode": mode})).json()
        assert paused["success"] is True and paused["num_replicas"] == 2, paused
        ended_while_paused = False
        if mode != "abort":
            await asyncio.sleep(1.0)
            ended_while_paused = any(t.done() for t in tasks)
        assert (await client.post(app.url + "/continue_generation")).json()["success"] is True
        return list(await asyncio.gather(*tasks)), ended_while_paused


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_modes_with_requests_in_flight(rl_app, mode):
    full = httpx.post(rl_app.url + "/generate", json=LONG, timeout=300).json()["output_ids"]
    bodies, ended_while_paused = asyncio.run(_pause_with_requests_in_flight(rl_app, mode))
    for body in bodies:
        ids, reason = body["output_ids"], body["meta_info"]["finish_reason"]["type"]
        if mode == "abort":  # partial outputs: a prefix of the whole rollout
            assert reason == "abort" and len(ids) < len(full) and ids == full[:len(ids)], body["meta_info"]
        else:  # every request finished, nothing lost or repeated
            assert reason == "length" and ids == full
    assert not ended_while_paused


def test_held_request_gets_503_with_retry_after(rl_app):
    assert httpx.post(rl_app.url + "/pause_generation", json={"mode": "in_place"}).json()["success"]
    try:
        r = httpx.post(rl_app.url + "/generate", json=ROLLOUT, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["type"] == "engine_held"
        assert r.headers["retry-after"] == "3"
    finally:
        httpx.post(rl_app.url + "/continue_generation")


def test_new_fields_over_http_sse_openai_and_metrics(rl_app):
    unary = httpx.post(rl_app.url + "/generate", json=FIELDS, timeout=120).json()
    meta = unary["meta_info"]
    n = len(unary["output_ids"])
    assert len(meta["block_step_map"]) == n and all(1 <= s <= 2 for s in meta["block_step_map"])
    assert meta["dllm_stop_length"] is not None and len(meta["dllm_replay_token_ids"]) == 4
    assert meta["dllm_num_steps"] == max(meta["step_map"]) and meta["dllm_tokens_per_step"] == n / meta[
        "dllm_num_steps"]
    with httpx.stream("POST", rl_app.url + "/generate", json={**FIELDS, "stream": True}, timeout=120) as r:
        deltas = sse_events(r.iter_lines())[:-1]
    assert len(deltas) > 1 and without_ids(merge_generate_deltas(deltas)) == without_ids(unary)
    native = {"input_ids": PROMPT, "return_block_step_map": True, "return_dllm_replay": True, "return_logprob": True,
              "sampling_params": {k: FIELDS[k] for k in ("temperature", "dllm_unmasking_strategy",
                                                         "dllm_denoising_steps")} | {"max_new_tokens": 10}}
    assert without_ids(httpx.post(rl_app.url + "/generate", json=native, timeout=120).json()) == without_ids(unary)
    bad = httpx.post(rl_app.url + "/generate", json={**FIELDS, "dllm_block_length": 8}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dllm_block_length"
    completion = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "return_block_step_map": True,
                  "return_dllm_replay": True, "dllm_unmasking_strategy": "low_confidence_static",
                  "dllm_denoising_steps": 2}
    choice = httpx.post(rl_app.url + "/v1/completions", json=completion, timeout=120).json()["choices"][0]
    for key in ("step_map", "block_step_map", "dllm_replay_token_ids", "dllm_replay_step_maps", "dllm_stop_length",
                "dllm_num_steps", "weight_version"):
        assert choice[key] == meta[key], key
    models = httpx.get(rl_app.url + "/v1/models").json()["data"][0]
    assert models["weight_version"] == meta["weight_version"]
    assert httpx.get(rl_app.url + "/get_weight_version").json() == {"weight_version": meta["weight_version"]}
    metrics = httpx.get(rl_app.url + "/metrics").text
    counts = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("blockserve_request_queue_time_seconds_count")]
    assert counts and sum(counts) >= 3


def test_trainer_payloads_with_sglang_types_and_semantics(rl_app, ckpts):
    """What AReaL and verl send: a numeric weight_version (kept as its string), an update that names
    none (the version stays), `abort_all_requests`, `master_port` as a string; memory tags as SGLang
    (none or [] = all, `cuda_graph` accepted); a group nobody joins fails within its timeout naming who."""
    url = rl_app.url
    r = httpx.post(url + "/update_weights_from_disk", json={"model_path": ckpts["old"], "weight_version": 7,
                                                             "abort_all_requests": True}, timeout=300).json()
    assert r["success"] is True and r["weight_version"] == "7", r
    r = httpx.post(url + "/update_weights_from_disk", json={"model_path": ckpts["old"]}, timeout=300).json()
    assert r["success"] is True and r["weight_version"] == "7", r
    assert httpx.get(url + "/get_weight_version").json() == {"weight_version": "7"}
    assert httpx.get(url + "/get_model_info").json()["weight_version"] == "7"
    # areal/engine/sglang_remote.py (inclusionAI/AReaL 4aef98d8), lines 261-268: the group payload
    areal_group = {"master_address": "127.0.0.1", "master_port": "29500", "rank_offset": 1, "world_size": 2,
                   "backend": "gloo", "group_name": "areal"}
    r = httpx.post(url + "/init_weights_update_group", json=areal_group, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "world_size", r.text  # 2 replicas: world 3
    r = httpx.post(url + "/update_weights_from_distributed", json={"names": ["x"], "dtypes": ["float32"],
                                                                    "shapes": [[1]], "load_format": "bogus"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "load_format", r.text
    for tags in ([], ["cuda_graph"], None, ["weights", "kv_cache", "cuda_graph"]):
        for op in ("release_memory_occupation", "resume_memory_occupation"):
            r = httpx.post(url + f"/{op}", json={"tags": tags}, timeout=120)
            assert r.status_code == 200 and r.json()["success"] is True, (tags, op, r.text)
    body = httpx.post(url + "/generate", json=ROLLOUT, timeout=120).json()
    _assert_rollout(body, _reference(ckpts["old"], ROLLOUT), "7")
    with socket.socket() as s:  # a port nobody listens on: no trainer hosts the group's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lonely = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3,
              "backend": "gloo", "group_name": "lonely", "timeout_s": 3}
    r = httpx.post(url + "/init_weights_update_group", json=lonely, timeout=300)
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert "rank 0" in r.json()["message"] and "never connected" in r.json()["message"], r.text
