"""SDAR-MoE (`model_type: sdar_moe`): SDAR's decoding on Qwen3-MoE's layers and config fields."""

from __future__ import annotations

from dataclasses import replace

from engine.model.families import sdar
from engine.model.families.qwen3_moe.config import moe_config_fields

FAMILY = replace(sdar.FAMILY, model_type="sdar_moe", config_fields=moe_config_fields)
