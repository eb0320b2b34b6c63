"""Disconnects (issue 7): 100 SSE streams dropped by their clients at random points -- before the
response starts, after k deltas, mid-body -- ten at a time, over loopback against the real local
Ray Serve cluster. Every KV page comes back (free pages equal the start), nothing is left running,
and the engines keep serving."""

from __future__ import annotations

import asyncio
import random

import httpx
from conftest import engine_totals, sse_events, wait_idle

STREAMS = 100
CONCURRENCY = 10


async def one_stream(client: httpx.AsyncClient, url: str, i: int, rng: random.Random) -> str:
    """Open a stream and leave at a random point; returns how it ended."""
    body = {"input_ids": [rng.randrange(5, 300) for _ in range(rng.randrange(3, 24))], "max_tokens": 48,
            "ignore_eos": True, "stream": True, "temperature": rng.choice([0, 0.9]), "seed": i,
            "return_logprob": bool(i % 3 == 0), "top_logprobs_num": 2 if i % 3 == 0 else 0,
            "return_step_trace": bool(i % 5 == 0)}
    mode = rng.choice(["before_headers", "after_k_deltas", "after_k_deltas", "mid_bytes", "to_the_end"])
    if mode == "before_headers":  # the client gives up while the request is being admitted
        task = asyncio.ensure_future(client.post(url, json=body))
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return mode
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, await r.aread()
        if mode == "mid_bytes":  # leave in the middle of an SSE event
            async for _ in r.aiter_bytes(rng.randrange(1, 64)):
                break
            return mode
        lines: list[str] = []
        k = rng.randrange(0, 6)
        async for line in r.aiter_lines():
            lines.append(line)
            events = sse_events(lines)
            if mode == "after_k_deltas" and len(events) > k:
                return mode  # leaving the block closes the connection
        assert sse_events(lines)[-1] == "[DONE]"
        return mode


async def storm(urls: list[str], seed: int) -> list[str]:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def run(i: int) -> str:
        async with gate:
            return await one_stream(client, urls[i % len(urls)], i, random.Random(rng.random()))

    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(run(i) for i in range(STREAMS)))


def test_hundred_cancelled_streams_return_every_page(served_apps):
    apps = ["sdar", "qwen3"]
    start = {a: wait_idle(a) for a in apps}
    assert all(t["running"] + t["waiting"] == 0 for t in start.values()), start
    modes = asyncio.run(storm([served_apps[a].url + "/generate" for a in apps], seed=7))
    assert len(modes) == STREAMS and {"before_headers", "after_k_deltas", "mid_bytes"} <= set(modes), modes
    for a in apps:
        end = wait_idle(a, timeout=60)
        assert end["running"] + end["waiting"] == 0, f"{a}: requests left in the engine: {end}"
        assert end["kv_pages_free"] == start[a]["kv_pages_free"] == start[a]["kv_pages_total"], (start[a], end)
        assert end["replicas"] == start[a]["replicas"]
        # and it keeps serving, streamed and unary alike
        body = {"prompt": "Hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(served_apps[a].url + "/generate", json=body, timeout=60)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 8, r.text
        with httpx.stream("POST", served_apps[a].url + "/generate", json={**body, "stream": True}, timeout=60) as s:
            events = sse_events(s.iter_lines())
        assert events[-1] == "[DONE]" and sum(len(e["output_ids"]) for e in events[:-1]) == 8
        assert engine_totals(a)["kv_pages_free"] == start[a]["kv_pages_total"]
