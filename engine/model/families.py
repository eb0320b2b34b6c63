"""Model families: what the engine knows about each `model_type` before it builds any network.

One row per `model_type` a checkpoint may name. A row says which decoding paradigm the family
serves (autoregressive or block diffusion), which row of logits predicts a token (the same row, or
the row before it: a *token shift*), where its block length and mask token come from, and the
decoding defaults its authors publish. The network class for each family is chosen in
`engine.model.architectures`; the decoding strategy in `engine.core.decoding`. Adding a family is
one row here, one there, and its network module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Paradigm = Literal["AR", "DLLM"]
# How a block-diffusion family decodes a block (engine.core.decoding picks the strategy by it):
# "block"     - every masked position of the block is a candidate at every step (SDAR, LLaDA2);
# "sub_block" - a token shift and sub-blocks decoded left to right (Fast-dLLM v2).
BlockDecoding = Literal["block", "sub_block"]


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

    @property
    def is_dllm(self) -> bool:
        return self.paradigm == "DLLM"


_SDAR = dict(paradigm="DLLM", predicts_next=False, block_decoding="block", block_length_keys=("block_size",),
             default_block_length=4, mask_token_texts=("<|MASK|>",))

FAMILIES: dict[str, ModelFamily] = {f.model_type: f for f in (
    ModelFamily("qwen3", "AR", predicts_next=True),
    ModelFamily("qwen3_moe", "AR", predicts_next=True),
    ModelFamily("sdar", **_SDAR),
    ModelFamily("sdar_moe", **_SDAR),
    # inclusionAI's LLaDA2.x: blocks of 32, `<|mask|>`, SGLang's LowConfidence defaults (t = 0.95, S = B)
    ModelFamily("llada2_moe", "DLLM", predicts_next=False, block_decoding="block", default_block_length=32,
                mask_token_texts=("<|mask|>",),
                decoding_defaults={"dllm_confidence_threshold": 0.95,
                                   "dllm_unmasking_strategy": "low_confidence_dynamic"}),
    ModelFamily("Fast_dLLM_Qwen", "DLLM", predicts_next=True, block_decoding="sub_block",
                block_length_keys=("bd_size",), default_block_length=32, mask_token_texts=("|<MASK>|",),
                decoding_defaults={"dllm_confidence_threshold": 0.9}),
)}


def family_of(model_type: str) -> ModelFamily:
    """The family of a supported `model_type` (KeyError otherwise: checkpoint reading refuses first)."""
    return FAMILIES[model_type]
