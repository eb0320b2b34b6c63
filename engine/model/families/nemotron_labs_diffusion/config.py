"""The Nemotron-Labs-Diffusion family's own config.json fields (`model_type: nemotron_labs_diffusion`).

The released config.json describes a Ministral-3 decoder: no biases, no per-head q/k norm, no sliding
window, an untied head (`diffusion_head`), YaRN rotary scaling from `rope_parameters` and, from the
same dict, Llama-4's query scaling past the original context (`llama_4_scaling_beta` over
`original_max_position_embeddings`). The common reading (engine.model.checkpoint) already takes the
YaRN fields -- with `mscale` = `mscale_all_dim` = 1 the cos/sin factor is exactly 1 -- so this module
adds the query scaling and refuses, by name, every field whose value the network does not compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import CheckpointError

# config.json fields that must keep the released value: (field, accepted values, the released value)
_ONLY = (
    ("dlm_paradigm", (None, "bidirectional"), "bidirectional"),
    ("sliding_window", (None,), "null"),
    ("attention_bias", (None, False), "false"),
    ("mlp_bias", (None, False), "false"),
    ("tie_word_embeddings", (None, False), "false: the only head is the untied diffusion_head"),
    ("hidden_act", (None, "silu"), "silu"),
)


@dataclass(frozen=True)
class NemotronLabsDiffusionSpec:
    """`ModelSpec.extra` of a `nemotron_labs_diffusion` checkpoint."""

    #: Llama-4 query scaling: after the rotary embedding each query row is multiplied by
    #: `1 + beta * ln(1 + floor(position / original_max_position_embeddings))` (beta 0: no scaling)
    llama_4_scaling_beta: float
    original_max_position_embeddings: int


def llama_4_query_scale(positions: torch.Tensor, beta: float, original_max_position_embeddings: int) -> torch.Tensor:
    """The float32 factor [T] of each query row at `positions` [T]: exactly 1 below the original
    context, then rising by `beta * ln(2)`, `beta * ln(3)`, ... at each multiple of it."""
    return 1 + beta * torch.log(1 + torch.floor(positions.float() / original_max_position_embeddings))


def _rope_dict(cfg: dict) -> dict:
    return dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})


def nemotron_fields(cfg: dict) -> dict[str, Any]:
    """The ModelSpec fields of a released config.json beyond the common reading, or a CheckpointError
    naming the field whose value this engine does not compute."""
    for name, accepted, released in _ONLY:
        if cfg.get(name) not in accepted:
            raise CheckpointError(f"config.json {name}={cfg[name]!r} is not supported for nemotron_labs_diffusion "
                                  f"(supported: {released})")
    mask = cfg.get("mask_token_id")
    if mask is not None and not 0 <= int(mask) < int(cfg["vocab_size"]):
        raise CheckpointError(f"config.json mask_token_id={mask} is outside the vocabulary "
                              f"(vocab_size {cfg['vocab_size']})")
    rope = _rope_dict(cfg)
    beta = float(rope.get("llama_4_scaling_beta") or 0.0)
    original = rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if beta and not original:
        raise CheckpointError("config.json rope_parameters.llama_4_scaling_beta is set without "
                              "original_max_position_embeddings, the context its query scaling starts after")
    extra = NemotronLabsDiffusionSpec(llama_4_scaling_beta=beta,
                                      original_max_position_embeddings=int(original or cfg["max_position_embeddings"]))
    return {"qk_norm": False, "attention_bias": False, "extra": extra}
