"""Filling a DiffusionGemmaNetwork from the checkpoint's tensors (names as transformers writes them).

The text encoder's tensors (`model.encoder.language_model.*`) are transformers' tied duplicates of
the decoder's and are accepted without being read, except `layer_scalar`, a buffer transformers does
not tie: a value unequal to the decoder's is a load error naming both. The vision tower and
`embed_vision` are skipped (images are not served), and `lm_head.weight`, when written, is the tied
embedding."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.errors import CheckpointError

ENCODER = "model.encoder.language_model."
_SKIPPED = ("model.encoder.vision_tower.", "model.encoder.embed_vision.", "lm_head.")


def load_gemma_weights(model: nn.Module, weights: Iterable[tuple[str, object]]) -> None:
    """Copy every named tensor into `model`; CheckpointError naming what is unknown, misshapen,
    missing, or an encoder `layer_scalar` unequal to the decoder's."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    encoder_scalars: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.startswith(_SKIPPED):
            continue
        if name.startswith(ENCODER):
            if name.endswith(".layer_scalar"):
                encoder_scalars[name] = tensor[...]
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
    for name, value in encoder_scalars.items():
        decoder_name = "model.decoder." + name.removeprefix(ENCODER)
        if decoder_name in params and not torch.equal(value.to(params[decoder_name].dtype).flatten(),
                                                      params[decoder_name].detach().flatten()):
            raise CheckpointError(f"{name} = {value.flatten().tolist()} differs from {decoder_name} = "
                                  f"{params[decoder_name].flatten().tolist()}: encoder and decoder share "
                                  "their layers, so their layer scalars must be equal")
