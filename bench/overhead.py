"""`python -m bench.overhead`: engine overhead per step at short vs long outputs.

Engine overhead = a step's wall time minus the time inside the model forward (scheduling, batch
building, sampling, unmasking, stop checks, detokenisation, output chunks). It must not grow with
output length: 32 concurrent requests with 64-token outputs vs 32 with 4,096-token outputs, block
diffusion and AR, on a small random-weight model (so the forward does not drown the figure).
Block-diffusion requests finish at different steps, so the figure is per sequence-step (a step's
overhead divided by the sequences it ran) over the steps that ran all 32 sequences: a step's fixed
costs spread over fewer sequences would otherwise count as growth. Prints one JSON object: per
paradigm and output length, the mean over the run and over its last 256 such steps, and the ratios
long / short.

Times are CPU time of the engine's thread (`time.thread_time`; torch runs on that one thread), so
other processes on a shared machine do not count as engine overhead. Two controls separate the
engine's own work from the machine's memory hierarchy: the Python
function calls per step (deterministic: constant work per step gives equal counts early and late
in a long run), and a short run whose forward also sweeps as much memory as the long run's KV cache
(a long-context forward evicts the CPU caches the engine's bookkeeping then runs on).
`--device cuda` runs the forward on the GPU, where it leaves the CPU caches to the engine.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine import EngineConfig, GenerationConfig, pipeline
from engine.heap import freeze_startup_heap
from tools.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint

PROMPT_LEN = 16
TAIL_STEPS = 256
CALLS_AT = 32  # profiled steps (early and late in a long run)


def _pages(output_len: int, concurrency: int) -> int:
    return concurrency * (-(-(PROMPT_LEN + output_len + 8) // 16) + 1)


class _ForwardClock:
    """Wraps the executor's forward: adds its thread CPU time to `seconds`, and optionally sweeps
    `sweep_bytes` of memory after it (counted as forward time)."""

    def __init__(self, execute, device: str, sweep_bytes: int = 0):
        self.execute = execute
        self.cuda = device == "cuda"
        self.buffer = torch.zeros(sweep_bytes // 4) if sweep_bytes else None
        self.seconds = 0.0

    def __call__(self, batch):
        t0 = time.thread_time()
        out = self.execute(batch)
        if self.cuda:  # the kernels run asynchronously: wait here, or the wait lands in the sampler's copy
            torch.cuda.synchronize()
        if self.buffer is not None:
            self.buffer.add_(1.0)
        self.seconds += time.thread_time() - t0
        return out


def _calls_per_seq_step(engine, steps: int) -> float:
    """Python function calls per sequence per step over the next `steps` steps."""
    running = len(engine.scheduler.running)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    return pstats.Stats(profile).total_calls / steps / running


def measure(path: Path, output_len: int, concurrency: int, stop_words: list[str], sweep_bytes: int = 0,
            device: str = "cpu") -> dict:
    config = EngineConfig(device=device, num_kv_blocks=_pages(output_len, concurrency), kv_block_size=16,
                          max_batch_size=concurrency, dllm_block_length=4)
    with pipeline(str(path), config) as pipe:
        engine = pipe.engine
        freeze_startup_heap()  # as a Serve engine replica does
        clock = engine.executor.execute = _ForwardClock(engine.executor.execute, device, sweep_bytes)
        gen = GenerationConfig(max_new_tokens=output_len, ignore_eos=True, stop_words=stop_words)
        for i in range(concurrency):
            engine.add_request([(7 * i + 3 * k) % 200 + 10 for k in range(PROMPT_LEN)], gen)
        overheads = []  # per step: overhead seconds / sequences in the step
        calls = {}
        while engine.has_unfinished():
            if len(overheads) in (CALLS_AT, output_len // 2) and output_len > 4 * CALLS_AT:
                calls[len(overheads)] = round(_calls_per_seq_step(engine, CALLS_AT), 2)
                overheads += [float("nan")] * CALLS_AT
                continue
            forward0, t0 = clock.seconds, time.thread_time()
            running = len(engine.scheduler.running) + len(engine.scheduler.waiting)
            engine.step()
            seconds = (time.thread_time() - t0) - (clock.seconds - forward0)
            overheads.append(seconds / running if running == concurrency else float("nan"))
        timed = [o for o in overheads if o == o]  # steps that ran the whole batch
        return {
            "python_calls_per_seq_step_at_step": calls or None,
            "steps": len(overheads),
            "full_batch_steps": len(timed),
            "generated_tokens": engine.stats.generated_tokens,
            "overhead_us_per_seq_step": round(1e6 * statistics.fmean(timed), 2),
            "overhead_us_per_seq_step_last_256": round(1e6 * statistics.fmean(timed[-TAIL_STEPS:]), 2),
            "forward_cpu_ms_per_step": round(1e3 * clock.seconds / len(overheads), 4),
        }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", type=int, default=64)
    ap.add_argument("--long", type=int, default=4096)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the forward runs on the GPU (bf16) and leaves the CPU caches to the engine")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out: dict = {"device": args.device, "concurrency": args.concurrency, "short": args.short, "long": args.long}
    with tempfile.TemporaryDirectory() as tmp:
        models = {
            "block_diffusion": write_tiny_checkpoint(Path(tmp) / "sdar", model_type="sdar", num_hidden_layers=1,
                                                     logit_scale=DLLM_TEST_LOGIT_SCALE,
                                                     max_position_embeddings=args.long + 64),
            "ar": write_tiny_checkpoint(Path(tmp) / "qwen3", model_type="qwen3", num_hidden_layers=1,
                                        max_position_embeddings=args.long + 64),
        }
        for name, path in models.items():
            runs = {}
            # a stop string that never matches keeps the stop-string search on the hot path
            never = ["\x00never\x00"]
            # warm-up: first-use costs of kernels and allocator
            measure(path, args.short, args.concurrency, never, device=args.device)
            for length in (args.short, args.long):
                print(f"[overhead] {name} {length}-token outputs", file=sys.stderr, flush=True)
                runs[str(length)] = measure(path, length, args.concurrency, never, device=args.device)
            kv_bytes = _pages(args.long, args.concurrency) * 16 * 2 * 2 * 16 * 4  # pages x tokens x K,V x heads x dim
            print(f"[overhead] {name} {args.short}-token outputs + {kv_bytes >> 20} MiB sweep", file=sys.stderr)
            runs[f"{args.short}+sweep"] = measure(path, args.short, args.concurrency, never, sweep_bytes=kv_bytes,
                                                  device=args.device)
            short, long = runs[str(args.short)], runs[str(args.long)]
            out[name] = {
                "runs": runs,
                "ratio_long_vs_short": round(long["overhead_us_per_seq_step"] / short["overhead_us_per_seq_step"], 3),
                "ratio_last_256_vs_short": round(long["overhead_us_per_seq_step_last_256"]
                                                 / short["overhead_us_per_seq_step"], 3),
                "ratio_long_vs_short_with_sweep": round(long["overhead_us_per_seq_step"]
                                                        / runs[f"{args.short}+sweep"]["overhead_us_per_seq_step"], 3),
            }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
