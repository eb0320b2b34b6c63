"""Checkpoint loading: config.json, single / sharded safetensors, tied embeddings,
dtype, tokenizer, DLLM constants, eos union, and the clear errors for broken directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine import EngineConfig, GenerationConfig, pipeline
from engine.model.checkpoint import load_model_spec
from testing.tiny_checkpoint import load_hf_reference, write_tiny_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("base"), model_type="qwen3", seed=30, logit_scale=2.0)


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("sdar"), model_type="sdar", seed=31, block_size=8)


@pytest.fixture
def copy(tmp_path):
    def make(src: Path) -> Path:
        dst = tmp_path / "ckpt"
        shutil.copytree(src, dst)
        return dst

    return make


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


def engine_state(pipe) -> dict[str, torch.Tensor]:
    return pipe.engine.executor.runner.model.state_dict()


def prompt() -> list[int]:
    return torch.randint(0, 320, (9,), generator=torch.Generator().manual_seed(3)).tolist()


def hf_greedy(path, ids: list[int], n: int) -> list[int]:
    hf = load_hf_reference(path)
    hf.generation_config.eos_token_id = None
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


# ---- what loads ---------------------------------------------------------------------------------


def test_tied_embeddings_load_without_lm_head(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "tied", model_type="qwen3", tie_word_embeddings=True, seed=32,
                                 logit_scale=2.0)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    with pipeline(str(path)) as pipe:
        model = pipe.engine.executor.runner.model
        assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
        got = pipe(prompt(), GenerationConfig(max_new_tokens=8, ignore_eos=True)).token_ids
    assert got == hf_greedy(path, prompt(), 8)


def test_sharded_index_loads_the_same_weights(tmp_path, base):
    sharded = write_tiny_checkpoint(tmp_path / "sharded", model_type="qwen3", seed=30, logit_scale=2.0, num_shards=4)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 4
    assert not (sharded / "model.safetensors").exists()
    with pipeline(str(base)) as one, pipeline(str(sharded)) as many:
        a, b = engine_state(one), engine_state(many)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
        gen = GenerationConfig(max_new_tokens=6, ignore_eos=True)
        assert one(prompt(), gen).token_ids == many(prompt(), gen).token_ids


def test_weights_equal_the_checkpoint_tensors(base):
    with pipeline(str(base)) as pipe:
        state = engine_state(pipe)
    with safe_open(str(base / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        for name in names:
            assert torch.equal(state[name], f.get_tensor(name)), name
    assert names == set(state), "every engine parameter comes from the checkpoint and vice versa"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "auto"])
def test_dtype(base, dtype):
    with pipeline(str(base), EngineConfig(dtype=dtype, device="cpu")) as pipe:
        want = torch.float32 if dtype == "auto" else getattr(torch, dtype)
        runner = pipe.engine.executor.runner
        assert {p.dtype for p in runner.model.parameters()} == {want}
        assert runner.kv_caches[0][0].dtype == want
        out = pipe(prompt(), GenerationConfig(max_new_tokens=3, ignore_eos=True, logprobs=1))
        assert len(out.token_ids) == 3 and all(isinstance(v, float) for e in out.logprobs for v in e.values())


def test_generation_config_eos_ids_are_unioned(copy, base):
    path = copy(base)
    spec = load_model_spec(path)
    assert spec.eos_token_ids == {320, 322}  # config.json 320 ∪ generation_config.json [322, 320]
    edit_json(path / "generation_config.json", eos_token_id=7)  # an int, not a list
    edit_json(path / "config.json", eos_token_id=[320, 9])
    assert load_model_spec(path).eos_token_ids == {7, 9, 320}
    (path / "generation_config.json").unlink()  # optional file
    assert load_model_spec(path).eos_token_ids == {9, 320}


def test_generation_config_eos_stops_generation(copy, base):
    path = copy(base)
    with pipeline(str(path)) as pipe:
        ref = pipe(prompt(), GenerationConfig(max_new_tokens=12, ignore_eos=True)).token_ids
    i = next(i for i in range(2, 12) if ref[i] not in ref[:i])
    edit_json(path / "generation_config.json", eos_token_id=[ref[i]])
    with pipeline(str(path)) as pipe:
        r = pipe(prompt(), GenerationConfig(max_new_tokens=12))
        assert r.token_ids == ref[: i + 1] and r.finish_reason == "stop"
        # GenerationConfig.stop_token_ids adds to the checkpoint's ids
        j = next(j for j in range(1, i) if ref[j] not in ref[:j])
        r2 = pipe(prompt(), GenerationConfig(max_new_tokens=12, stop_token_ids=[ref[j]]))
        assert r2.token_ids == ref[: j + 1] and r2.finish_reason == "stop"


def test_sdar_constants(copy, sdar):
    with pipeline(str(sdar)) as pipe:
        assert pipe.engine.is_dllm and pipe.engine.block_length == 8  # config.json block_size
        assert pipe.engine.mask_id == pipe.tokenizer.convert_tokens_to_ids("<|MASK|>")
    with pipeline(str(sdar), EngineConfig(dllm_block_length=4)) as pipe:
        assert pipe.engine.block_length == 4  # EngineConfig wins
        assert pipe.engine.unmasking_settings(GenerationConfig()).denoising_steps == 4  # default: B
    path = copy(sdar)
    edit_json(path / "config.json", block_size=None, mask_token_id=None)
    with pipeline(str(path)) as pipe:
        assert pipe.engine.block_length == 4, "no block_size anywhere: 4"
        assert pipe.engine.mask_id == pipe.tokenizer.convert_tokens_to_ids("<|MASK|>"), "tokenizer's mask_token"
        r = pipe(prompt(), GenerationConfig(max_new_tokens=5, ignore_eos=True))
        assert len(r.token_ids) == len(r.step_map) == 5
    edit_json(path / "tokenizer_config.json", mask_token=None)
    with pipeline(str(path)) as pipe:  # the <|MASK|> token of the vocabulary (test_checkpoint_resolution.py)
        assert pipe.engine.mask_id == pipe.tokenizer.convert_tokens_to_ids("<|MASK|>")


def test_config_rope_theta_spellings(copy, base):
    """rope_theta at top level (older configs) or inside rope_parameters (transformers 5)."""
    path = copy(base)
    cfg = json.loads((path / "config.json").read_text())
    theta = cfg["rope_theta"]
    edit_json(path / "config.json", rope_theta=None)
    assert load_model_spec(path).rope_theta == theta


# ---- clear errors -------------------------------------------------------------------------------


def test_missing_config_json(copy, base):
    path = copy(base)
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        pipeline(str(path))


def test_not_a_directory(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        pipeline(str(tmp_path / "nowhere"))


def test_invalid_json(copy, base):
    path = copy(base)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        pipeline(str(path))


@pytest.mark.parametrize("model_type", ["llama", None])
def test_unknown_model_type_names_supported_types(copy, base, model_type):
    path = copy(base)
    edit_json(path / "config.json", model_type=model_type)
    with pytest.raises(ValueError, match="model_type") as e:
        pipeline(str(path))
    assert "qwen3" in str(e.value) and "sdar" in str(e.value)


def test_missing_weights(copy, base):
    path = copy(base)
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        pipeline(str(path))


def test_missing_shard(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "sh", model_type="qwen3", seed=33, num_shards=3)
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00002-of-00003"):
        pipeline(str(path))


def drop_tensor(path: Path, name: str) -> None:
    """Rewrite the checkpoint's model.safetensors without tensor `name`."""
    file = path / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != name}
    save_file(tensors, str(file))


