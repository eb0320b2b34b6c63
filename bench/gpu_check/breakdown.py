"""Where a model part's time went: forwards' device time, tokens per forward, a profiler table."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

from bench.measure import run_engine
from bench.models import BenchShape
from configs import GenerationConfig
from engine.core.llm_engine import LLMEngine


@contextmanager
def device_forward_timer(engine: LLMEngine) -> Iterator[list[float]]:
    """Device seconds of every forward (CUDA events around `executor.execute`, read after the run, so
    timing adds no synchronisation); an empty list off CUDA."""
    execute, pairs, seconds = engine.executor.execute, [], []

    def timed(batch):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = execute(batch)
        end.record()
        pairs.append((start, end))
        return out

    if torch.cuda.is_available():
        engine.executor.execute = timed
    try:
        yield seconds
    finally:
        engine.executor.execute = execute
        if pairs:
            torch.cuda.synchronize()
            seconds += [start.elapsed_time(end) / 1e3 for start, end in pairs]


def serve_and_break_down(engine: LLMEngine, prompts: list[list[int]], params: list[GenerationConfig],
                         shape: BenchShape, concurrency: int):
    """One engine run and where its time went: tokens per forward, forward device time against step
    wall time (the share the device spends in forwards; the rest is host work it waits for)."""
    runner = engine.executor.runner
    replays = runner.graphs.replays if runner.graphs is not None else 0
    with device_forward_timer(engine) as device_seconds:
        run = run_engine(engine, prompts, params, shape, concurrency)
    forward_device = sum(device_seconds) if device_seconds else None
    # graphs are switched off (None) when a capture fails
    graph_replays = runner.graphs.replays - replays if runner.graphs is not None else None
    return run, {
        "requests": len(prompts), "output_tokens": run.output_tokens, "seconds": run.seconds,
        "tokens_per_s": run.output_tokens / run.seconds, "forwards": run.forwards, "steps": run.steps,
        "tokens_per_forward": run.output_tokens / max(run.forwards, 1),
        "sequences_per_forward": run.seq_forwards / max(run.forwards, 1),
        "forward_host_seconds": run.forward_seconds, "forward_device_seconds": forward_device,
        "step_seconds": run.step_seconds,
        "forward_share_of_step_time": None if forward_device is None else forward_device / run.step_seconds,
        "cuda_graph_replays": graph_replays,
    }


def profile_steps(engine: LLMEngine, prompts: list[list[int]], params: list[GenerationConfig], steps: int,
                  rows: int = 15) -> dict:
    """A profiler table of `steps` engine steps once `prompts` are in flight and past their prefill: the
    top device kernels by device time and the top host ops by self CPU time. The requests are aborted
    afterwards."""
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    for _ in range(sum(map(len, prompts)) // engine.config.max_prefill_token_num + 2):
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    for rid in ids:  # leave the engine empty for whoever uses it next
        engine.abort(rid)
    events = prof.key_averages()

    def table(key: Callable, keep: Callable) -> list[dict]:
        chosen = sorted((e for e in events if keep(e)), key=key, reverse=True)[:rows]
        return [{"name": e.key[:80], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                 "device_ms": e.device_time_total / 1e3} for e in chosen]

    return {"steps": steps,
            "top_device_kernels": table(lambda e: e.self_device_time_total,
                                        lambda e: e.self_device_time_total > 0),
            "top_host_ops": table(lambda e: e.self_cpu_time_total, lambda e: e.self_cpu_time_total > 0)}
