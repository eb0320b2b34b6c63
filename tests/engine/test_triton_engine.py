"""Whole engine runs on the `triton` attention backend (its kernel under Triton's interpreter, float32)
against the same runs on the torch reference backend: the same tokens, step maps and finish reasons,
logprobs within 1e-5, for every paradigm the kernel serves -- SDAR block diffusion, LLaDA2 with
JointThreshold token editing, Fast-dLLM v2's sub-blocks, Qwen3 AR with scored prompts. And the
backend is honoured only where it can run: refused by name on a CPU outside the interpreter, for
DiffusionGemma's passes too (whose engine runs on it are in families/test_diffusion_gemma_triton_engine.py).
"""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, GenerationConfig, pipeline
from ops.attention import TritonAttention, make_attention_backend
from testing.tiny_fast_dllm import FAST_DLLM_TEST_LOGIT_SCALE, write_tiny_fast_dllm
from testing.tiny_llada2 import write_tiny_llada2
from tests.support.outputs import assert_same_outputs


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in lengths]


def both_backends(path: str, ps: list[list[int]], gen: GenerationConfig | list[GenerationConfig], **engine):
    """Outputs on (triton, torch), each on an engine of its own."""
    outs = []
    for backend in ("triton", "torch"):
        config = EngineConfig(kv_block_size=16, num_kv_blocks=96, max_model_len=256, max_prefill_token_num=24,
                              attention_backend=backend, **engine)
        with pipeline(path, engine_config=config) as pipe:
            assert pipe.engine.executor.runner.backend.name == backend
            outs.append(pipe(ps, gen))
    return outs


def test_sdar_block_diffusion(dllm_ckpt):
    gen = GenerationConfig(max_new_tokens=14, ignore_eos=True, logprobs=1)
    assert_same_outputs(*both_backends(dllm_ckpt, prompts([30, 9, 17, 4], seed=1), gen, dllm_block_length=4,
                                       logprobs_mode="raw_logprobs"))


def test_qwen3_ar_with_scored_prompts(ar_ckpt):
    gen = GenerationConfig(max_new_tokens=8, ignore_eos=True, logprob_start_len=3, logprobs=2)
    assert_same_outputs(*both_backends(ar_ckpt, prompts([40, 5, 21], seed=2), gen, logprobs_mode="raw_logprobs"))


def test_llada2_joint_threshold_with_four_query_heads_per_kv_head(tmp_path):
    path = str(write_tiny_llada2(tmp_path, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=2, seed=3))
    gen = GenerationConfig(max_new_tokens=36, ignore_eos=True, dllm_unmasking_strategy="joint_threshold")
    triton_outs, torch_outs = both_backends(path, prompts([45], seed=3), gen)
    assert_same_outputs(triton_outs, torch_outs)
    assert any(len(set(o.step_map)) > 1 for o in torch_outs), "the run unmasked over several steps"


def test_fast_dllm_v2_sub_blocks(tmp_path):
    path = str(write_tiny_fast_dllm(tmp_path, seed=11, logit_scale=FAST_DLLM_TEST_LOGIT_SCALE))
    gen = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    assert_same_outputs(*both_backends(path, prompts([12, 37], seed=4), gen, dllm_sub_block_length=8))


def test_refused_by_name_where_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"attention_backend='triton' cannot run: the Triton kernel runs on CUDA"):
        make_attention_backend("triton", torch.device("cpu"), torch.float32, 16, 64, 4)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend = make_attention_backend("triton", torch.device("cpu"), torch.float32, 16, 64, 4)
    assert isinstance(backend, TritonAttention) and backend.graph_safe and backend.rows_per_tile == 4


def test_diffusion_gemma_refuses_it_by_name_where_it_cannot_run(gemma_ckpt, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"attention_backend='triton' cannot run: the Triton kernel runs on CUDA"):
        with pipeline(str(gemma_ckpt), engine_config=EngineConfig(attention_backend="triton")):
            pass
