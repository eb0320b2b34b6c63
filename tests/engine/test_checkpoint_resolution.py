"""What the engine resolves from a checkpoint at load: the block-diffusion mask token (config.json
`mask_token_id`, else the tokenizer's mask token, else `<|MASK|>` in the vocabulary, else
`EngineConfig.dllm_mask_token_id`) and `max_model_len` (defaults to and is bounded by
`max_position_embeddings`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine import EngineConfig, pipeline
from testing.tiny_checkpoint import write_tiny_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("mask") / "sdar", model_type="sdar",
                                 max_position_embeddings=96)


def _edit(path: Path, name: str, fn) -> None:
    data = json.loads((path / name).read_text())
    fn(data)
    (path / name).write_text(json.dumps(data))


def _variant(base: Path, tmp_path: Path, *, config_id=..., tokenizer_mask=..., rename_vocab_mask=False) -> Path:
    path = tmp_path / "ckpt"
    shutil.copytree(base, path)
    if config_id is not ...:
        _edit(path, "config.json", lambda c: c.pop("mask_token_id") if config_id is None
              else c.update(mask_token_id=config_id))
    if tokenizer_mask is not ...:
        _edit(path, "tokenizer_config.json", lambda c: c.pop("mask_token") if tokenizer_mask is None
              else c.update(mask_token=tokenizer_mask))
    if rename_vocab_mask:
        def rename(tok):
            for t in tok["added_tokens"]:
                if t["content"] == "<|MASK|>":
                    t["content"] = "<|HOLE|>"
        _edit(path, "tokenizer.json", rename)
        _edit(path, "tokenizer_config.json", lambda c: [v.update(content="<|HOLE|>") for v in
                                                         c.get("added_tokens_decoder", {}).values()
                                                         if v["content"] == "<|MASK|>"])
    return path


def _mask_id(path: Path, **engine) -> int:
    with pipeline(str(path), EngineConfig(**engine)) as pipe:
        return pipe.engine.mask_id


def test_mask_token_resolution_order(base, tmp_path):
    vocab_mask = _mask_id(base)  # config.json names the <|MASK|> token
    assert _mask_id(_variant(base, tmp_path / "a", config_id=100)) == 100, "config.json first"
    with pipeline(str(base)) as pipe:
        im_start = pipe.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert _mask_id(_variant(base, tmp_path / "b", config_id=None, tokenizer_mask="<|im_start|>")) == im_start, \
        "then the tokenizer's mask token"
    assert _mask_id(_variant(base, tmp_path / "c", config_id=None, tokenizer_mask=None)) == vocab_mask, \
        "then <|MASK|> in the vocabulary"
    bare = _variant(base, tmp_path / "d", config_id=None, tokenizer_mask=None, rename_vocab_mask=True)
    assert _mask_id(bare, dllm_mask_token_id=7) == 7, "then EngineConfig.dllm_mask_token_id"
    with pytest.raises(ValueError) as e:
        _mask_id(bare)
    for named in ("mask_token_id", "mask_token", "<|MASK|>", "dllm_mask_token_id"):
        assert named in str(e.value)


def test_max_model_len_defaults_to_and_is_capped_by_max_position_embeddings(base):
    with pipeline(str(base)) as pipe:
        assert pipe.engine.config.max_model_len == 96
    with pipeline(str(base), EngineConfig(max_model_len=64)) as pipe:
        assert pipe.engine.config.max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len=128 exceeds .*max_position_embeddings=96"):
        pipeline(str(base), EngineConfig(max_model_len=128))
