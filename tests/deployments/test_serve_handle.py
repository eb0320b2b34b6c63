"""Serve handles from another Ray job, and data-parallel replicas."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx
from ray import serve

from deployments.sglang.serving import fold_cumulative_chunks
from tests.support.http import sse_events, without_ids
from tests.support.paths import ROOT

DRIVER = r"""
import json, sys
import ray
from ray import serve

ray.init(address=sys.argv[3], logging_level="error", log_to_driver=False)
h = serve.get_app_handle(sys.argv[1])
body = json.loads(sys.argv[2])
unary = h.generate.remote(body).result()
deltas = [d for d in h.options(stream=True).generate_stream.remote(body)]
bad = h.generate.remote({"prompt": "x", "nope": 1}).result()
bad_stream = list(h.options(stream=True).generate_stream.remote({"prompt": "x", "max_tokens": 10**6}))
ids = {"input_ids": (5, 17, 200, 33), "max_tokens": 5, "temperature": 0}  # a tuple: validated as JSON would be
from_tuple = h.generate.remote(ids).result()
print("RESULT " + json.dumps({"unary": unary, "deltas": deltas, "bad": bad, "bad_stream": bad_stream,
                              "from_tuple": from_tuple}))
"""


def test_handle_and_streaming_handle_from_another_driver(serve_cluster, served_apps):
    app = served_apps["sdar"]
    body = {"prompt": "Hello", "max_tokens": 16, "temperature": 0, "return_logprob": True, "top_logprobs_num": 1,
            "return_step_trace": True}
    proc = subprocess.run([sys.executable, "-c", DRIVER, app.name, json.dumps(body), serve_cluster.address],
                          capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    http = httpx.post(app.url + "/generate", json=body, timeout=120).json()
    assert without_ids(out["unary"]) == without_ids(http)
    assert len(out["deltas"]) > 1
    assert without_ids(fold_cumulative_chunks(out["deltas"])) == without_ids(http)
    assert len(http["meta_info"]["step_map"]) == len(http["output_ids"]) == 16
    with httpx.stream("POST", app.url + "/generate", json={**body, "stream": True}, timeout=120) as r:
        sse = sse_events(r.iter_lines())[:-1]
    assert [without_ids(d) for d in sse] == [without_ids(d) for d in out["deltas"]]  # same deltas as SSE
    assert out["bad"]["error"]["param"] == "nope"
    assert len(out["bad_stream"]) == 1 and out["bad_stream"][0]["error"]["param"] == "max_tokens"
    from_list = httpx.post(app.url + "/generate", json={"input_ids": [5, 17, 200, 33], "max_tokens": 5,
                                                         "temperature": 0}, timeout=120).json()
    assert without_ids(out["from_tuple"]) == without_ids(from_list)


def metric(app, name: str) -> float:
    text = httpx.get(app.url + "/metrics", timeout=60).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_two_replicas_serve_concurrently(served_apps):
    app = served_apps["qwen3"]
    handle = serve.get_app_handle(app.name)
    before = {s["replica"]: s["generated_tokens"] for s in handle.engine_stats.remote().result()}
    assert len(before) == 2
    body = {"prompt": "Count: 1 2 3", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    reference = without_ids(httpx.post(app.url + "/generate", json=body, timeout=120).json())
    batches = metric(app, "blockserve_ingress_batches_total")
    batched = metric(app, "blockserve_ingress_batched_requests_total")

    async def one(client: httpx.AsyncClient, stream: bool) -> dict:
        if not stream:
            r = await client.post(app.url + "/generate", json=body)
            return r.json()
        async with client.stream("POST", app.url + "/generate", json={**body, "stream": True}) as r:
            events = sse_events([line async for line in r.aiter_lines()])
        assert events[-1] == "[DONE]"
        return fold_cumulative_chunks(events[:-1])

    async def main() -> list[dict]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, stream=i % 4 != 0) for i in range(16)))

    results = asyncio.run(main())
    assert all(without_ids(r) == reference for r in results)
    after = {s["replica"]: s["generated_tokens"] for s in handle.engine_stats.remote().result()}
    assert set(after) == set(before)
    assert all(after[r] > before[r] for r in after), (before, after)
    # the 4 concurrent unary requests went to the engine in fewer @serve.batch calls
    assert metric(app, "blockserve_ingress_batched_requests_total") - batched == 4
    assert metric(app, "blockserve_ingress_batches_total") - batches < 4
