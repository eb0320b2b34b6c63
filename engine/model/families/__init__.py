"""The model families, one package each, and the one registry keyed by config.json's `model_type`.

A family's package holds its `FAMILY` row (engine.model.family.ModelFamily: paradigm, token shift,
block length and mask token sources, decoding defaults, config fields, network), its network or its
configuration of the shared pre-norm decoder (engine.model.layers). Its tiny-checkpoint writer and
reference implementation live outside the runtime, in the testing kit (testing/tiny/<family>.py,
testing/references/<family>.py), which nothing here imports. Adding a family is one package plus one
row in `FAMILIES` below (docs/adding-a-family.md).
"""

from __future__ import annotations

from torch import nn

from engine.model.families import (
    diffusion_gemma,
    fast_dllm_qwen,
    llada2_moe,
    nemotron_labs_diffusion,
    qwen3,
    qwen3_moe,
    sdar,
    sdar_moe,
)
from engine.model.family import ModelFamily
from engine.model.layers.parallel import TPContext
from engine.model.spec import ModelSpec

FAMILIES: dict[str, ModelFamily] = {f.model_type: f for f in (
    qwen3.FAMILY,
    qwen3_moe.FAMILY,
    sdar.FAMILY,
    sdar_moe.FAMILY,
    llada2_moe.FAMILY,
    fast_dllm_qwen.FAMILY,
    diffusion_gemma.FAMILY,
    nemotron_labs_diffusion.FAMILY,
)}

__all__ = ["FAMILIES", "ModelFamily", "build_network", "family_of"]


def family_of(model_type: str) -> ModelFamily:
    """The family of a supported `model_type` (KeyError otherwise: checkpoint reading refuses first)."""
    return FAMILIES[model_type]


def build_network(spec: ModelSpec, tp: TPContext | None = None) -> nn.Module:
    """The (unallocated, when built under `torch.device("meta")`) network for `spec`'s family.

    Every network is built from a `ModelSpec` and a `TPContext`, then `materialize`d and loaded
    (engine.model.loading); it exposes `forward` (final hidden states of the fed tokens), `logits`
    (full-vocabulary float32 rows for the hidden rows asked for), `use_compiled_elementwise`,
    `ignores_tensor`, `spec`, `tp` and `moe_stats`, so the runner never knows which one it runs."""
    return family_of(spec.model_type).network(spec, tp)
