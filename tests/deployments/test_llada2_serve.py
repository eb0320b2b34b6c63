"""LLaDA2 served: SGLang's /generate body with the per-request decoding fields, over real HTTP, from a
tensor-parallel (tp=2) deployment, equals the in-process tp=1 pipeline -- LowConfidence (the family's
defaults, applied in the served engine too), JointThreshold (edits, λ penalty) and insert/delete
editing (its trace's moves and deletions) alike: tokens, step_map, finish reasons, logprobs, step
trace. (A served tp=1 engine is the pipeline's engine behind the same ingress and EngineServer code,
so the tp=2 deployment covers both sides.)"""

from __future__ import annotations

import random

import httpx
import pytest
from ray import serve

from configs import EngineConfig
from engine import GenerationConfig, pipeline
from testing.tiny_llada2 import write_tiny_llada2
from tests.support.serve import deploy

# the edit tokens of insert/delete editing: ids the tiny model writes now and then
ENGINE = {"max_model_len": 512, "kv_block_size": 16, "num_kv_blocks": 96, "logprobs_mode": "raw_logprobs",
          "dllm_delete_token_id": 128, "dllm_split_token_id": 295}
RULES = {
    "low_confidence": {"stop_token_ids": [241]},
    "joint_threshold": {"stop_token_ids": [155], "dllm_unmasking_strategy": "joint_threshold",
                        "dllm_edit_threshold": 0.6, "dllm_max_post_edit_steps": 4, "dllm_penalty_lambda": 1.0},
    "joint_threshold_indel": {"dllm_unmasking_strategy": "joint_threshold_indel", "dllm_max_post_edit_steps": 16,
                              "dllm_confidence_threshold": 0.9},
}


@pytest.mark.parametrize("expert_capacity", [None, 4], ids=["group_routing", "block_routing"])
def test_http_at_tp2_equals_the_tp1_pipeline(serve_cluster, tmp_path_factory, expert_capacity):
    """Per rule; on LLaDA2.1's group routing and on LLaDA2.2's block routing (4 of the 8 experts per
    32-token routing block)."""
    path = write_tiny_llada2(tmp_path_factory.mktemp("llada2_serve"), use_qkv_bias=True, use_bias=True, seed=0,
                             expert_capacity=expert_capacity)
    prompts = [[random.Random(n).randrange(300) for _ in range(n)] for n in (3, 35)]
    with pipeline(str(path), EngineConfig(**ENGINE)) as pipe:
        want = {rule: pipe(prompts, GenerationConfig(max_new_tokens=40, logprobs=0, return_step_trace=True, **knobs))
                for rule, knobs in RULES.items()}
    app = deploy(serve_cluster, f"llada2_tp2_{expert_capacity or 0}", path, dict(ENGINE, tp=2))
    try:
        for rule, knobs in RULES.items():
            body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 40, "temperature": 0, **knobs},
                    "return_logprob": True, "return_step_trace": True}
            got = httpx.post(app.url + "/generate", json=body, timeout=600).json()
            for g, w in zip(got, want[rule], strict=True):
                meta = g["meta_info"]
                assert g["output_ids"] == w.token_ids and meta["finish_reason"]["type"] == w.finish_reason
                values = [row[0] for row in meta["output_token_logprobs"]]
                assert values == pytest.approx([e[t] for e, t in zip(w.logprobs, w.token_ids, strict=True)],
                                               abs=1e-4), rule
                assert meta["step_map"] == w.step_map and meta["step_trace"] == w.step_trace, rule
        if expert_capacity is None:  # (the block-routed weights write no edit token for these prompts)
            indel = want["joint_threshold_indel"]
            assert any("moves" in e for out in indel for e in out.step_trace), "the requests delete or split"
    finally:
        serve.delete(app.name)
