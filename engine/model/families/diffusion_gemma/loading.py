"""Filling a DiffusionGemmaNetwork from the checkpoint's tensors (names as transformers writes them),
for the network on its own; the engine loads it through its shared loader, which applies the same
`ignores_tensor` rule and then `check_loaded`."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.errors import CheckpointError
from engine.model.families.diffusion_gemma.network import DiffusionGemmaNetwork


def load_gemma_weights(model: DiffusionGemmaNetwork, weights: Iterable[tuple[str, object]]) -> None:
    """Copy every named tensor into `model`; CheckpointError naming what is unknown, misshapen,
    missing, or an encoder `layer_scalar` unequal to the decoder's."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if model.ignores_tensor(name):
            continue
        target = params.get(name)
        if target is None:
            raise CheckpointError(f"checkpoint tensor {name!r} is not part of the DiffusionGemma network")
        value = tensor[...]
        if tuple(value.shape) != tuple(target.shape):
            raise CheckpointError(f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, "
                                  f"the network expects {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(value)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"the checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    model.check_loaded()
