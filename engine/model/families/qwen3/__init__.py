"""Qwen3 (`model_type: qwen3`): a causal LM on the shared pre-norm decoder as it is (per-head q/k
RMSNorm, unbiased projections), decoded autoregressively. config.json needs nothing beyond the
common fields."""

from __future__ import annotations

from configs.knobs import Paradigm
from engine.model.family import ModelFamily
from engine.model.layers.decoder import PreNormDecoderLM

FAMILY = ModelFamily("qwen3", Paradigm.AUTOREGRESSIVE, predicts_next=True, network=PreNormDecoderLM)
