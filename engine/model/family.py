"""What the engine knows about a model family before it builds any network: one `ModelFamily` row
per `model_type`, kept by each family's package and collected in engine.model.families.

A row says which decoding paradigm the family serves (autoregressive or block diffusion), which row
of logits predicts a token (the same row, or the row before it: a *token shift*), where its block
length and mask token come from, the decoding defaults its authors publish, which config.json fields
it reads beyond the common ones, and its network class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

Paradigm = Literal["AR", "DLLM"]
# How a block-diffusion family decodes a block (engine.core.decoding picks the strategy by it):
# "block"     - every masked position of the block is a candidate at every step;
# "sub_block" - a token shift and sub-blocks decoded left to right;
# "renoising" - a canvas of random tokens, every position resampled or re-noised at every step.
BlockDecoding = Literal["block", "sub_block", "renoising"]


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    paradigm: Paradigm
    #: logits at row i predict token i+1 (causal LMs, and block-diffusion models trained with a shift)
    predicts_next: bool
    block_decoding: BlockDecoding | None = None
    #: config.json fields naming the block length, in the order they are read
    block_length_keys: tuple[str, ...] = ()
    #: the block length when neither EngineConfig nor config.json names one
    default_block_length: int | None = None
    #: vocabulary entries looked up for the mask token after config.json and the tokenizer
    mask_token_texts: tuple[str, ...] = ()
    #: EngineConfig `dllm_*` values this family decodes with unless the engine config sets them
    decoding_defaults: dict[str, object] = field(default_factory=dict)
    #: generation_config.json dict -> the EngineConfig `dllm_*` defaults the checkpoint publishes there
    #: (they replace `decoding_defaults`; fields the engine config sets win over both)
    generation_defaults: Callable[[dict], dict[str, object]] | None = None
    #: config.json dict -> the ModelSpec fields that differ from the common reading (the family's own
    #: fields; a CheckpointError naming any field it cannot honour). None: the common reading only.
    config_fields: Callable[[dict], dict[str, Any]] | None = None
    #: the network class, built as `network(spec, tp)` (most families: engine.model.layers.decoder.PreNormDecoderLM)
    network: Callable[..., nn.Module] = field(kw_only=True)

    @property
    def is_dllm(self) -> bool:
        return self.paradigm == "DLLM"
