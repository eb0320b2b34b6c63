"""Decoding paradigms behind one interface (`DecodingStrategy`): autoregressive and block diffusion."""

from engine.core.decoding.autoregressive import AutoregressiveDecoding
from engine.core.decoding.base import DecodingStrategy, PickedRows
from engine.core.decoding.block_diffusion import BlockDiffusionDecoding

__all__ = ["AutoregressiveDecoding", "BlockDiffusionDecoding", "DecodingStrategy", "PickedRows"]
