"""Fast-dLLM v2 (`model_type: Fast_dLLM_Qwen`): Qwen2 layers -- the shared pre-norm decoder with
biased q/k/v projections (o not) and no per-head q/k norm -- under block-causal attention, decoded
in sub-blocks left to right with a token shift. Blocks of config.json's `bd_size` (32 when absent),
the mask token `|<MASK>|`, the authors' confidence threshold 0.9."""

from __future__ import annotations

from typing import Any

from configs.knobs import Paradigm
from engine.model.family import ModelFamily
from engine.model.layers.decoder import PreNormDecoderLM


def config_fields(cfg: dict) -> dict[str, Any]:
    """Qwen2's layer facts (`conplemenrary_mask` and `max_window_layers` change nothing)."""
    return {"qk_norm": False, "attention_bias": True}


FAMILY = ModelFamily("Fast_dLLM_Qwen", Paradigm.SUB_BLOCK, predicts_next=True,
                     block_length_keys=("bd_size",), default_block_length=32, mask_token_texts=("|<MASK>|",),
                     decoding_defaults={"dllm_confidence_threshold": 0.9}, config_fields=config_fields,
                     network=PreNormDecoderLM)
