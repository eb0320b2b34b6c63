"""Reading a Hugging Face style checkpoint directory without network or remote code.

A checkpoint is `config.json`, `*.safetensors` weights (one file, or shards listed by
`model.safetensors.index.json`), tokenizer files and an optional `generation_config.json`. Every
config field that changes the math is either turned into a `ModelSpec` field the model honours
exactly, or refused here with a `CheckpointError` that names it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

from safetensors import safe_open

from engine.errors import CheckpointError
from engine.model.families import FAMILIES, family_of
from engine.model.family import ModelFamily
from engine.model.spec import ModelSpec, RopeScaling, WeightSlice

SUPPORTED_MODEL_TYPES = {name: family.paradigm for name, family in FAMILIES.items()}
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")
# transformers' rotary base when a config names none (`Qwen3Config.default_theta`, Qwen3-MoE's too)
DEFAULT_ROPE_THETA = 10_000.0


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def _as_id_set(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


def _rope_fields(cfg: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, YaRN scaling or None) from `rope_scaling` (transformers 4 style, with a top-level
    `rope_theta`) or `rope_parameters` (transformers 5 style, theta inside). Unknown types are refused."""
    field_name = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = dict(cfg.get(field_name) or {})
    theta = float(cfg.get("rope_theta", params.get("rope_theta", DEFAULT_ROPE_THETA)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise CheckpointError(f"config.json {field_name}.rope_type={rope_type!r} is not supported "
                              "(supported: default, yarn)")
    if "factor" not in params:
        raise CheckpointError(f"config.json {field_name} (yarn) lacks 'factor'")
    original = int(cfg.get("original_max_position_embeddings")
                   or params.get("original_max_position_embeddings")
                   or cfg.get("max_position_embeddings", 32768))
    factor = params["factor"]
    factor = float(cfg.get("max_position_embeddings", 32768) / original if factor is None else factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return theta, RopeScaling(
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=float(attention_factor),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _refuse_sliding_window(cfg: dict) -> None:
    """Sliding-window attention is not implemented: refuse configs that switch it on (published
    Qwen3 configs carry `sliding_window` with `use_sliding_window: false`, which changes nothing)."""
    if cfg.get("use_sliding_window"):
        raise CheckpointError("config.json use_sliding_window=true: sliding-window attention is not supported")
    sliding = [t for t in cfg.get("layer_types") or [] if t != "full_attention"]
    if sliding:
        raise CheckpointError(f"config.json layer_types has {sliding[0]!r} layers: only full_attention is supported")


def _block_size(cfg: dict, family: ModelFamily) -> int | None:
    """The block length config.json names (the family's field for it), or None."""
    for key in family.block_length_keys:
        if cfg.get(key) is not None:
            return int(cfg[key])
    return None


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
    # a multimodal layout (DiffusionGemma) nests the language model's fields in `text_config`: the
    # common fields are read there, and the family's `config_fields` reads the nesting itself
    common = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    eos = _as_id_set(common.get("eos_token_id"))
    gen_file = root / "generation_config.json"
    generation = _read_json(gen_file) if gen_file.is_file() else {}
    eos |= _as_id_set(generation.get("eos_token_id"))
    heads = common["num_attention_heads"]
    _refuse_sliding_window(cfg)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise CheckpointError(f"config.json torch_dtype={dtype!r} is not one of {', '.join(_FLOAT_DTYPES)}")
    try:
        rope_theta, rope_scaling = _rope_fields(common)
        fields = dict(
            path=str(root),
            model_type=model_type,
            family=family_of(model_type),
            vocab_size=common["vocab_size"],
            hidden_size=common["hidden_size"],
            num_hidden_layers=common["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=common.get("num_key_value_heads", heads),
            head_dim=common.get("head_dim") or common["hidden_size"] // heads,
            intermediate_size=common["intermediate_size"],
            rms_norm_eps=common.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=common.get("max_position_embeddings", 32768),
            tie_word_embeddings=common.get("tie_word_embeddings", False),
            attention_bias=common.get("attention_bias", False),
            block_size=_block_size(cfg, family_of(model_type)),
            mask_token_id=common.get("mask_token_id"),
            eos_token_ids=frozenset(eos),
            torch_dtype=dtype,
            rope_scaling=rope_scaling,
        )
        family = family_of(model_type)
        if family.config_fields is not None:
            fields |= family.config_fields(cfg)
        if family.generation_defaults is not None:
            fields["generation_defaults"] = family.generation_defaults(generation)
        return ModelSpec(**fields)
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


def iter_weights(path: str | Path) -> Iterator[tuple[str, WeightSlice]]:
    """(name, lazy slice) for every tensor, file by file. Nothing is read until the slice is indexed
    (`s[...]` reads all of it, `s[a:b]` only those rows), and each memory-mapped file is closed
    before the next opens, so a loader holds its own parameters plus at most one file's touched pages."""
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)
