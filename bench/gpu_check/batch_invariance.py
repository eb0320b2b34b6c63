"""Part 7, `batch_invariance`: one greedy request alone and inside a batch, weights drawn on the device."""

from __future__ import annotations

from pathlib import Path

from bench.gpu_check.engine_choice import EngineChoice
from bench.gpu_check.model_engine import bench_engine
from bench.gpu_check.random_weights import weights_on_device
from bench.measure import run_engine
from bench.models import BenchShape
from bench.workloads import Traffic


def batch_invariance(path: Path, shape: BenchShape, device: str, dtype: str, batch: int, traffic: Traffic,
                     choice: EngineChoice | None = None) -> dict:
    """One greedy request alone, then the same request with `batch - 1` others in flight: whether its tokens
    and step_map are the same, and the largest logprob difference over the tokens both runs share."""
    with weights_on_device():
        engine, prompts, params = bench_engine(path, shape, device, dtype, [batch], traffic, choice)
    params = [p.model_copy(update={"logprobs": 0}) for p in params]  # the chosen token's logprob alone
    alone = run_engine(engine, prompts[:1], params[:1], shape, 1).outputs[0]
    inside = run_engine(engine, prompts[:batch], params[:batch], shape, batch).outputs[0]
    shared = next((i for i, (a, b) in enumerate(zip(alone.token_ids, inside.token_ids)) if a != b),
                  min(len(alone.token_ids), len(inside.token_ids)))
    diffs = [abs(alone.logprobs[i][t] - inside.logprobs[i][t]) for i, t in enumerate(alone.token_ids[:shared])]
    return {"batch": batch, "dtype": dtype, "attention_backend": engine.executor.runner.backend.name,
            "tokens": len(alone.token_ids),
            "same_tokens": alone.token_ids == inside.token_ids, "same_step_map": alone.step_map == inside.step_map,
            "first_differing_token": None if alone.token_ids == inside.token_ids else shared,
            "max_logprob_diff": max(diffs, default=0.0),
            "mean_logprob_diff": sum(diffs) / len(diffs) if diffs else 0.0}
