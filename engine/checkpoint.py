"""Reading a Hugging Face style checkpoint directory (CONTRACT.md §1) without network or remote code."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

SUPPORTED_MODEL_TYPES = {"qwen3": "AR", "sdar": "DLLM"}


class CheckpointError(ValueError):
    """The checkpoint directory is missing something or holds something we cannot serve."""


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts the engine needs, read from config.json (+ generation_config.json)."""

    path: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    block_size: int | None
    mask_token_id: int | None
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    torch_dtype: str | None = None

    @property
    def is_dllm(self) -> bool:
        return SUPPORTED_MODEL_TYPES[self.model_type] == "DLLM"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def _as_id_set(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


def load_model_spec(path: str | Path) -> ModelSpec:
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"model path {str(root)!r} is not a directory")
    config_file = root / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{root} has no config.json; a checkpoint directory needs one")
    cfg = _read_json(config_file)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"unsupported model_type {model_type!r} in {config_file}; "
            f"supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    eos = _as_id_set(cfg.get("eos_token_id"))
    gen_file = root / "generation_config.json"
    if gen_file.is_file():
        eos |= _as_id_set(_read_json(gen_file).get("eos_token_id"))
    heads = cfg["num_attention_heads"]
    try:
        return ModelSpec(
            path=str(root),
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 1e6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", False),
            block_size=cfg.get("block_size"),
            mask_token_id=cfg.get("mask_token_id"),
            eos_token_ids=frozenset(eos),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )
    except KeyError as e:
        raise CheckpointError(f"{config_file} lacks required field {e.args[0]!r}") from e


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or the single file."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        files = [root / s for s in shards]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"shards named in {index} are missing: {', '.join(missing)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root} has no *.safetensors weights")
    return files


def iter_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_tokenizer(path: str | Path):
    """The checkpoint's fast tokenizer (tokenizer.json + tokenizer_config.json), local files only.

    Loaded as `PreTrainedTokenizerFast` directly: AutoTokenizer would consult config.json, whose
    `sdar` model_type transformers does not know, and it never runs code from the checkpoint.
    """
    from transformers import PreTrainedTokenizerFast

    root = Path(path)
    if not (root / "tokenizer.json").is_file():
        raise CheckpointError(f"{root} has no tokenizer.json (a fast tokenizer file is required)")
    return PreTrainedTokenizerFast.from_pretrained(str(root), local_files_only=True)
