"""The architecture facts of a checkpoint the engine builds a network from (`ModelSpec`), read from
its config.json by engine.model.checkpoint and by each family's own config fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.model.family import ModelFamily

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
    #: the family's row (engine.model.families), looked up by `model_type` when the spec is read
    family: ModelFamily = field(compare=False, repr=False)
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
    #: a family's own architecture facts (e.g. its router's), read by its family's `config_fields`
    extra: Any = None
    #: EngineConfig `dllm_*` defaults from generation_config.json (the family's `generation_defaults`)
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def is_dllm(self) -> bool:
        return self.family.is_dllm
