"""config.json / tokenizer_config.json shaped like the published SDAR-1.7B/4B/8B-Chat and Qwen3
releases (every field they carry, tiny dimensions, tiny random weights): the fields that change the
math are honoured exactly (YaRN rope scaling, against Hugging Face) or refused by name (sliding
window on, rope types not implemented); `torch_dtype` decides `dtype="auto"` on CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from configs import EngineConfig
from engine import GenerationConfig, pipeline
from engine.model.checkpoint import CheckpointError, load_model_spec
from engine.worker.runner import resolve_dtype
from testing.references.sdar import reference_dllm_generate
from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, load_hf_reference, write_tiny_checkpoint

TOL = 1e-4
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_hidden_layers=2)
# YaRN with a short pre-training window, so that the positions scored below reach past it and the
# tiny head dim's frequencies fall on both sides of the ramp.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def published_config(kind: str, tiny: dict, vocab_size: int, eos: int, mask: int) -> dict:
    """The field set of the published config.json (dimensions replaced by the tiny ones)."""
    common = {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643 % vocab_size,
        "eos_token_id": eos, "hidden_act": "silu", "initializer_range": 0.02, "max_window_layers": 28,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000, "sliding_window": None, "use_cache": True,
        "use_sliding_window": False, "vocab_size": vocab_size, "transformers_version": "4.52.4", **tiny,
    }
    if kind.startswith("sdar"):
        return {**common, "architectures": ["SDARForCausalLM"], "model_type": "sdar",
                "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig",
                             "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
                "max_position_embeddings": 32768, "rope_scaling": None, "torch_dtype": "bfloat16",
                "tie_word_embeddings": kind != "sdar-8b", "block_size": 4, "mask_token_id": mask,
                "sliding_window": 4096}
    if kind == "qwen3-yarn":  # Qwen3 model card: YaRN added to config.json for 131,072 tokens
        return {**common, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "max_position_embeddings": 131072, "rope_scaling": dict(YARN), "torch_dtype": "bfloat16",
                "tie_word_embeddings": False}
    assert kind == "qwen3-yarn-v5"  # transformers 5 spelling: rope_parameters with theta inside
    cfg = {**common, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "dtype": "bfloat16",
           "max_position_embeddings": 131072, "tie_word_embeddings": False,
           "rope_parameters": {**YARN, "rope_theta": 1000000.0}}
    del cfg["rope_theta"]
    return cfg


def published_tokenizer_config(path: Path) -> None:
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="Qwen2Tokenizer", errors="replace", split_special_tokens=False,
               model_max_length=131072, add_bos_token=False, bos_token=None, eos_token="<|im_end|>")
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def make(root: Path, kind: str, seed: int) -> Path:
    dllm = kind.startswith("sdar")
    tied = dllm and kind != "sdar-8b"
    path = write_tiny_checkpoint(root / kind, model_type="sdar" if dllm else "qwen3", seed=seed,
                                 tie_word_embeddings=tied, rope_theta=1e6,
                                 logit_scale=DLLM_TEST_LOGIT_SCALE if dllm else 2.0, **TINY)
    written = json.loads((path / "config.json").read_text())
    cfg = published_config(kind, TINY, written["vocab_size"], written["eos_token_id"], written.get("mask_token_id"))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    published_tokenizer_config(path)
    return path


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    kinds = ("sdar-1.7b", "sdar-4b", "sdar-8b", "qwen3-yarn", "qwen3-yarn-v5")
    return {kind: make(root, kind, 80 + i) for i, kind in enumerate(kinds)}


@pytest.mark.parametrize("kind", ["qwen3-yarn", "qwen3-yarn-v5"])
def test_yarn_logits_equal_hf(published, kind):
    path = published[kind]
    spec = load_model_spec(path)
    assert spec.max_position_embeddings == 131072 and spec.torch_dtype == "bfloat16"
    assert spec.rope_scaling is not None and spec.rope_scaling.factor == 4.0
    hf = load_hf_reference(path)
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    ids = torch.randint(0, 320, (150,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0].float()
    with pipeline(str(path), EngineConfig(logprobs_mode="raw_logits", max_model_len=256)) as pipe:
        rows = pipe(ids, GenerationConfig(max_new_tokens=0, logprob_start_len=0, logprobs=1)).input_token_logprobs
    got = torch.tensor([v for v, _ in rows])
    torch.testing.assert_close(got, want[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0], atol=TOL, rtol=0)
    # the scaling is live: ignoring it changes these logits by far more than the tolerance
    plain = json.loads((path / "config.json").read_text())
    plain.pop("rope_scaling", None)
    plain["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    with torch.inference_mode():
        unscaled = type(hf)(type(hf.config)(**{k: v for k, v in plain.items() if k != "dtype"}))
        unscaled.load_state_dict(hf.state_dict())
        other = unscaled.eval()(torch.tensor([ids])).logits[0].float()
    assert (other - want).abs().max() > 100 * TOL


@pytest.mark.parametrize("kind", ["sdar-1.7b", "sdar-4b", "sdar-8b"])
def test_sdar_published_shapes_decode_like_reference(published, kind):
    path = published[kind]
    spec = load_model_spec(path)
    assert spec.max_position_embeddings == 32768 and spec.rope_scaling is None and spec.block_size == 4
    assert spec.tie_word_embeddings == (kind != "sdar-8b")
    cfg = json.loads((path / "config.json").read_text())
    hf = load_hf_reference(path)
    prompt = [5, 77, 130, 9, 250, 31]
    with pipeline(str(path), EngineConfig(logprobs_mode="raw_logprobs", max_model_len=128)) as pipe:
        out = pipe(prompt, GenerationConfig(max_new_tokens=10, logprobs=0))
    stop_ids = {cfg["eos_token_id"], *json.loads((path / "generation_config.json").read_text())["eos_token_id"]}
    ref = reference_dllm_generate(hf, prompt, block_length=4, mask_id=cfg["mask_token_id"], max_new_tokens=10,
                                  stop_ids=stop_ids, strategy="low_confidence_dynamic", denoising_steps=4,
                                  threshold=0.85)
    assert (out.token_ids, out.step_map, out.finish_reason) == (ref.token_ids, ref.step_map, ref.finish_reason)
    for entry, tok, lp in zip(out.logprobs, out.token_ids, ref.logprobs, strict=True):
        assert abs(entry[tok] - lp) < TOL


def _edited(src: Path, dst: Path, **changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(("changes", "field"), [
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
    ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "factor"),
    ({"torch_dtype": "float8_e4m3fn"}, "torch_dtype"),
])
def test_fields_we_do_not_implement_are_refused_by_name(published, tmp_path, changes, field):
    path = _edited(published["qwen3-yarn"], tmp_path / "edited", **changes)
    with pytest.raises(CheckpointError, match=field):
        load_model_spec(path)


def test_torch_dtype_decides_auto_on_cuda_only(published, tmp_path):
    spec = load_model_spec(published["sdar-4b"])
    auto = EngineConfig(dtype="auto")
    assert resolve_dtype(auto, torch.device("cuda"), spec) == torch.bfloat16
    assert resolve_dtype(auto, torch.device("cpu"), spec) == torch.float32
    half = load_model_spec(_edited(published["sdar-4b"], tmp_path / "fp16", torch_dtype="float16"))
    assert resolve_dtype(auto, torch.device("cuda"), half) == torch.float16
    assert resolve_dtype(EngineConfig(dtype="float32"), torch.device("cuda"), half) == torch.float32
