"""Qwen3-MoE (`model_type: qwen3_moe`): Qwen3 layers whose MLPs are routed experts
(engine.model.layers.moe.SparseMoeBlock) in the layers config.json routes; decoded autoregressively."""

from __future__ import annotations

from configs.knobs import Paradigm
from engine.model.families.qwen3_moe.config import moe_config_fields
from engine.model.family import ModelFamily
from engine.model.layers.decoder import PreNormDecoderLM

FAMILY = ModelFamily("qwen3_moe", Paradigm.AUTOREGRESSIVE, predicts_next=True, config_fields=moe_config_fields,
                     network=PreNormDecoderLM)
