"""`python -m bench.replica_overhead`: host work per sequence-step on an engine replica, engine and event loop.

`bench.overhead` times the engine's step alone. On a Serve replica two threads share the GIL: the
engine's loop thread, which steps the engine and hands each step's chunks to their callers, and the
replica's event loop, which wakes for those chunks and runs the code that reads them (the ingress's
unary calls fold them into one result; its streams forward each). Host time on either thread is time
the step is not running, so this bench counts both.

It builds the real `EngineServer` replica class in this process (no Ray: its constructor runs the
AsyncEngine as a Serve replica does) on a tiny random-weight model with one layer, and sends
`--concurrency` requests of `--tokens` output tokens two ways: as the ingress sends unary requests
(one `generate_batch` call) and as streams (one `generate_stream` per request, every delta read).
Per paradigm and way it prints, per sequence-step: the engine thread's CPU time outside the forward
(`engine_us`), the event loop thread's CPU time (`loop_us`), their sum, and the chunks the callers
received. CPU time is per thread (`pthread_getcpuclockid`), so other processes on a shared machine do
not count. A warm-up run of each paradigm comes first. The file uses only interfaces that older
checkouts also have, so it can be copied into one (with bench/overhead.py) to compare revisions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.overhead import (
    PARADIGMS,
    PROMPT_LEN,
    _ForwardClock,
    _prompt,
    engine_settings,
    request_params,
    select_paradigms,
)
from deployments.engine_server import EngineServer
from deployments.wire import EngineRequest

DEFAULT_ONLY = "block_diffusion/low_confidence_dynamic,ar"
WAYS = ("unary", "streamed")


class _StepCounter:
    """Wraps the engine's step: counts the sequences each step ran (running and waiting when it began)."""

    def __init__(self, engine):
        self.engine, self.step, self.sequence_steps = engine, engine.step, 0

    def __call__(self):
        self.sequence_steps += len(self.engine.scheduler.running) + len(self.engine.scheduler.waiting)
        return self.step()


def _requests(paradigm, tokens: int, concurrency: int, tag: str) -> list[EngineRequest]:
    return [EngineRequest(prompt=_prompt(i), request_id=f"{tag}-{i}",
                          params=request_params(paradigm, tokens, i).model_dump()) for i in range(concurrency)]


async def _unary(server, requests: list[EngineRequest]) -> int:
    results = await server.generate_batch(requests)
    assert all(r.finish_reason == "length" for r in results), results[0]
    return len(results)  # one result each (the chunks behind them stay inside the replica)


async def _streamed(server, requests: list[EngineRequest]) -> int:
    async def read(request: EngineRequest) -> int:
        return len([chunk async for chunk in server.generate_stream(request)])

    return sum(await asyncio.gather(*(read(r) for r in requests)))


def _thread_cpu(thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def measure_way(server, paradigm, way: str, tokens: int, concurrency: int, tag: str) -> dict:
    """One run of `concurrency` requests sent one `way`: CPU time per sequence-step on each thread."""
    engine = server.engine.engine
    counter = engine.step = _StepCounter(engine)
    clock = engine.executor.execute = _ForwardClock(engine.executor.execute, "cpu")
    engine_thread = server.engine._thread
    requests = _requests(paradigm, tokens, concurrency, tag)
    try:
        engine0, loop0, wall0 = _thread_cpu(engine_thread), time.thread_time(), time.perf_counter()
        received = asyncio.run((_unary if way == "unary" else _streamed)(server, requests))
        wall = time.perf_counter() - wall0
        engine_cpu, loop_cpu = _thread_cpu(engine_thread) - engine0, time.thread_time() - loop0
    finally:
        engine.step, engine.executor.execute = counter.step, clock.execute
    seq_steps = counter.sequence_steps
    engine_us, loop_us = 1e6 * (engine_cpu - clock.seconds) / seq_steps, 1e6 * loop_cpu / seq_steps
    return {"sequence_steps": seq_steps, "received": received, "engine_us_per_seq_step": round(engine_us, 2),
            "loop_us_per_seq_step": round(loop_us, 2), "host_us_per_seq_step": round(engine_us + loop_us, 2),
            "forward_cpu_s": round(clock.seconds, 3), "wall_s": round(wall, 3)}


def run(names: list[str], tokens: int, concurrency: int, repeats: int) -> dict:
    out: dict = {"concurrency": concurrency, "tokens": tokens, "prompt_len": PROMPT_LEN,
                 "torch_threads": torch.get_num_threads(), "paradigms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            paradigm = PARADIGMS[name]
            path = paradigm.write(Path(tmp) / paradigm.family, PROMPT_LEN + tokens + 256)
            server = EngineServer.func_or_class(str(path), engine_settings(paradigm, tokens, concurrency, "cpu"))
            try:
                print(f"[replica_overhead] {name}: warm-up", file=sys.stderr, flush=True)
                for way in WAYS:
                    measure_way(server, paradigm, way, tokens, concurrency, f"warm-{way}")
                runs: dict[str, list[dict]] = {way: [] for way in WAYS}
                for r in range(repeats):  # the ways alternate, so drift on the machine hits both
                    for way in WAYS:
                        runs[way].append(measure_way(server, paradigm, way, tokens, concurrency, f"{way}-{r}"))
                out["paradigms"][name] = {way: _median(rs) for way, rs in runs.items()}
            finally:
                server.__del__()
    return out


def _median(runs: list[dict]) -> dict:
    """The run whose host time is the median, with every run's host time beside it."""
    ranked = sorted(runs, key=lambda r: r["host_us_per_seq_step"])
    return {**ranked[len(ranked) // 2], "host_us_per_seq_step_runs": [r["host_us_per_seq_step"] for r in runs]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--only", default=DEFAULT_ONLY, metavar="NAME[,NAME]",
                    help=f"paradigms (names or prefixes, as bench.overhead takes them): {', '.join(PARADIGMS)}")
    ap.add_argument("--repeats", type=int, default=3, help="measured runs of each way (the median is printed)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    command = "python -m bench.replica_overhead " + " ".join(sys.argv[1:] if argv is None else argv)
    result = run(select_paradigms(args.only), args.tokens, args.concurrency, args.repeats)
    print(json.dumps({"command": command, **result}, indent=2))


if __name__ == "__main__":
    main()
