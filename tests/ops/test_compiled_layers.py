"""The compiled elementwise functions (ops.fused) on CPU, where inductor compiles C++.

Each compiled function equals its eager composition in float32 for several token counts, compiling
no new graph for a new count, and equals it bit for bit in bfloat16; a whole engine with
`EngineConfig.enable_torch_compile` (which calls `PreNormDecoderLM.use_compiled_elementwise`) gives
the same greedy tokens, step map and logprobs as without; and where compiling fails the set runs
eagerly after one warning. The shapes are the tiny checkpoints' (hidden 64, 4 query and 2 KV heads
of 16, MLP 128) and everything runs in inference mode as the runner does, so the engine tests reuse
the graphs the function tests compiled.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from engine import EngineConfig, GenerationConfig, pipeline
from ops.fused import EAGER, compiled_elementwise
from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, EPS = 64, 4, 2, 16, 128, 1e-6
FUNCTIONS = ["rms_norm", "add_rms_norm", "qk_norm_rope", "silu_and_mul"]


def arguments(name: str, tokens: int, g: torch.Generator, dtype: torch.dtype = torch.float32) -> tuple:
    """Random arguments of `name` for `tokens` rows, weights jittered around 1 as in a checkpoint."""
    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    def weight(n):
        return 1 + 0.1 * randn(n)

    angles = torch.arange(tokens)[:, None] * 0.37 * torch.arange(1, HEAD_DIM + 1)[None, :]
    return {
        "rms_norm": (randn(tokens, HIDDEN), weight(HIDDEN), EPS),
        "add_rms_norm": (randn(tokens, HIDDEN), randn(tokens, HIDDEN), weight(HIDDEN), EPS),
        "qk_norm_rope": (randn(tokens, HEADS, HEAD_DIM), randn(tokens, KV_HEADS, HEAD_DIM), angles.cos().to(dtype),
                         angles.sin().to(dtype), weight(HEAD_DIM), weight(HEAD_DIM), EPS),
        "silu_and_mul": (randn(tokens, INTER), randn(tokens, INTER)),
    }[name]


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("name", FUNCTIONS)
def test_compiled_function_equals_eager_without_recompiling(name):
    compiled, eager = getattr(compiled_elementwise(), name), getattr(EAGER, name)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for tokens in (1, 2, 3, 7, 16, 33):
            if tokens == 3:  # one graph for single rows, one for any other count: nothing new from here on
                compiled_graphs = graphs()
            args = arguments(name, tokens, g)
            torch.testing.assert_close(compiled(*args), eager(*args), rtol=1e-5, atol=1e-5)
    assert graphs() == compiled_graphs
    assert not compiled.fallback.eager


@pytest.mark.parametrize("name", FUNCTIONS)
def test_compiled_bfloat16_keeps_every_eager_rounding(name):
    """Inductor would round a bfloat16 chain once, at its end (an RMSNorm's last bit then differs in a
    quarter of its outputs); with emulate_precision_casts the compiled function is the eager one bit for bit."""
    compiled, eager = getattr(compiled_elementwise(), name), getattr(EAGER, name)
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for tokens in (1, 5):
            args = arguments(name, tokens, g, torch.bfloat16)
            torch.testing.assert_close(compiled(*args), eager(*args), rtol=0, atol=0)


def generate(pipe, prompts: list[list[int]], score_prompts: bool) -> list[tuple]:
    """(tokens, step map, chosen-token logprobs, prompt logprobs where asked) per prompt, greedy."""
    config = GenerationConfig(max_new_tokens=10, ignore_eos=True, logprobs=0,
                              logprob_start_len=0 if score_prompts else -1)
    return [(r.token_ids, r.step_map, [v for d in r.logprobs for v in d.values()],
             [v for v in r.input_token_logprobs or [] if v is not None]) for r in pipe(prompts, config)]


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    """The shared tiny SDAR and Qwen3, and a tiny SDAR-MoE (experts of 32 channels, split gate/up views)."""
    moe = write_tiny_checkpoint(tmp_path_factory.mktemp("sdar_moe"), model_type="sdar_moe",
                                logit_scale=DLLM_TEST_LOGIT_SCALE)
    return {**tiny_checkpoints, "sdar_moe": moe}


@pytest.mark.parametrize("model_type", ["sdar", "qwen3", "sdar_moe"])
def test_engine_with_compiled_model_matches_eager(checkpoints, model_type):
    prompts = [[5, 9, 13, 2, 7], [3] * 11, [8, 1]]  # odd prefill lengths, three rows a decode step
    config = EngineConfig(max_model_len=128, num_kv_blocks=64, kv_block_size=4, logprobs_mode="raw_logprobs")
    with pipeline(str(checkpoints[model_type]), config) as pipe:
        eager = generate(pipe, prompts, model_type == "qwen3")
    with pipeline(str(checkpoints[model_type]), config.model_copy(update={"enable_torch_compile": True})) as pipe:
        model = pipe.engine.executor.runner.model
        switched = {type(m).__name__ for m in model.modules() if getattr(m, "ops", None) is compiled_elementwise()}
        compiled = generate(pipe, prompts, model_type == "qwen3")
    mlp = "SparseMoeBlock" if model_type == "sdar_moe" else "MLP"
    assert switched == {"PreNormDecoderLM", "DecoderLayer", "Attention", mlp}
    assert not compiled_elementwise().rms_norm.fallback.eager, "compiling fell back to eager"
    for (tokens, steps, logprobs, prompt_logprobs), want in zip(compiled, eager, strict=True):
        assert (tokens, steps) == want[:2]
        torch.testing.assert_close(logprobs, want[2], rtol=0, atol=1e-5)
        torch.testing.assert_close(prompt_logprobs, want[3], rtol=0, atol=1e-5)


def test_a_failed_compile_runs_the_whole_set_eagerly_after_one_warning(caplog):
    ops = compiled_elementwise.__wrapped__()  # a set of its own: the shared one stays compiled

    def fail(*args):
        raise RuntimeError("no working C++ compiler")

    def never(*args):
        raise AssertionError("the set fell back: this compiled function must not run")

    ops.add_rms_norm.compiled, ops.rms_norm.compiled = fail, never
    g = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.WARNING, logger="ops.fused"):
        for name in ("add_rms_norm", "rms_norm", "add_rms_norm"):
            args = arguments(name, 5, g)
            torch.testing.assert_close(getattr(ops, name)(*args), getattr(EAGER, name)(*args), rtol=0, atol=0)
    assert [r.getMessage() for r in caplog.records] == [
        "the compiled elementwise function add_rms_norm failed (RuntimeError: no working C++ compiler); "
        "the model's elementwise work runs eagerly from now on"]
