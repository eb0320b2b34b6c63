"""What `release_memory_occupation` / `resume_memory_occupation` say about SGLang's `cuda_graph` tag is true of
the engine that answers: an engine whose runners hold no CUDA graphs (CPU, or `cuda_graphs=False`) says it has
none to release, and why, instead of claiming it dropped some; one that holds them says it dropped them."""

from __future__ import annotations

import asyncio

import pytest

from engine import EngineConfig
from engine.async_engine import AsyncEngine
from testing.tiny_checkpoint import write_tiny_checkpoint

CONFIG = EngineConfig(max_model_len=128, num_kv_blocks=32, kv_block_size=4)
DROPPED = "captured CUDA graphs dropped"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("graphs") / "qwen3", model_type="qwen3", seed=1))


@pytest.fixture(scope="module")
def cpu_engine(checkpoint):
    engine = AsyncEngine(checkpoint, CONFIG.model_copy(update={"device": "cpu"}))
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("tags", [None, [], ["cuda_graph"], ["weights", "kv_cache", "cuda_graph"]])
def test_a_cpu_engine_says_it_has_no_graphs_to_release(cpu_engine, tags):
    released = asyncio.run(cpu_engine.release_memory_occupation(tags)).message
    resumed = asyncio.run(cpu_engine.resume_memory_occupation(tags)).message
    for message, op in ((released, "release"), (resumed, "resume")):
        assert DROPPED not in message and "CUDA graphs dropped" not in message, message
        assert f"cuda_graph: nothing to {op} (no CUDA graphs: the device is cpu, not CUDA" in message, message
    assert cpu_engine.stats().state == "serving"


def test_tags_without_cuda_graph_say_nothing_of_graphs(cpu_engine):
    released = asyncio.run(cpu_engine.release_memory_occupation(["kv_cache"])).message
    resumed = asyncio.run(cpu_engine.resume_memory_occupation(["kv_cache"])).message
    assert "cuda_graph" not in released and "cuda_graph" not in resumed, (released, resumed)


def test_graphs_switched_off_are_named_as_the_reason(checkpoint):
    engine = AsyncEngine(checkpoint, CONFIG.model_copy(update={"device": "cpu", "cuda_graphs": False}))
    try:
        message = asyncio.run(engine.release_memory_occupation(["cuda_graph"])).message
    finally:
        engine.shutdown()
    assert DROPPED not in message and "cuda_graph: nothing to release (no CUDA graphs: " in message, message
    assert "cuda_graphs is false" in message, message


def test_an_engine_holding_graphs_says_it_dropped_them(cpu_engine, monkeypatch):
    """Where the runners hold captured graphs (what the executor reports of them, as on one CUDA GPU), the
    release says they were dropped and are captured again."""
    executor = cpu_engine.engine.executor
    facts = executor.describe()
    monkeypatch.setattr(executor, "describe", lambda: {**facts, "cuda_graphs": {"state": "on", "captured": 3}})
    message = asyncio.run(cpu_engine.release_memory_occupation(["cuda_graph"])).message
    assert f"cuda_graph: {DROPPED} (as by every release; captured again when steps run)" in message, message
    monkeypatch.setattr(executor, "describe", lambda: {**facts, "cuda_graphs": {"state": "off", "why": "tp=2"}})
    message = asyncio.run(cpu_engine.release_memory_occupation(["cuda_graph"])).message
    assert DROPPED not in message and "cuda_graph: nothing to release (no CUDA graphs: tp=2)" in message, message


def test_without_the_executors_graph_facts_the_device_decides(cpu_engine, monkeypatch):
    """An executor that reports nothing about graphs: a CPU engine still says it holds none."""
    executor = cpu_engine.engine.executor
    monkeypatch.setattr(executor, "describe", lambda: {"executor": "local"})
    message = asyncio.run(cpu_engine.release_memory_occupation(None)).message
    assert DROPPED not in message, message
    assert "cuda_graph: nothing to release (no CUDA graphs: the device is cpu, not CUDA)" in message, message
    asyncio.run(cpu_engine.resume_memory_occupation(None))
