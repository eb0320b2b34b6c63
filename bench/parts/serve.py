"""Part `serve`: the DLLM workload through Ray Serve HTTP against in-process (`bench.serving`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from bench.models import mask_id_of, stop_ids_of
from bench.plan import Plan, engine_config, num_requests
from bench.progress import log
from bench.serving import bench_serving
from bench.workloads import make_prompts


def bench_serve(path: Path, p: Plan) -> dict:
    """The DLLM workload at `serve_concurrency` through Ray Serve HTTP (on a throwaway local cluster) and
    in-process (wall clock)."""
    c = p.serve_concurrency
    n = num_requests(p, c)
    avoid = stop_ids_of(path) | {mask_id_of(path)}
    prompts, budgets = make_prompts(p.traffic, p.shape.vocab_size, avoid)
    warm_prompts, warm_budgets = make_prompts(replace(p.traffic, seed=p.traffic.seed + 2), p.shape.vocab_size, avoid)
    log(f"serve: dllm concurrency={c} requests={n}, in-process then over Ray Serve HTTP")
    return bench_serving(path, engine_config(), p.shape, prompts[:n], budgets[:n],
                         (warm_prompts[:c], warm_budgets[:c]), c)
