"""The Ray Serve HTTP path against the in-process engine: the same requests, the same engine config.

In-process: `run_engine` drives `LLMEngine.step()` directly (no Ray, no HTTP). Served: `build_app` on a
local Ray cluster, the requests sent as `POST /generate` (greedy, token-id prompts) over loopback HTTP by
an asyncio client holding at most `concurrency` in flight, as `run_engine` does. Both are timed on the
wall clock from the first request to the last response (CPU time would miss the proxy, ingress and
replica processes), and their outputs are compared token for token.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.local_cluster import QUIET, local_serve
from bench.measure import run_engine
from bench.models import BenchShape
from configs import EngineConfig, GenerationConfig
from engine import pipeline


async def _send_all(url: str, prompts: list[list[int]], budgets: list[int], concurrency: int
                    ) -> tuple[list[list[int] | None], float]:
    """POST every request with at most `concurrency` in flight; the outputs (None on an error) and
    the wall seconds from the first send to the last response."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
        async def one(prompt: list[int], budget: int) -> list[int] | None:
            async with gate:
                r = await client.post(f"{url}/generate",
                                      json={"input_ids": prompt, "max_tokens": budget, "temperature": 0})
            return r.json()["output_ids"] if r.status_code == 200 else None

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(p, b) for p, b in zip(prompts, budgets)))
        return list(outs), time.perf_counter() - t0


def _serve_run(path: Path, engine: dict[str, Any], prompts: list[list[int]], budgets: list[int],
               warmup: tuple[list[list[int]], list[int]], concurrency: int, threads: int
               ) -> tuple[list[list[int] | None], float]:
    with contextlib.ExitStack() as stack:
        base_url = stack.enter_context(local_serve(num_cpus=4))
        # Ray only now: the cluster local_serve starts must be on loopback, which is settled before `import ray`
        from ray import serve

        from deployments.app import build_app

        # the replica gets the same torch thread count as the in-process engine
        actor = {"num_cpus": 1, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}}}
        serve.run(build_app({"model": str(path), "engine": engine, "ray_actor_options": actor}), name="bench",
                  route_prefix="/bench", logging_config=QUIET)
        stack.callback(serve.delete, "bench")
        url = f"{base_url}/bench"
        asyncio.run(_send_all(url, *warmup, concurrency))
        return asyncio.run(_send_all(url, prompts, budgets, concurrency))


def bench_serving(path: Path, config: EngineConfig, shape: BenchShape, prompts: list[list[int]],
                  budgets: list[int], warmup: tuple[list[list[int]], list[int]], concurrency: int
                  ) -> dict[str, Any]:
    """Tokens/s of the same greedy workload in-process and over Ray Serve HTTP, and their ratio. Both
    sides first serve the `warmup` requests (other prompts, so the prefix cache holds nothing of the
    timed ones): the allocator and Ray's lazy set-up are warm when the clock starts. The served side runs
    on a throwaway local cluster."""
    params = [GenerationConfig(max_new_tokens=m) for m in budgets]
    pipe = pipeline(str(path), config)
    run_engine(pipe.engine, warmup[0], [GenerationConfig(max_new_tokens=m) for m in warmup[1]], shape, concurrency)
    run = run_engine(pipe.engine, prompts, params, shape, concurrency)
    pipe.close()
    del pipe
    local = [o.token_ids for o in run.outputs]
    with contextlib.redirect_stdout(sys.stderr):  # Ray's messages: stdout carries only the figures
        served, seconds = _serve_run(path, config.model_dump(), prompts, budgets, warmup, concurrency,
                                     torch.get_num_threads())
    served_tokens = sum(len(o) for o in served if o is not None)
    local_rate = run.output_tokens / run.seconds
    served_rate = served_tokens / seconds
    return {
        "requests": len(prompts), "concurrency": concurrency,
        "in_process": {"output_tokens": run.output_tokens, "seconds": round(run.seconds, 3),
                       "tokens_per_s": round(local_rate, 3)},
        "http": {"output_tokens": served_tokens, "seconds": round(seconds, 3),
                 "tokens_per_s": round(served_rate, 3), "errors": sum(o is None for o in served)},
        "ratio_http_vs_in_process": round(served_rate / local_rate, 3),
        "match_rate": round(sum(a == b for a, b in zip(local, served)) / len(prompts), 3),
    }