def test_missing_tensor(copy, base):
    path = copy(base)
    drop_tensor(path, "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        pipeline(str(path))


def test_untied_checkpoint_without_lm_head_is_an_error(copy, base):
    path = copy(base)
    drop_tensor(path, "lm_head.weight")
    with pytest.raises(ValueError, match="lm_head"):
        pipeline(str(path))


def test_tensor_shape_mismatch(copy, base):
    path = copy(base)
    edit_json(path / "config.json", intermediate_size=96)  # the checkpoint's MLP has 128
    with pytest.raises(ValueError, match="shape") as e:
        pipeline(str(path))
    assert "mlp" in str(e.value) and "128" in str(e.value) and "96" in str(e.value)


def test_unexpected_tensor(copy, base):
    path = copy(base)
    file = path / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.layers.7.mlp.up_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match="model.layers.7"):
        pipeline(str(path))


def test_missing_config_field(copy, base):
    path = copy(base)
    edit_json(path / "config.json", num_hidden_layers=None)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        pipeline(str(path))


def test_missing_tokenizer(copy, base):
    path = copy(base)
    (path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer"):
        pipeline(str(path))


def test_no_remote_code_is_run(copy, base):
    """auto_map / trust_remote_code entries in config.json are ignored: nothing from the directory runs."""
    path = copy(base)
    (path / "modeling_evil.py").write_text("raise SystemExit('remote code ran')\n")
    edit_json(path / "config.json", auto_map={"AutoModelForCausalLM": "modeling_evil.EvilModel"})
    edit_json(path / "tokenizer_config.json", auto_map={"AutoTokenizer": ["modeling_evil.Tok", None]})
    with pipeline(str(path)) as pipe:
        assert len(pipe(prompt(), GenerationConfig(max_new_tokens=2, ignore_eos=True)).token_ids) == 2
