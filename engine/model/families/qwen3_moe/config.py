"""Qwen3-MoE's config.json fields: the softmax router and which layers are routed. SDAR-MoE reads
the same fields."""

from __future__ import annotations

from typing import Any

from engine.errors import CheckpointError
from engine.model.spec import MoESpec


def moe_config_fields(cfg: dict) -> dict[str, Any]:
    """The ModelSpec fields of a Qwen3-MoE style config.json: `moe`."""
    return {"moe": moe_spec(cfg)}


def moe_spec(cfg: dict) -> MoESpec:
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

