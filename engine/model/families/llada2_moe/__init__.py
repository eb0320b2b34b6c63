"""LLaDA2.x (`model_type: llada2_moe`, inclusionAI's `LLaDA2MoeModelLM`): its own layers (fused QKV,
partial rotary, sigmoid-routed experts -- group-limited, or per block in LLaDA2.2 -- and shared
experts) under block-causal attention, decoded by block diffusion without a token shift. Blocks of
32 (config.json `block_size` where it names one: LLaDA2.2's routing block), the mask token
`<|mask|>`, and SGLang's LowConfidence defaults (threshold 0.95, up to the whole block per step)."""

from __future__ import annotations

from configs.knobs import Paradigm
from engine.model.families.llada2_moe.config import llada2_fields
from engine.model.families.llada2_moe.network import LLaDA2MoeModelLM
from engine.model.family import ModelFamily

FAMILY = ModelFamily("llada2_moe", Paradigm.BLOCK, predicts_next=False,
                     block_length_keys=("block_size",), default_block_length=32, mask_token_texts=("<|mask|>",),
                     decoding_defaults={"dllm_confidence_threshold": 0.95,
                                        "dllm_unmasking_strategy": "low_confidence_dynamic"},
                     config_fields=llada2_fields, network=LLaDA2MoeModelLM)
