"""Trajectory scoring vs regenerating: one engine, one run, both sides.

`python -m bench.trajectory_scoring [--toy] [--trajectories 64] [--tokens 256] ...` writes an SDAR-shaped
checkpoint with the real 151,936-token vocabulary (or the toy shape), generates N rollouts of T output
tokens (greedy, `ignore_eos`, final-block replay), then scores every rollout's trajectory with the same
engine in one call, and prints one JSON object: seconds for each side and their ratio, the largest
difference between scored and logged logprobs, and the peak memory each side added (CUDA: allocator
peak over the allocation before the phase; CPU: peak RSS over the RSS before the phase).
`measure` is the whole run; `python -m bench.gpu_check`'s `trajectory_scoring` part calls it too.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.measure import PeakRSS
from bench.models import DLLM_LOGIT_SCALE, TOY_SHAPE, BenchShape
from configs.trajectory import DllmTrajectory
from engine import EngineConfig, GenerationConfig, pipeline
from testing.tiny_checkpoint import write_tiny_checkpoint

PREFILL_TOKENS = 16384  # max_prefill_token_num: every scoring view of a 64 x 256 run in a few forwards


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


@dataclass(frozen=True)
class Rollouts:
    """N rollouts of T output tokens from P-token prompts: the workload both sides run."""

    trajectories: int = 64
    tokens: int = 256
    prompt_len: int = 32

    def engine_settings(self) -> dict:
        """The EngineConfig fields the workload fixes: every rollout in one batch, room for prompt, output
        and a block, logprobs of the model's own distribution (what scoring returns)."""
        return {"logprobs_mode": "raw_logprobs", "max_batch_size": self.trajectories,
                "max_model_len": self.prompt_len + self.tokens + 8}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--toy", action="store_true", help="the toy model shape (seconds; figures meaningless)")
    ap.add_argument("--model", default=None, help="an SDAR checkpoint to use instead of writing one")
    ap.add_argument("--trajectories", type=int, default=Rollouts.trajectories)
    ap.add_argument("--tokens", type=int, default=Rollouts.tokens, help="output tokens per rollout")
    ap.add_argument("--prompt-len", type=int, default=Rollouts.prompt_len)
    ap.add_argument("--strategy", default="low_confidence_dynamic")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS,
                    help="max_prefill_token_num: query rows per forward for prefills and scoring views")
    ap.add_argument("--chunk-rows", type=int, default=256, help="logprobs_chunk_rows")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0 = torch's default)")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    shape = TOY_SHAPE if args.toy else BenchShape()
    rollouts = Rollouts(args.trajectories, args.tokens, args.prompt_len)
    config = EngineConfig(**rollouts.engine_settings(), device=args.device, dtype=args.dtype,
                          max_prefill_token_num=args.prefill_tokens, logprobs_chunk_rows=args.chunk_rows,
                          dllm_unmasking_strategy=args.strategy)
    with tempfile.TemporaryDirectory(prefix="bench-traj-") as tmp:
        path = Path(args.model) if args.model else write_tiny_checkpoint(
            Path(tmp) / "sdar", model_type="sdar", logit_scale=DLLM_LOGIT_SCALE, block_size=4, seed=1,
            **asdict(shape))
        print(json.dumps(measure(path, rollouts, config)))


def measure(path: Path, rollouts: Rollouts, config: EngineConfig) -> dict:
    """Generate `rollouts` (greedy, `ignore_eos`, final-block replay) on an engine of `config` (built from
    `rollouts.engine_settings()`), then score every rollout's trajectory in one call on the same engine:
    both sides' seconds, forwards and peak memory added, and the largest |scored - logged| logprob."""
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(6, min(vocab, 300)) for _ in range(rollouts.prompt_len)]
               for _ in range(rollouts.trajectories)]
    gen = GenerationConfig(max_new_tokens=rollouts.tokens, ignore_eos=True, logprobs=0, return_dllm_replay=True)
    with pipeline(str(path), config) as pipe:
        device = pipe.engine.executor.runner.device
        backend = pipe.engine.executor.runner.backend.name
        pipe(prompts[:2], gen.model_copy(update={"max_new_tokens": 8}))  # warm-up
        forwards = pipe.engine.stats.forwards
        outs, gen_s, gen_cpu, gen_mem = _phase(device, lambda: pipe(prompts, gen))
        gen_forwards = pipe.engine.stats.forwards - forwards
        pipe.engine.flush_cache()  # the scoring side computes its prompts itself
        scoring = [GenerationConfig(max_new_tokens=0, logprobs=0, dllm_trajectory=DllmTrajectory.from_response(o))
                   for o in outs]
        forwards = pipe.engine.stats.forwards
        scored, score_s, score_cpu, score_mem = _phase(device, lambda: pipe(prompts, scoring))
        score_forwards = pipe.engine.stats.forwards - forwards
    diff = max(abs(a[t] - b[t]) for o, s in zip(outs, scored) for a, b, t in zip(o.logprobs, s.logprobs, o.token_ids))
    steps = sum(max(o.step_map) for o in outs)
    return {
        "device": str(device), "dtype": config.dtype, "vocab_size": vocab, "trajectories": rollouts.trajectories,
        "output_tokens": rollouts.tokens, "prompt_len": rollouts.prompt_len,
        "strategy": config.dllm_unmasking_strategy, "attention_backend": backend,
        "denoising_steps": steps, "tokens_per_step": sum(len(o.token_ids) for o in outs) / steps,
        "generate_s": round(gen_s, 4), "score_s": round(score_s, 4), "speedup": round(gen_s / score_s, 2),
        "generate_cpu_s": round(gen_cpu, 4), "score_cpu_s": round(score_cpu, 4),
        "speedup_cpu_time": round(gen_cpu / score_cpu, 2),
        "generate_forwards": gen_forwards, "score_forwards": score_forwards,
        "generate_peak_extra_bytes": gen_mem, "score_peak_extra_bytes": score_mem,
        "logprobs_chunk_rows": config.logprobs_chunk_rows, "max_prefill_token_num": config.max_prefill_token_num,
        "max_abs_diff_scored_vs_logged": diff,
    }


if __name__ == "__main__":
    main()
