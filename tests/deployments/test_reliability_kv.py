"""KV exhaustion over Serve: the `sdar_kv` app has 16 KV pages (64 tokens) and gets ten
concurrent requests needing about 9 pages each. The scheduler preempts and recomputes; every request
completes, and the outputs equal those of the unconstrained `sdar` app (192 pages, no preemption).
A request that could never fit in the cache is a clear 400 before anything runs."""

from __future__ import annotations

import asyncio
import random

import httpx

from deployments.sglang.serving import fold_cumulative_chunks
from tests.support.http import sse_events
from tests.support.serve import engine_totals, wait_idle
from tests.support.serve_pool import KV_ENGINE

N = 16
MAX_TOKENS = 24


def bodies() -> list[dict]:
    rng = random.Random(11)
    out = []
    for i in range(N):
        body = {"input_ids": [rng.randrange(5, 300) for _ in range(rng.randrange(5, 11))], "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "stream": i % 2 == 1, "return_step_trace": i % 4 == 0}
        body.update({"temperature": 0} if i % 3 else {"temperature": 0.9, "seed": 1000 + i, "top_k": 50})
        out.append(body)
    return out


async def run_all(url: str, reqs: list[dict]) -> list[dict]:
    async def one(client: httpx.AsyncClient, body: dict) -> dict:
        if not body["stream"]:
            r = await client.post(url, json=body)
            assert r.status_code == 200, r.text
            return r.json()
        async with client.stream("POST", url, json=body) as r:
            assert r.status_code == 200, await r.aread()
            events = sse_events([line async for line in r.aiter_lines()])
        assert events[-1] == "[DONE]"
        return fold_cumulative_chunks(events[:-1])

    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(one(client, b) for b in reqs))


def key(body: dict) -> tuple:
    mi = body["meta_info"]
    return body["output_ids"], body["text"], mi["step_map"], mi["finish_reason"], mi["step_trace"]


def test_more_work_than_pages_preempts_recomputes_and_matches_unconstrained(served_apps, reliability_apps):
    kv = reliability_apps["sdar_kv"]
    before = wait_idle(kv.name)
    assert before["kv_pages_total"] == KV_ENGINE["num_kv_blocks"] == before["kv_pages_free"]
    reqs = bodies()
    need = sum(-(-(len(b["input_ids"]) + MAX_TOKENS) // 4) for b in reqs)  # pages, at 4 tokens a page
    assert need > 4 * before["kv_pages_total"], "not enough pressure"
    got = asyncio.run(run_all(kv.url + "/generate", reqs))
    want = asyncio.run(run_all(served_apps["sdar"].url + "/generate", reqs))
    after = wait_idle(kv.name)
    assert after["preemptions"] > before["preemptions"], "the cache was never short"
    assert after["kv_pages_free"] == after["kv_pages_total"], "pages leaked through preemption"
    assert all(len(g["output_ids"]) == MAX_TOKENS and g["meta_info"]["finish_reason"]["type"] == "length"
               for g in got)
    assert [key(g) for g in got] == [key(w) for w in want]
    print(f"preemptions: {after['preemptions'] - before['preemptions']}")


def test_a_request_that_can_never_fit_is_a_clear_400(reliability_apps):
    kv = reliability_apps["sdar_kv"]
    capacity = KV_ENGINE["num_kv_blocks"] * KV_ENGINE["kv_block_size"]  # 64 tokens < max_model_len 512
    for stream in (False, True):
        body = {"input_ids": list(range(5, 45)), "max_tokens": capacity, "stream": stream}
        r = httpx.post(kv.url + "/generate", json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "max_tokens" and "never fit" in err["message"] and "KV pages" in err["message"], err
    # what does fit still runs, and nothing was left behind
    r = httpx.post(kv.url + "/generate", json={"input_ids": list(range(5, 45)), "max_tokens": 20,
                                               "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 20, r.text
    t = engine_totals(kv.name)
    assert t["kv_pages_free"] == t["kv_pages_total"] and t["running"] + t["waiting"] == 0
