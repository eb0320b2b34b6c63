"""The one checked loop that reads a checkpoint's tensors into a (tensor-parallel) model.

Nothing here knows a family. Each module declares, where it creates its parameters, how a checkpoint
tensor is split for this rank (`weight_loaders`: leaf name -> `Split`, replicated by default) and,
for a parameter that stacks several checkpoint tensors, which names go into it
(`packed_modules_mapping`: see engine.model.layers.parallel). A checkpoint name is the parameter's
name, or the name of a module that maps it plus the pattern it matches; the parameter's loader then
says which view of the parameter it fills and how to cut this rank's part, so each rank reads only
its own slice (the weights may be lazy safetensors slices).

`checked_shards` is used both to load a model (`load_weights`) and to stage a weight update
(engine.worker.weight_staging), so both apply the same skip rule (the model's `ignores_tensor`: a
tied LM head, computed rotary tables) and the same name, shape and completeness checks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import CheckpointError
from engine.model.layers.parallel import REPLICATED, Split
from engine.model.spec import WeightSlice, weight_shape


@dataclass
class Shard:
    """One checkpoint tensor read for this rank: `data` is the rank's slice, `dest` the (view of the)
    parameter it belongs in, of the same shape."""

    name: str
    dest: torch.Tensor
    data: torch.Tensor


def _module(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _loader(module: nn.Module | None, leaf: str) -> Split:
    return getattr(module, "weight_loaders", {}).get(leaf, REPLICATED)


def checkpoint_names(model: nn.Module) -> list[str]:
    """Every tensor name a checkpoint must hold for `model` (per-expert names for stacked experts)."""
    names = []
    for name, param in model.named_parameters(remove_duplicate=False):
        prefix, _, leaf = name.rpartition(".")
        names += [n for n in _loader(_module(model, prefix), leaf).checkpoint_names(name, param)
                  if not model.ignores_tensor(n)]
    return names


def destination(model: nn.Module, name: str, params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Split] | None:
    """(the tensor of `params` this checkpoint tensor fills, how it is split), or None if it is no part
    of the model. `params` is `named_parameters` or a `state_dict` of `model`."""
    prefix, _, leaf = name.rpartition(".")
    if name in params:
        return _loader(_module(model, prefix), leaf).place(params[name])
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):  # the innermost module that maps the name
        owner = ".".join(parts[:i])
        module = _module(model, owner)
        mapping = getattr(module, "packed_modules_mapping", None)
        if not mapping:
            continue
        rest = ".".join(parts[i:])
        for pattern, (param_leaf, shard) in mapping.items():
            match = re.fullmatch(pattern, rest)
            param = params.get(f"{owner}.{param_leaf}")
            if match and param is not None:
                return _loader(module, param_leaf).place(param, (int(match.group(1)), shard))
        return None
    return None


def checked_shards(model: nn.Module, weights: Iterable[tuple[str, WeightSlice]],
                   complete: bool) -> Iterator[Shard]:
    """This rank's slice of every tensor of `weights`, checked against `model` (which may live on the
    meta device). Raises CheckpointError for a tensor the model does not have, a shape that differs
    from the model's, or, when `complete`, a tensor the model needs that never came."""
    params = dict(model.named_parameters(remove_duplicate=False))
    seen: set[str] = set()
    for name, weight in weights:
        if model.ignores_tensor(name):
            continue
        target = destination(model, name, params)
        if target is None:
            raise CheckpointError(f"tensor {name!r} is not part of a {model.spec.model_type} model")
        dest, split = target
        local = tuple(dest.shape)
        want, shape = split.full_shape(local), weight_shape(weight)
        if shape != want:
            raise CheckpointError(f"tensor {name!r} has shape {list(shape)}, the serving model's is {list(want)} "
                                  "(from its config.json)")
        yield Shard(name, dest, split.read(weight, local))
        seen.add(name)
    if complete:
        missing = [n for n in checkpoint_names(model) if n not in seen]
        if missing:
            raise CheckpointError(f"the checkpoint lacks tensors: {', '.join(missing[:5])}"
                                  + (" ..." if len(missing) > 5 else ""))


def load_weights(model: nn.Module, weights: Iterable[tuple[str, WeightSlice]]) -> None:
    """Copy a whole checkpoint's (name, tensor or lazy slice) pairs into `model`'s parameters."""
    with torch.no_grad():
        for shard in checked_shards(model, weights, complete=True):
            shard.dest.copy_(shard.data)

