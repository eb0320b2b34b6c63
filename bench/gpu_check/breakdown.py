"""Where a model part's time went: forwards' device time, tokens per forward, CUDA graph use, kernel
launches per step, a profiler table."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

from bench.measure import run_engine
from bench.models import BenchShape
from configs import GenerationConfig
from engine.core.llm_engine import LLMEngine

# The host-side events of a launch onto the device (CUDA runtime and driver API; a graph replay is one
# launch). Matched as prefixes: cudaLaunchKernelExC and cuLaunchKernelEx (Triton's launcher) count too.
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cuGraphLaunch")


@dataclass
class ForwardLog:
    """Per forward of a run: its device seconds (CUDA events; empty off CUDA) and the engine step it
    ran in, with whether it fed a prefill chunk."""

    device_seconds: list[float] = field(default_factory=list)
    steps: dict[int, bool] = field(default_factory=dict)  # engine step -> whether any forward of it prefilled

    @property
    def steps_after_prefill(self) -> int:
        return sum(not prefilled for prefilled in self.steps.values())


def feeds_prefill(q_lens: list[int], block_length: int | None) -> bool:
    """Whether a forward feeds a prompt chunk: a sequence feeding more rows than a decode step does (one
    token; a DLLM denoising step feeds at most two blocks, a commit fused with the next block)."""
    return max(q_lens, default=0) > (2 * block_length if block_length else 1)


@contextmanager
def forward_log(engine: LLMEngine) -> Iterator[ForwardLog]:
    """Logs every forward of `engine` inside the block: CUDA events around `executor.execute`, read after
    the run so timing adds no synchronisation, and the engine step each forward belongs to (the engine
    counts a step once its forwards ran, so `stats.steps` names the step in progress)."""
    execute, pairs, log = engine.executor.execute, [], ForwardLog()
    block_length = getattr(engine.executor.runner, "dllm_block_length", None)
    cuda = torch.cuda.is_available()

    def logged(batch):
        step = engine.stats.steps
        log.steps[step] = log.steps.get(step, False) or feeds_prefill(batch.q_lens, block_length)
        if not cuda:
            return execute(batch)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = execute(batch)
        end.record()
        pairs.append((start, end))
        return out

    engine.executor.execute = logged
    try:
        yield log
    finally:
        engine.executor.execute = execute
        if pairs:
            torch.cuda.synchronize()
            log.device_seconds += [start.elapsed_time(end) / 1e3 for start, end in pairs]


def graph_counters(runner) -> dict[str, int | None]:
    """The runner's CUDA graph replays and captures so far; None where graphs are off (not enabled, or
    switched off after a failed capture) or the runner does not count them."""
    graphs = getattr(runner, "graphs", None)
    return {name: getattr(graphs, name, None) for name in ("replays", "captures")}


def graph_report(runner, before: dict[str, int | None]) -> dict:
    """Graph replays and captures since `before` (None where either count is missing: graphs off or
    switched off meanwhile), and why graphs were switched off, if they were."""
    after = graph_counters(runner)
    delta = {name: None if before[name] is None or after[name] is None else after[name] - before[name]
             for name in before}
    return {"graph_replays": delta["replays"], "graph_captures": delta["captures"],
            "graph_failure": getattr(runner, "graph_failure", None)}


def per_forward_ms(seconds: float | None, forwards: int) -> float | None:
    return None if seconds is None else 1e3 * seconds / max(forwards, 1)


def serve_and_break_down(engine: LLMEngine, prompts: list[list[int]], params: list[GenerationConfig],
                         shape: BenchShape, concurrency: int):
    """One engine run and where its time went: tokens per forward, forward device time against step
    wall time (the share the device spends in forwards; the rest is host work it waits for), and the
    CUDA graphs it replayed and captured."""
    runner = engine.executor.runner
    graphs_before = graph_counters(runner)
    with forward_log(engine) as log:
        run = run_engine(engine, prompts, params, shape, concurrency)
    forward_device = sum(log.device_seconds) if log.device_seconds else None
    return run, {
        "requests": len(prompts), "output_tokens": run.output_tokens, "seconds": run.seconds,
        "tokens_per_s": run.output_tokens / run.seconds, "forwards": run.forwards, "steps": run.steps,
        "steps_after_prefill": log.steps_after_prefill,
        "tokens_per_forward": run.output_tokens / max(run.forwards, 1),
        "sequences_per_forward": run.seq_forwards / max(run.forwards, 1),
        "forward_host_seconds": run.forward_seconds, "forward_device_seconds": forward_device,
        "step_seconds": run.step_seconds,
        "forward_share_of_step_time": None if forward_device is None else forward_device / run.step_seconds,
        # the device's time per forward against the steps' wall time per forward (host work included)
        "ms_per_forward_device": per_forward_ms(forward_device, run.forwards),
        "ms_per_forward_wall": per_forward_ms(run.step_seconds, run.forwards),
        **graph_report(runner, graphs_before),
    }


def launch_counts(events: list[tuple[str, int]]) -> dict[str, int]:
    """Calls per launch API among (event name, calls) pairs; the names outside LAUNCH_EVENTS left out."""
    counts: dict[str, int] = {}
    for name, calls in events:
        if name.startswith(LAUNCH_EVENTS):
            counts[name] = counts.get(name, 0) + calls
    return counts


def launches_per_step(counts: dict[str, int], steps: int) -> dict:
    """Device launches (kernels and graph replays) per engine step, and graph replays alone."""
    graphs = sum(n for name, n in counts.items() if "GraphLaunch" in name)
    return {"kernel_launches_per_step": sum(counts.values()) / max(steps, 1),
            "graph_launches_per_step": graphs / max(steps, 1), "launch_calls": counts}


def profile_steps(engine: LLMEngine, prompts: list[list[int]], params: list[GenerationConfig], steps: int,
                  rows: int = 15) -> dict:
    """A profiler table of `steps` engine steps once `prompts` are in flight and past their prefill: the
    top device kernels by device time, the top host ops by self CPU time, and the launches onto the
    device per step (a step replayed as one CUDA graph launches once). The requests are aborted
    afterwards."""
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    for _ in range(sum(map(len, prompts)) // engine.config.max_prefill_token_num + 2):
        engine.step()
    runner = engine.executor.runner
    graphs_before = graph_counters(runner)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    graphs = graph_report(runner, graphs_before)
    for rid in ids:  # leave the engine empty for whoever uses it next
        engine.abort(rid)
    events = prof.key_averages()

    def table(key: Callable, keep: Callable) -> list[dict]:
        chosen = sorted((e for e in events if keep(e)), key=key, reverse=True)[:rows]
        return [{"name": e.key[:80], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                 "device_ms": e.device_time_total / 1e3} for e in chosen]

    return {"steps": steps,
            **launches_per_step(launch_counts([(e.key, e.count) for e in events]), steps),
            "graph_replays": graphs["graph_replays"], "graph_captures": graphs["graph_captures"],
            "top_device_kernels": table(lambda e: e.self_device_time_total,
                                        lambda e: e.self_device_time_total > 0),
            "top_host_ops": table(lambda e: e.self_cpu_time_total, lambda e: e.self_cpu_time_total > 0)}
