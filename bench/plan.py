"""What `python -m bench` runs at each size: the workloads, the request counts, and the block-diffusion
settings and engine config every part shares."""

from __future__ import annotations

from dataclasses import dataclass

from bench.models import TOY_SHAPE, BenchShape
from bench.workloads import Traffic
from engine import EngineConfig

BLOCK = 4
STRATEGY = "low_confidence_dynamic"
THRESHOLD = 0.85


@dataclass(frozen=True)
class Plan:
    """Workload c serves `waves * c` requests with c in flight (c = 1: `sequential_requests` of them)."""

    shape: BenchShape
    traffic: Traffic
    concurrency: list[int]
    waves: int
    sequential_requests: int
    hf_dllm_requests: int  # the SDAR loop is sequential: its tokens/s is measured on a sample
    fusion_off_at: list[int]  # concurrencies also run with dllm_commit_fusion off
    serve_concurrency: int
    scoring: tuple[int, int]  # sequences, tokens each
    memory_tokens: int


def plan(mode: str) -> Plan:
    """`mode`: full | quick | toy (every part at toy size in seconds, for the test suite)."""
    if mode == "toy":
        return Plan(shape=TOY_SHAPE, traffic=Traffic(8, (4, 12), (4, 8)), concurrency=[1, 4], waves=1,
                    sequential_requests=1, hf_dllm_requests=1, fusion_off_at=[4], serve_concurrency=4,
                    scoring=(2, 64), memory_tokens=128)
    if mode == "quick":
        return Plan(shape=BenchShape(num_hidden_layers=2), traffic=Traffic(64, (16, 128), (16, 48)),
                    concurrency=[1, 8, 32], waves=2, sequential_requests=2, hf_dllm_requests=4, fusion_off_at=[32],
                    serve_concurrency=32, scoring=(4, 1024), memory_tokens=6000)
    return Plan(shape=BenchShape(), traffic=Traffic(64, (16, 256), (32, 128)), concurrency=[1, 8, 32], waves=2,
                sequential_requests=4, hf_dllm_requests=8, fusion_off_at=[1, 8, 32], serve_concurrency=32,
                scoring=(16, 1024), memory_tokens=6000)


def num_requests(p: Plan, c: int) -> int:
    return p.sequential_requests if c == 1 else min(p.waves * c, p.traffic.num_requests)


def engine_config(dllm: bool = True, **overrides) -> EngineConfig:
    """The engine config of every part (`dllm`: with the block-diffusion settings, which an autoregressive
    model refuses); `overrides` replace its fields."""
    base = {"num_kv_blocks": 1024, "kv_block_size": 16, "max_batch_size": 64}
    if dllm:
        base.update(dllm_block_length=BLOCK, dllm_unmasking_strategy=STRATEGY, dllm_confidence_threshold=THRESHOLD)
    base.update(overrides)
    return EngineConfig(**base)


def dllm_blocks(prompt_len: int, n_out: int) -> int:
    """DLLM blocks an output of n_out tokens spans (the first may be the prompt's partial block)."""
    return (prompt_len + max(n_out, 1) - 1) // BLOCK - prompt_len // BLOCK + 1
