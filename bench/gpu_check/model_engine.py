"""The engine the model parts measure, built the same way for each of them."""

from __future__ import annotations

from pathlib import Path

from bench.gpu_check.engine_choice import EngineChoice
from bench.gpu_check.settings import BLOCK, STRATEGY, THRESHOLD
from bench.measure import run_engine
from bench.models import BenchShape, mask_id_of, stop_ids_of
from bench.workloads import Traffic, make_prompts
from configs import GenerationConfig
from engine.core.llm_engine import LLMEngine


def bench_engine(path: Path, shape: BenchShape, device: str, dtype: str, concurrency: list[int], traffic: Traffic,
                 choice: EngineChoice | None = None) -> tuple[LLMEngine, list[list[int]], list[GenerationConfig]]:
    """The engine the model parts measure (block 4, `low_confidence_dynamic` 0.85), warmed up, and the
    traffic's prompts and greedy settings."""
    stops, mask_id = stop_ids_of(path), mask_id_of(path)
    prompts, budgets = make_prompts(traffic, shape.vocab_size, stops | {mask_id})
    params = [GenerationConfig(max_new_tokens=m) for m in budgets]
    config = (choice or EngineChoice()).config(
        device=device, dtype=dtype, num_kv_blocks=0.85 if device == "cuda" else 4096, max_batch_size=max(concurrency),
        dllm_block_length=BLOCK, dllm_unmasking_strategy=STRATEGY, dllm_confidence_threshold=THRESHOLD)
    engine = LLMEngine(str(path), config)
    run_engine(engine, prompts[:1], [GenerationConfig(max_new_tokens=8)], shape, 1)  # warm-up
    return engine, prompts, params
