"""Decoding paradigms behind one interface (`DecodingStrategy`): autoregressive and block diffusion."""

from engine.decoding.autoregressive import AutoregressiveDecoding
from engine.decoding.base import DecodingStrategy, PickedRows
from engine.decoding.block_diffusion import BlockDiffusionDecoding

__all__ = ["AutoregressiveDecoding", "BlockDiffusionDecoding", "DecodingStrategy", "PickedRows"]
