"""Trajectory scoring vs regenerating: one engine, one run, both sides.

`python -m bench.trajectory_scoring [--toy] [--trajectories 64] [--tokens 256] ...` writes an SDAR-shaped
checkpoint with the real 151,936-token vocabulary (or the toy shape), generates N rollouts of T output
tokens (greedy, `ignore_eos`, final-block replay), then scores every rollout's trajectory with the same
engine in one call, and prints one JSON object: seconds for each side and their ratio, the largest
difference between scored and logged logprobs, and the peak memory each side added (CUDA: allocator
peak over the allocation before the phase; CPU: peak RSS over the RSS before the phase).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.measure import PeakRSS
from bench.models import DLLM_LOGIT_SCALE, TOY_SHAPE, BenchShape
from configs.trajectory import DllmTrajectory
from engine import EngineConfig, GenerationConfig, pipeline
from tools.tiny_checkpoint import write_tiny_checkpoint


def _phase(device: torch.device, fn):
    """(result, wall seconds, process CPU seconds, peak bytes the phase added). CPU seconds are the
    steadier figure on a shared machine."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        torch.cuda.synchronize()
        return out, time.perf_counter() - t, time.process_time() - c, torch.cuda.max_memory_allocated() - base
    with PeakRSS() as rss:
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        seconds, cpu = time.perf_counter() - t, time.process_time() - c
    return out, seconds, cpu, rss.peak - rss.start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--toy", action="store_true", help="the toy model shape (seconds; figures meaningless)")
    ap.add_argument("--model", default=None, help="an SDAR checkpoint to use instead of writing one")
    ap.add_argument("--trajectories", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per rollout")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--strategy", default="low_confidence_dynamic")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--prefill-tokens", type=int, default=16384,
                    help="max_prefill_token_num: query rows per forward for prefills and scoring views")
    ap.add_argument("--chunk-rows", type=int, default=256, help="logprobs_chunk_rows")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0 = torch's default)")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    shape = TOY_SHAPE if args.toy else BenchShape()
    with tempfile.TemporaryDirectory(prefix="bench-traj-") as tmp:
        path = Path(args.model) if args.model else write_tiny_checkpoint(
            Path(tmp) / "sdar", model_type="sdar", logit_scale=DLLM_LOGIT_SCALE, block_size=4, seed=1,
            **asdict(shape))
        run(args, path)


def run(args: argparse.Namespace, path: Path) -> None:
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(6, min(vocab, 300)) for _ in range(args.prompt_len)] for _ in range(args.trajectories)]
    cfg = EngineConfig(device=args.device, dtype=args.dtype, logprobs_mode="raw_logprobs",
                       max_batch_size=args.trajectories, max_model_len=args.prompt_len + args.tokens + 8,
                       max_prefill_token_num=args.prefill_tokens, logprobs_chunk_rows=args.chunk_rows,
                       dllm_unmasking_strategy=args.strategy)
    gen = GenerationConfig(max_new_tokens=args.tokens, ignore_eos=True, logprobs=0, return_dllm_replay=True)
    with pipeline(str(path), cfg) as pipe:
        device = pipe.engine.executor.runner.device
        pipe(prompts[:2], gen.model_copy(update={"max_new_tokens": 8}))  # warm-up
        forwards = pipe.engine.stats.forwards
        outs, gen_s, gen_cpu, gen_mem = _phase(device, lambda: pipe(prompts, gen))
        gen_forwards = pipe.engine.stats.forwards - forwards
        pipe.engine.flush_cache()  # the scoring side computes its prompts itself
        scoring = [GenerationConfig(max_new_tokens=0, logprobs=0, dllm_trajectory=DllmTrajectory(
            output_ids=o.token_ids, step_map=o.step_map, replay_token_ids=o.dllm_replay_token_ids,
            replay_step_maps=o.dllm_replay_step_maps, stop_length=o.dllm_stop_length)) for o in outs]
        forwards = pipe.engine.stats.forwards
        scored, score_s, score_cpu, score_mem = _phase(device, lambda: pipe(prompts, scoring))
        score_forwards = pipe.engine.stats.forwards - forwards
    diff = max(abs(a[t] - b[t]) for o, s in zip(outs, scored) for a, b, t in zip(o.logprobs, s.logprobs, o.token_ids))
    steps = sum(max(o.step_map) for o in outs)
    print(json.dumps({
        "device": str(device), "dtype": args.dtype, "vocab_size": vocab, "trajectories": args.trajectories,
        "output_tokens": args.tokens, "prompt_len": args.prompt_len, "strategy": args.strategy,
        "denoising_steps": steps, "tokens_per_step": sum(len(o.token_ids) for o in outs) / steps,
        "generate_s": round(gen_s, 4), "score_s": round(score_s, 4), "speedup": round(gen_s / score_s, 2),
        "generate_cpu_s": round(gen_cpu, 4), "score_cpu_s": round(score_cpu, 4),
        "speedup_cpu_time": round(gen_cpu / score_cpu, 2),
        "generate_forwards": gen_forwards, "score_forwards": score_forwards,
        "generate_peak_extra_bytes": gen_mem, "score_peak_extra_bytes": score_mem,
        "logprobs_chunk_rows": args.chunk_rows, "max_prefill_token_num": args.prefill_tokens,
        "max_abs_diff_scored_vs_logged": diff,
    }))


if __name__ == "__main__":
    main()
