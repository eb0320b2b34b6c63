"""What the engine derives from a checkpoint and its EngineConfig before serving, and what it counts.

`max_model_len` is bounded by the checkpoint's `max_position_embeddings`; a block-diffusion model's
mask token is looked up in a fixed order (config.json, the tokenizer, the vocabulary, the engine
config). `EngineStats` are the replica's counters (metrics, benches).
"""

from __future__ import annotations

from dataclasses import dataclass

from configs import EngineConfig
from engine.model.checkpoint import ModelSpec

MASK_TOKEN_TEXT = "<|MASK|>"


@dataclass
class EngineStats:
    steps: int = 0
    forwards: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    unmasking_steps: int = 0
    forward_seconds: float = 0.0
    step_seconds: float = 0.0
    last_step_time: float = 0.0
    isolated_failures: int = 0  # requests ended because their own step failed
    weight_updates: int = 0  # weight updates applied since start


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    """`max_model_len`, defaulting to and bounded by the checkpoint's max_position_embeddings."""
    limit = spec.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the checkpoint's max_position_embeddings="
                         f"{limit}; lower max_model_len (or leave it unset to use {limit})")
    return config.max_model_len


def resolve_mask_token_id(spec: ModelSpec, tokenizer, config: EngineConfig) -> int:
    """The mask token of a block-diffusion model: config.json `mask_token_id`, else the tokenizer's mask
    token, else the `<|MASK|>` token of the vocabulary, else `EngineConfig.dllm_mask_token_id`."""
    for candidate in (spec.mask_token_id, tokenizer.mask_token_id, tokenizer.get_vocab().get(MASK_TOKEN_TEXT),
                      config.dllm_mask_token_id):
        if candidate is not None:
            return int(candidate)
    raise ValueError(f"{spec.path}: a block-diffusion model needs a mask token and none was found: set "
                     f"mask_token_id in config.json, a mask_token in tokenizer_config.json, a {MASK_TOKEN_TEXT} token "
                     "in the vocabulary, or EngineConfig.dllm_mask_token_id")
