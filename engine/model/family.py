"""What the engine knows about a model family before it builds any network: one `ModelFamily` row
per `model_type`, kept by each family's package and collected in engine.model.families.

A row says which decoding paradigm the family serves (`configs.knobs.Paradigm`: autoregressive, block,
sub-block or renoising decoding; the knob table declares each one's knobs by that name), which row
of logits predicts a token (the same row, or the row before it: a *token shift*), where its block
length and mask token come from, the decoding defaults its authors publish, which config.json fields
it reads beyond the common ones, and its network class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from configs.knobs import Paradigm


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    #: how it decodes (engine.core.decoding picks the strategy by it); a paradigm's name is taken too
    paradigm: Paradigm
    #: logits at row i predict token i+1 (causal LMs, and block-diffusion models trained with a shift)
    predicts_next: bool
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "paradigm", Paradigm(self.paradigm))

    @property
    def is_dllm(self) -> bool:
        """A diffusion LM: any paradigm but autoregressive."""
        return self.paradigm is not Paradigm.AUTOREGRESSIVE
