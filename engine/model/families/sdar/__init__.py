"""SDAR (`model_type: sdar`): Qwen3 layers under block-causal attention, decoded by block diffusion
(every masked position of a block is a candidate at every step; no token shift). The block length is
config.json's `block_size` (4 when absent), the mask token `<|MASK|>`."""

from __future__ import annotations

from configs.knobs import Paradigm
from engine.model.family import ModelFamily
from engine.model.layers.decoder import PreNormDecoderLM

FAMILY = ModelFamily("sdar", Paradigm.BLOCK, predicts_next=False, block_length_keys=("block_size",),
                     default_block_length=4, mask_token_texts=("<|MASK|>",), network=PreNormDecoderLM)
