"""Part 8, `trajectory_scoring`: regenerating rollouts against scoring their trajectories, on the
SDAR-1.7B shape with weights drawn on the device (bench/trajectory_scoring.py's run)."""

from __future__ import annotations

from pathlib import Path

from bench.gpu_check.engine_choice import EngineChoice
from bench.gpu_check.random_weights import weights_on_device
from bench.gpu_check.settings import BLOCK, STRATEGY, THRESHOLD
from bench.trajectory_scoring import PREFILL_TOKENS, Rollouts, measure


def trajectory_scoring(path: Path, device: str, dtype: str, rollouts: Rollouts = Rollouts(),
                       choice: EngineChoice | None = None) -> dict:
    """Greedy rollouts (block 4, `low_confidence_dynamic` 0.85, `ignore_eos`, final-block replay), then all
    their trajectories scored in one call on the same engine: each side's seconds, forwards and peak memory
    added, their ratio, and the largest |scored - logged| logprob."""
    config = (choice or EngineChoice()).config(
        **rollouts.engine_settings(), device=device, dtype=dtype, max_prefill_token_num=PREFILL_TOKENS,
        dllm_block_length=BLOCK, dllm_unmasking_strategy=STRATEGY, dllm_confidence_threshold=THRESHOLD)
    with weights_on_device():
        return measure(path, rollouts, config)
