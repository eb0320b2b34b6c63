"""Prefix-aware routing vs Serve's default router (`python -m bench.prefix_routing`).

8 shared system prompts x 64 requests each (a system prompt of `--system-tokens` token ids, then a
16-token user part of its own), shuffled, streamed over loopback HTTP with at most `--concurrency`
in flight, to `--replicas` (4) EngineServer replicas of a tiny Qwen3 with prefix caching. Each router gets a
fresh application (cold caches). Reported per router: the prefix-cache hit rate (prompt tokens
served from cached pages / prompt tokens, summed over the replicas' engine stats), requests per
second (wall clock, first send to last byte), how the requests spread over the replicas, and how
many failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.local_cluster import QUIET, local_serve

ENGINE = {"max_model_len": 512, "kv_block_size": 16, "num_kv_blocks": 256, "max_batch_size": 32}


def workload(prompts: int, per_prompt: int, system_tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(10, 380) for _ in range(system_tokens)] for _ in range(prompts)]
    jobs = [s + [rng.randrange(10, 380) for _ in range(16)] for s in systems for _ in range(per_prompt)]
    rng.shuffle(jobs)
    return jobs


async def _send(url: str, jobs: list[list[int]], concurrency: int, max_tokens: int) -> tuple[int, float]:
    """Stream every job (at most `concurrency` at once): (failed requests, wall seconds)."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=300.0, limits=limits) as client:
        async def one(ids: list[int]) -> bool:
            body = {"input_ids": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            async with gate, client.stream("POST", url + "/generate", json=body) as r:
                text = "".join([line async for line in r.aiter_lines()])
            return r.status_code == 200 and "[DONE]" in text and '"error"' not in text

        t0 = time.perf_counter()
        ok = await asyncio.gather(*(one(j) for j in jobs))
        return ok.count(False), time.perf_counter() - t0


def _totals(app: str) -> list[dict[str, Any]]:
    from ray import serve

    return serve.get_app_handle(app).engine_stats.remote().result()


def run_router(base_url: str, ckpt: Path, router: str, jobs: list[list[int]], concurrency: int,
               max_tokens: int, replicas: int = 4) -> dict[str, Any]:
    from ray import serve

    from deployments.app import build_app

    app = f"bench_{router}"
    serve.run(build_app({"model": str(ckpt), "engine": ENGINE, "num_replicas": replicas, "request_router": router,
                         "ray_actor_options": {"num_cpus": 1}}),
              name=app, route_prefix=f"/{app}", logging_config=QUIET)
    try:
        failed, wall = asyncio.run(_send(f"{base_url}/{app}", jobs, concurrency, max_tokens))
        stats = _totals(app)
    finally:
        serve.delete(app)
    prompt = sum(s["prompt_tokens"] for s in stats)
    hit = sum(s["prefix_hit_tokens"] for s in stats)
    return {"router": router, "requests": len(jobs), "failed": failed, "wall_s": round(wall, 2),
            "requests_per_s": round(len(jobs) / wall, 2), "prefix_hit_rate": round(hit / max(prompt, 1), 4),
            "prompt_tokens": prompt, "prefix_hit_tokens": hit,
            "prompt_tokens_per_replica": sorted((s["prompt_tokens"] for s in stats), reverse=True)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--per-prompt", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=192)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicas", type=int, default=4)
    a = p.parse_args(argv)
    from testing.tiny_checkpoint import write_tiny_checkpoint

    jobs = workload(a.prompts, a.per_prompt, a.system_tokens, a.seed)
    with tempfile.TemporaryDirectory() as tmp, local_serve(num_cpus=8) as base_url:
        ckpt = write_tiny_checkpoint(Path(tmp) / "qwen3", model_type="qwen3")
        results = [run_router(base_url, ckpt, router, jobs, a.concurrency, a.max_tokens, a.replicas)
                   for router in ("prefix_aware", "power_of_two")]
    print(json.dumps({"args": vars(a), "results": results}, indent=1))
    return 0 if all(r["failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
