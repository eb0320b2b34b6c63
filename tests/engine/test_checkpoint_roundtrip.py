"""Checkpoints as a trainer saves them: transformers 5's `save_pretrained`, for all four model types.

Its config.json differs from published ones: Qwen3-MoE's expert count is `num_local_experts`, the
rotary base sits inside `rope_parameters` (no top-level `rope_theta`). Such a checkpoint loads, the
engine's greedy tokens and logprobs equal Hugging Face's (`Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`,
SDAR's layers, under the block-causal reference for the DLLM types), and `update_weights_from_disk`
of it onto a running engine equals a fresh engine on it. A config naming no rotary base gets
transformers' default, not a value of our own.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from engine import EngineConfig, GenerationConfig, pipeline
from engine.model.checkpoint import DEFAULT_ROPE_THETA, load_model_spec
from testing.references.sdar import reference_dllm_generate
from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, load_hf_reference, write_tiny_checkpoint

CONFIG = EngineConfig(max_model_len=128, num_kv_blocks=64, kv_block_size=4, logprobs_mode="raw_logprobs",
                      dllm_unmasking_strategy="low_confidence_dynamic")
PARAMS = GenerationConfig(max_new_tokens=12, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 9, 13, 22, 7, 8, 9, 10, 31, 4], [77, 3, 120]]
TOL = 1e-4
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, router_scale=4.0)


def tiny(path: Path, model_type: str, seed: int) -> Path:
    dllm = model_type.startswith("sdar")
    return write_tiny_checkpoint(path, model_type=model_type, seed=seed,
                                 logit_scale=DLLM_TEST_LOGIT_SCALE if dllm else 2.0,
                                 **(MOE if model_type.endswith("_moe") else {}))


def save_as_a_trainer(source: Path, out: Path) -> transformers.PreTrainedModel:
    """`save_pretrained` of the Hugging Face model, plus the tokenizer files; for SDAR the keys its
    own config class writes (model_type, architectures, block_size, mask_token_id) on top."""
    hf = load_hf_reference(source)
    hf.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out / name)
    original = json.loads((source / "config.json").read_text())
    if original["model_type"].startswith("sdar"):
        cfg = json.loads((out / "config.json").read_text())
        for key in ("model_type", "architectures", "block_size", "mask_token_id"):
            cfg[key] = original[key]
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return hf


def hf_outputs(hf: transformers.PreTrainedModel, path: Path, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Hugging Face's greedy tokens and the raw logprob of each (the block-causal reference for SDAR)."""
    cfg = json.loads((path / "config.json").read_text())
    if cfg["model_type"].startswith("sdar"):
        ref = reference_dllm_generate(hf, prompt, block_length=cfg["block_size"], mask_id=cfg["mask_token_id"],
                                      max_new_tokens=PARAMS.max_new_tokens, stop_ids=set(),
                                      strategy="low_confidence_dynamic", denoising_steps=cfg["block_size"],
                                      threshold=0.85)
        return ref.token_ids, ref.logprobs
    ids = torch.tensor([prompt])
    hf.generation_config.eos_token_id = None  # never stop early, as ignore_eos
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=PARAMS.max_new_tokens,
                          do_sample=False, return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = torch.stack(out.logits, 1)[0].float().log_softmax(-1)
    return tokens, [float(logprobs[i, t]) for i, t in enumerate(tokens)]


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "sdar", "sdar_moe"])
def test_a_save_pretrained_checkpoint_loads_equals_hf_and_updates_from_disk(tmp_path, model_type):
    saved = tmp_path / "saved"
    hf = save_as_a_trainer(tiny(tmp_path / "source", model_type, seed=1), saved)
    cfg = json.loads((saved / "config.json").read_text())
    assert "rope_theta" not in cfg and cfg["rope_parameters"]["rope_theta"] == 10000.0
    if model_type.endswith("_moe"):
        assert "num_local_experts" in cfg and "num_experts" not in cfg  # transformers 5's spelling
        assert load_model_spec(saved).moe.num_experts == MOE["num_experts"]
    with pipeline(str(saved), CONFIG) as pipe:
        fresh = pipe(PROMPTS, PARAMS)
    for prompt, got in zip(PROMPTS, fresh, strict=True):
        tokens, logprobs = hf_outputs(hf, saved, prompt)
        assert got.token_ids == tokens
        assert [e[t] for e, t in zip(got.logprobs, got.token_ids, strict=True)] == pytest.approx(logprobs, abs=TOL)
    # a running engine on other weights (a published-style config) takes the saved checkpoint from disk
    with pipeline(str(tiny(tmp_path / "other", model_type, seed=2)), CONFIG) as pipe:
        before = pipe(PROMPTS, PARAMS)
        assert pipe.update_weights_from_disk(str(saved), weight_version="saved") == "saved"
        after = pipe(PROMPTS, PARAMS)
    assert [r.token_ids for r in before] != [r.token_ids for r in fresh]
    for got, want in zip(after, fresh, strict=True):
        assert (got.token_ids, got.step_map, got.weight_version) == (want.token_ids, want.step_map, "saved")
        assert [v for e in got.logprobs for v in e.values()] == pytest.approx(
            [v for e in want.logprobs for v in e.values()], abs=1e-5)


def test_a_config_without_rope_theta_gets_the_transformers_default(tmp_path):
    assert DEFAULT_ROPE_THETA == transformers.Qwen3Config.default_theta == transformers.Qwen3MoeConfig.default_theta
    saved = tmp_path / "saved"
    hf = save_as_a_trainer(tiny(tmp_path / "source", "qwen3", seed=3), saved)
    cfg = json.loads((saved / "config.json").read_text())
    del cfg["rope_parameters"]["rope_theta"]
    (saved / "config.json").write_text(json.dumps(cfg))
    assert transformers.Qwen3Config.from_pretrained(saved).rope_parameters["rope_theta"] == DEFAULT_ROPE_THETA
    assert load_model_spec(saved).rope_theta == DEFAULT_ROPE_THETA
    with pipeline(str(saved), CONFIG) as pipe:
        got = pipe(PROMPTS[0], PARAMS)
    tokens, logprobs = hf_outputs(hf, saved, PROMPTS[0])
    assert got.token_ids == tokens
    assert [e[t] for e, t in zip(got.logprobs, got.token_ids, strict=True)] == pytest.approx(logprobs, abs=TOL)


def test_a_moe_config_naming_no_expert_count_is_refused(tmp_path):
    from engine.errors import CheckpointError

    path = tiny(tmp_path / "m", "qwen3_moe", seed=0)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["num_experts"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="lacks 'num_experts' \\(or transformers 5's 'num_local_experts'\\)"):
        load_model_spec(path)
