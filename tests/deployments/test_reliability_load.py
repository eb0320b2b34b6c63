"""Load: 256 concurrent mixed requests over loopback against the real local Ray Serve
cluster -- DLLM generation on `sdar` (each body unary and streamed, seeded sampling or greedy),
input-token scoring on `qwen3` (two replicas) -- all in flight at once. None is lost, none is
duplicated, each response belongs to its request, streamed equals unary for the same seed, and the
engines end idle with every KV page free. The load generator is bench/load.py (which also produces
the figures in docs/reliability.md)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys

from tests.support.paths import ROOT
from tests.support.serve import wait_idle

_spec = importlib.util.spec_from_file_location("bench_load", ROOT / "bench/load.py")
load = sys.modules["bench_load"] = importlib.util.module_from_spec(_spec)  # bench/ is not an installed package
_spec.loader.exec_module(load)

N = 256


def test_256_concurrent_mixed_requests_none_lost_none_duplicated(served_apps):
    urls = {name: app.url for name, app in served_apps.items()}
    jobs = load.make_jobs(N, seed=3)
    assert len(jobs) == N and {j.kind for j in jobs} == {"unary", "stream", "score"}
    assert any(j.body.get("seed") is not None for j in jobs) and any(j.body.get("stream") for j in jobs)
    start = {a: wait_idle(a) for a in urls}
    results, wall = asyncio.run(load.run_jobs(urls, jobs))
    assert [r.job.index for r in results] == [j.index for j in jobs]
    problems = load.check(results)
    assert not problems, "\n".join(problems[:20])
    figures = load.summarize(results, wall)
    print(json.dumps(figures))
    assert figures["ok"] == N
    for a in urls:
        end = wait_idle(a)
        assert end["running"] + end["waiting"] == 0
        assert end["kv_pages_free"] == start[a]["kv_pages_free"] == end["kv_pages_total"]


def test_check_catches_lost_duplicated_and_swapped_responses():
    """The checker itself: it must flag what the load test claims it would."""
    jobs = load.make_jobs(16, seed=1)
    gen = [j for j in jobs if j.kind != "score"]
    a, b = gen[0], next(j for j in gen if j.pair != gen[0].pair)

    def fake(job, body_of=None, id_="x"):
        src = body_of or job
        meta = {"id": id_, "prompt_tokens": len(src.body["input_ids"]), "finish_reason": {"type": "length"},
                "input_token_logprobs": None}
        body = {"output_ids": [1] * src.body["max_tokens"], "meta_info": meta}
        return load.Result(job, 200, body, extra={"done": 1})

    assert any("lost" in p for p in load.check([load.Result(a, 503, {"error": {}})]))
    assert any("duplicated" in p for p in load.check([fake(a, id_="same"), fake(b, id_="same")]))
    swapped = load.check([fake(a, body_of=b, id_="1"), fake(b, body_of=a, id_="2")])
    assert len(set(map(len, (a.body["input_ids"], b.body["input_ids"])))) == 1 or any(
        "not its response" in p for p in swapped)
