"""Decoding paradigms behind one interface (`DecodingStrategy`): autoregressive, block diffusion and
sub-block decoding, each running the request's unmasking rule (`engine.core.decoding.rules`),
renoising (a canvas refined as a whole) and seeded blocks (per request autoregressive or block diffusion
anchored at the prompt end).

`strategy_for` picks a model family's strategy by its paradigm (`paradigm_of`: its registry row's
`paradigm`), the name the knob table (`configs.knobs`) declares knobs for.
"""

from __future__ import annotations

from configs import EngineConfig
from configs.knobs import Paradigm
from engine.core.decoding.autoregressive import AutoregressiveDecoding
from engine.core.decoding.base import DecodingStrategy, PickedRows
from engine.core.decoding.block_diffusion import BlockDiffusionDecoding
from engine.core.decoding.canvas_renoising import RenoisingDecoding
from engine.core.decoding.seeded_block import SeededBlockDecoding
from engine.core.decoding.sub_block import SubBlockDecoding
from engine.model.families import ModelFamily
from engine.model.spec import ModelSpec

STRATEGIES: dict[str, type[DecodingStrategy]] = {
    s.paradigm: s for s in (AutoregressiveDecoding, BlockDiffusionDecoding, SubBlockDecoding, RenoisingDecoding,
                            SeededBlockDecoding)}


def paradigm_of(family: ModelFamily) -> Paradigm:
    """The family's decoding paradigm, as the knob table names it."""
    return family.paradigm


def describe_paradigm(paradigm: str) -> str:
    """How an error message says what a model's paradigm is: "autoregressive", or "decoded with
    renoising decoding"."""
    return "autoregressive" if paradigm == "autoregressive" else f"decoded with {paradigm} decoding"


def strategy_for(spec: ModelSpec, config: EngineConfig, mask_id: int | None) -> DecodingStrategy:
    """The decoding strategy of the checkpoint `spec` under `config` (whose `dllm_block_length` is
    resolved)."""
    family = spec.family
    paradigm = paradigm_of(family)
    if paradigm not in STRATEGIES:
        raise ValueError(f"model_type {family.model_type!r}: no decoding strategy for paradigm {paradigm!r}")
    return STRATEGIES[paradigm].from_config(config, spec, mask_id)


__all__ = ["AutoregressiveDecoding", "BlockDiffusionDecoding", "DecodingStrategy", "PickedRows", "RenoisingDecoding",
           "SeededBlockDecoding", "SubBlockDecoding", "paradigm_of", "strategy_for"]
