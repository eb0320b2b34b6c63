"""Measurement helpers: a torch.mm peak, a peak-RSS sampler, a wall/CPU clock, and the engine driver."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch

from bench.models import BenchShape
from engine import GenerationConfig
from engine.carrier import Response

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def cpu_clock() -> float:
    """CPU seconds of the work: this thread's with one torch thread (excludes the RSS sampler),
    else the whole process's (intra-op worker threads included)."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.process_time()


def mm_peak_gflops(n: int = 1024, k: int = 512, m: int = 4096, repeats: int = 5) -> float:
    """Best-of GFLOP/s of a float32 `torch.mm` shaped like the bench model's big matmuls, timed with
    `cpu_clock`, so another process holding the core does not count."""
    a, b = torch.randn(n, k), torch.randn(k, m)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = cpu_clock()
        torch.mm(a, b)
        best = min(best, cpu_clock() - t)
    return 2 * n * k * m / best / 1e9


class PeakRSS:
    """Samples this process's RSS every `interval` seconds while in the `with` block."""

    def __init__(self, interval: float = 0.01):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRSS:
        self.start = rss_bytes()
        self.peak = self.start
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


class Clock:
    """Wall and process-CPU seconds of a `with` block."""

    def __enter__(self) -> Clock:
        self.t, self.c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self.t
        self.cpu = time.process_time() - self.c


@dataclass
class EngineRun:
    outputs: list[Response]
    seconds: float
    cpu_seconds: float  # process CPU time: the work, whatever else the shared machine runs
    ttfc: list[float]  # per request: seconds from its submission to its first chunk with tokens
    forwards: int
    seq_forwards: int  # sum over forwards of the sequences in it
    lm_head_rows: int  # rows projected through the LM head
    steps: int
    forward_seconds: float
    forward_cpu_seconds: float  # CPU time inside the executor (`cpu_clock`)
    step_seconds: float
    generated_positions: int  # positions unmasked / sampled (DLLM counts every revealed position)
    unmasking_steps: int
    matmul_flops: int
    peak_rss: int
    rss_start: int

    @property
    def output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


def run_engine(engine, prompts: list[list[int]], params: list, shape: BenchShape, concurrency: int) -> EngineRun:
    """Serve `prompts` with at most `concurrency` requests in flight (a new one enters as one ends)."""
    stats0 = dict(vars(engine.stats))
    flops = [0]
    seq_forwards = [0]
    lm_rows = [0]
    forward_cpu = [0.0]
    execute = engine.executor.execute

    def counted(batch):
        f = shape.matmul_flops_per_token() * len(batch.input_ids)
        f += sum(shape.attention_flops(q, kv) for q, kv in zip(batch.q_lens, batch.kv_lens))
        f += shape.lm_head_flops(len(batch.sample_rows) + len(batch.score_rows))
        flops[0] += f
        seq_forwards[0] += len(batch.q_lens)
        lm_rows[0] += len(batch.sample_rows) + len(batch.score_rows)
        t = cpu_clock()
        try:
            return execute(batch)
        finally:
            forward_cpu[0] += cpu_clock() - t

    engine.executor.execute = counted
    responses: dict[str, Response] = {}
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    order: list[str] = []
    queue = list(zip(prompts, params))
    in_flight = 0
    try:
        with PeakRSS() as mem:
            t0, c0 = time.perf_counter(), time.process_time()
            while queue or in_flight:
                while queue and in_flight < concurrency:
                    prompt, p = queue.pop(0)
                    rid = engine.add_request(prompt, p)
                    submitted[rid] = time.perf_counter()
                    responses[rid] = Response()
                    order.append(rid)
                    in_flight += 1
                for chunk in engine.step():
                    responses[chunk.request_id].add(chunk)
                    if chunk.request_id not in first and (chunk.token_ids or chunk.input_token_logprobs
                                                          or chunk.finished):
                        first[chunk.request_id] = time.perf_counter()
                    if chunk.finished:
                        in_flight -= 1
            seconds = time.perf_counter() - t0
            cpu_seconds = time.process_time() - c0
    finally:
        engine.executor.execute = execute
    st = engine.stats
    return EngineRun(
        outputs=[responses[r] for r in order],
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        ttfc=[first[r] - submitted[r] for r in order],
        forwards=st.forwards - stats0["forwards"],
        seq_forwards=seq_forwards[0],
        lm_head_rows=lm_rows[0],
        steps=st.steps - stats0["steps"],
        forward_seconds=st.forward_seconds - stats0["forward_seconds"],
        forward_cpu_seconds=forward_cpu[0],
        step_seconds=st.step_seconds - stats0["step_seconds"],
        generated_positions=st.generated_tokens - stats0["generated_tokens"],
        unmasking_steps=st.unmasking_steps - stats0["unmasking_steps"],
        matmul_flops=flops[0],
        peak_rss=mem.peak,
        rss_start=mem.start,
    )


def warm_up(engine, shape: BenchShape) -> None:
    """One short request through `engine`, so that the first measured request pays no first-call costs."""
    run_engine(engine, [[11, 12, 13, 14, 15, 16, 17]], [GenerationConfig(max_new_tokens=8)], shape, 1)
