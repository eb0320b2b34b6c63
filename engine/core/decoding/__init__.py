"""Decoding paradigms behind one interface (`DecodingStrategy`): autoregressive and block diffusion.

`strategy_for` picks a model family's strategy: autoregressive for causal LMs; for block-diffusion
families, the one their `block_decoding` names.
"""

from __future__ import annotations

from configs import EngineConfig
from engine.core.decoding.autoregressive import AutoregressiveDecoding
from engine.core.decoding.base import DecodingStrategy, PickedRows
from engine.core.decoding.block_diffusion import BlockDiffusionDecoding
from engine.core.decoding.sub_block import SubBlockDecoding
from engine.model.families import ModelFamily


def strategy_for(family: ModelFamily, config: EngineConfig, mask_id: int | None) -> DecodingStrategy:
    """The decoding strategy of `family` under `config` (whose `dllm_block_length` is resolved)."""
    if not family.is_dllm:
        return AutoregressiveDecoding()
    if family.block_decoding == "block":
        return BlockDiffusionDecoding(config.dllm_block_length, mask_id, config.dllm_commit_fusion)
    if family.block_decoding == "sub_block":
        return SubBlockDecoding.from_config(config, mask_id)
    raise ValueError(f"model_type {family.model_type!r}: no decoding strategy for block_decoding="
                     f"{family.block_decoding!r}")


__all__ = ["AutoregressiveDecoding", "BlockDiffusionDecoding", "DecodingStrategy", "PickedRows", "SubBlockDecoding",
           "strategy_for"]
