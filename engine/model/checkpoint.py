"""Reading a Hugging Face style checkpoint directory without network or remote code.

A checkpoint is `config.json`, `*.safetensors` weights (one file, or shards listed by
`model.safetensors.index.json`), tokenizer files and an optional `generation_config.json`. Every
config field that changes the math is either turned into a `ModelSpec` field the model honours
exactly, or refused here with a `CheckpointError` that names it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.errors import CheckpointError
from engine.model.families import FAMILIES, ModelFamily, family_of
from engine.model.llada2_config import llada2_fields

SUPPORTED_MODEL_TYPES = {name: family.paradigm for name, family in FAMILIES.items()}
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")
# transformers' rotary base when a config names none (`Qwen3Config.default_theta`, Qwen3-MoE's too)
DEFAULT_ROPE_THETA = 10_000.0


# A full tensor or a safetensors slice: both index like a tensor (`x[a:b]`, `x[:, a:b]`, `x[...]`).
WeightSlice = Any


def weight_shape(weight: WeightSlice) -> tuple[int, ...]:
    return tuple(weight.shape) if isinstance(weight, torch.Tensor) else tuple(weight.get_shape())


@dataclass(frozen=True)
class MoESpec:
    """Qwen3-MoE routing: a softmax router over `num_experts`, the top `num_experts_per_tok` experts
    per token (weights renormalised to sum 1 when `norm_topk_prob`), SwiGLU experts of width
    `moe_intermediate_size`. Only the layers in `sparse_layers` are routed; the others keep a dense
    MLP of `intermediate_size`."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: frozenset[int]


@dataclass(frozen=True)
class RopeScaling:
    """YaRN rotary scaling as Hugging Face computes it (`rope_type: yarn`); every field resolved."""

    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float
    beta_slow: float
    truncate: bool


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
    moe: MoESpec | None = None
    rope_scaling: RopeScaling | None = None
    qk_norm: bool = True  # per-head RMSNorm on q and k before the rotary embedding (Qwen3; not Qwen2)
    #: a family's own architecture facts (e.g. LLaDA2's router), parsed by its entry in FAMILY_FIELDS
    extra: Any = None

    @property
    def family(self) -> ModelFamily:
        return family_of(self.model_type)

    @property
    def is_dllm(self) -> bool:
        return self.family.is_dllm


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


def _moe_fields(cfg: dict) -> MoESpec:
    # transformers 5 writes `num_local_experts`; published Qwen3-MoE configs say `num_experts`
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if num_experts is None:
        raise CheckpointError("config.json lacks 'num_experts' (or transformers 5's 'num_local_experts')")
    top_k = cfg["num_experts_per_tok"]
    if not 1 <= top_k <= num_experts:
        raise CheckpointError(f"config.json num_experts_per_tok={top_k} must be between 1 and "
                              f"num_experts={num_experts}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json hidden_act={cfg['hidden_act']!r} is not supported (silu only)")
    dense_only = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step", 1)
    sparse = frozenset(i for i in range(cfg["num_hidden_layers"])
                       if i not in dense_only and num_experts > 0 and (i + 1) % step == 0)
    return MoESpec(num_experts=num_experts, num_experts_per_tok=top_k,
                   moe_intermediate_size=cfg["moe_intermediate_size"],
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), sparse_layers=sparse)


def _block_size(cfg: dict, family: ModelFamily) -> int | None:
    """The block length config.json names (the family's field for it), or None."""
    for key in family.block_length_keys:
        if cfg.get(key) is not None:
            return int(cfg[key])
    return None


# model_type -> function(config.json dict) -> ModelSpec fields that differ from the common reading
# (the family's own fields, refusals of what it does not honour). Families without one read as Qwen3.
FAMILY_FIELDS: dict[str, Callable[[dict], dict[str, Any]]] = {
    "qwen3_moe": lambda cfg: {"moe": _moe_fields(cfg)},
    "sdar_moe": lambda cfg: {"moe": _moe_fields(cfg)},
    "llada2_moe": llada2_fields,
    # Qwen2 layers: q/k/v biased (o not), no q/k norm; `conplemenrary_mask` and `max_window_layers` change nothing
    "Fast_dLLM_Qwen": lambda cfg: {"qk_norm": False, "attention_bias": True},
}


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
    _refuse_sliding_window(cfg)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise CheckpointError(f"config.json torch_dtype={dtype!r} is not one of {', '.join(_FLOAT_DTYPES)}")
    try:
        rope_theta, rope_scaling = _rope_fields(cfg)
        fields = dict(
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
            rope_theta=rope_theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", False),
            block_size=_block_size(cfg, family_of(model_type)),
            mask_token_id=cfg.get("mask_token_id"),
            eos_token_ids=frozenset(eos),
            torch_dtype=dtype,
            rope_scaling=rope_scaling,
        )
        if model_type in FAMILY_FIELDS:
            fields |= FAMILY_FIELDS[model_type](cfg)
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
