"""`python -m bench.overhead`: engine overhead per step at short vs long outputs.

Engine overhead = a step's wall time minus the time inside the model forward (scheduling, batch
building, sampling, unmasking, stop checks, detokenisation, output chunks). It must not grow with
output length: 32 concurrent requests with 64-token outputs vs 32 with 4,096-token outputs, block
diffusion and AR, on a small random-weight model (so the forward does not drown the figure).
Block-diffusion requests finish at different steps, so the figure is per sequence-step: a step's
overhead divided by the sequences it ran. Prints one JSON object: per paradigm and output length,
the mean over the run and over its last 256 steps, and the ratios long / short.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine import EngineConfig, GenerationConfig, pipeline
from engine.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint

PROMPT_LEN = 16
TAIL_STEPS = 256


def measure(path: Path, output_len: int, concurrency: int, stop_words: list[str]) -> dict:
    config = EngineConfig(num_kv_blocks=concurrency * (-(-(PROMPT_LEN + output_len + 8) // 16) + 1),
                          kv_block_size=16, max_batch_size=concurrency, dllm_block_length=4)
    with pipeline(str(path), config) as pipe:
        engine = pipe.engine
        gen = GenerationConfig(max_new_tokens=output_len, ignore_eos=True, stop_words=stop_words)
        for i in range(concurrency):
            engine.add_request([(7 * i + 3 * k) % 200 + 10 for k in range(PROMPT_LEN)], gen)
        overheads = []  # per step: overhead seconds / sequences in the step
        while engine.has_unfinished():
            forward0, t0 = engine.stats.forward_seconds, time.perf_counter()
            running = len(engine.scheduler.running) + len(engine.scheduler.waiting)
            engine.step()
            overheads.append(((time.perf_counter() - t0) - (engine.stats.forward_seconds - forward0)) / running)
        return {
            "steps": len(overheads),
            "generated_tokens": engine.stats.generated_tokens,
            "overhead_us_per_seq_step": round(1e6 * statistics.fmean(overheads), 2),
            "overhead_us_per_seq_step_last_256": round(1e6 * statistics.fmean(overheads[-TAIL_STEPS:]), 2),
            "forward_ms_per_step": round(1e3 * engine.stats.forward_seconds / len(overheads), 4),
        }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", type=int, default=64)
    ap.add_argument("--long", type=int, default=4096)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out: dict = {"concurrency": args.concurrency, "short": args.short, "long": args.long}
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
            for length in (args.short, args.long):
                print(f"[overhead] {name} {length}-token outputs", file=sys.stderr, flush=True)
                # a stop string that never matches keeps the stop-string search on the hot path
                runs[length] = measure(path, length, args.concurrency, stop_words=["\x00never\x00"])
            short, long = runs[args.short], runs[args.long]
            out[name] = {
                "runs": {str(k): v for k, v in runs.items()},
                "ratio_long_vs_short": round(long["overhead_us_per_seq_step"] / short["overhead_us_per_seq_step"], 3),
                "ratio_last_256_vs_short": round(long["overhead_us_per_seq_step_last_256"]
                                                 / short["overhead_us_per_seq_step"], 3),
            }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
