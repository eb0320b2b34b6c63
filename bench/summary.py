"""The figures every part reports: rates per wall and CPU second, engine / baseline ratios, and the
summary of one engine run."""

from __future__ import annotations

import statistics

from bench.measure import EngineRun
from bench.plan import dllm_blocks


def rates(tokens: int, wall: float, cpu: float) -> dict:
    return {"seconds": round(wall, 3), "cpu_seconds": round(cpu, 3), "tokens_per_s": round(tokens / wall, 3),
            "tokens_per_cpu_s": round(tokens / cpu, 3)}


def ratios(engine: dict, base: dict) -> dict:
    """Engine over baseline, by CPU time ("ratio_vs_baseline") and by wall time."""
    return {"ratio_vs_baseline": round(engine["tokens_per_cpu_s"] / base["tokens_per_cpu_s"], 2),
            "ratio_vs_baseline_wall": round(engine["tokens_per_s"] / base["tokens_per_s"], 2)}


def engine_summary(run: EngineRun, peak: float, prompts: list[list[int]], dllm: bool) -> dict:
    """`run`'s figures; `peak`: the torch.mm GFLOP/s the achieved ones are a share of; `dllm` adds the
    per-block figures."""
    tokens = run.output_tokens
    out = {
        "requests": len(run.outputs),
        "output_tokens": tokens,
        **rates(tokens, run.seconds, run.cpu_seconds),
        "forwards": run.forwards,
        "forwards_per_token": round(run.forwards / max(tokens, 1), 4),
        "sequence_forwards_per_token": round(run.seq_forwards / max(tokens, 1), 4),
        "lm_head_rows_per_token": round(run.lm_head_rows / max(tokens, 1), 3),
        "ttfc_mean_s": round(statistics.fmean(run.ttfc), 3),
        "ttfc_p50_s": round(statistics.median(run.ttfc), 3),
        "ttfc_max_s": round(max(run.ttfc), 3),
        "engine_overhead": round(1 - run.forward_seconds / run.step_seconds, 4),
        "achieved_gflops": round(run.matmul_flops / run.forward_cpu_seconds / 1e9, 2),
        "share_of_mm_peak": round(run.matmul_flops / run.forward_cpu_seconds / 1e9 / peak, 3),
        "peak_rss_mb": round(run.peak_rss / 2**20),
        "finish_stop": sum(o.finish_reason == "stop" for o in run.outputs),
    }
    if dllm:
        blocks = sum(dllm_blocks(len(p), len(o.token_ids)) for p, o in zip(prompts, run.outputs))
        out["blocks"] = blocks
        out["sequence_forwards"] = run.seq_forwards
        out["unmasking_steps"] = run.unmasking_steps
        out["sequence_forwards_per_block"] = round(run.seq_forwards / blocks, 3)
        out["denoising_steps_per_block"] = round(run.unmasking_steps / blocks, 3)
    return out
