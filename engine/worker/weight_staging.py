"""One rank's half of a weight update: stage (check and copy aside), install, or drop.

A weight update is a two-phase commit over the tensor-parallel ranks (LLMEngine.stage_weights /
commit_weights / discard_weights drive it; a caller updating several engines at once -- the
data-parallel replicas of a deployment -- runs phase one everywhere before phase two anywhere):

1. *stage*: each rank checks every tensor (a name of this model, the full shape the model's config
   implies, a floating dtype, finite values in its own slice) and copies its slice, in the serving
   dtype on the serving device, into a staging area. A checkpoint must also hold every tensor. The
   checks and the slicing are the model loader's own (engine.model.loading.checked_shards), so a
   staged slice is exactly what a fresh load from the same tensors would hold.
2. if any rank refused, every rank *discards* its staging area and the refusal (naming the tensor
   and the rank) goes to the caller: the old weights keep serving, untouched.
3. otherwise every rank *commits*: the staged slices replace the live ones (on CPU the oneDNN
   packed copies are rebuilt), the prefix cache is flushed and `weight_version` moves on.

A broadcast source receives every tensor even after a refusal (the trainer's collective must
complete); a staging area costs the updated tensors' slices once more until the commit.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.errors import CheckpointError, WeightUpdateError
from engine.model.checkpoint import ModelSpec, WeightSlice
from engine.model.families import build_network
from engine.model.layers.decoder import PreNormDecoderLM
from engine.model.layers.parallel import TPContext
from engine.model.loading import checked_shards, checkpoint_names, destination
from ops.cpu_linear import PackedLinear


def shape_template(spec: ModelSpec, tp: TPContext) -> PreNormDecoderLM:
    """The model on the meta device: its loading code and parameter shapes, no memory."""
    with torch.device("meta"):
        return build_network(spec, tp)


def stage_weights(template: PreNormDecoderLM, weights: Iterable[tuple[str, WeightSlice]], complete: bool,
                  device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """This rank's slice of every tensor, checked, in `dtype` on `device`, by checkpoint name.

    Every (name, weight) pair is consumed even after a refusal (a broadcast must run to its end);
    the refusal is raised once they all came."""
    weights = iter(weights)
    staged: dict[str, torch.Tensor] = {}
    try:
        for shard in checked_shards(template, weights, complete):
            staged[shard.name] = _checked_copy(shard.name, shard.data, device, dtype)
    except (CheckpointError, WeightUpdateError) as e:
        for _ in weights:  # drain: a broadcast's collective runs to its end
            pass
        raise WeightUpdateError(str(e)) from e
    return staged


def _checked_copy(name: str, part: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if not part.is_floating_point():
        raise WeightUpdateError(f"tensor {name!r} has dtype {part.dtype}; weights are floating point")
    with torch.no_grad():
        staged = part.to(device=device, dtype=dtype, copy=True).contiguous()
    if not bool(torch.isfinite(staged).all()):
        raise WeightUpdateError(f"tensor {name!r} holds non-finite values")
    return staged


def install_weights(model: PreNormDecoderLM, weights: dict[str, torch.Tensor]) -> None:
    """Write staged slices (by checkpoint name) into the model. A CPU linear whose dense weight was
    dropped for its oneDNN packed copy takes the staged tensor as its weight and is packed again, as
    is a tied LM head whose embedding changed."""
    params = dict(model.named_parameters(remove_duplicate=False))
    embedding = model.embed_tokens.weight
    repack: list[PackedLinear] = []
    with torch.no_grad():
        for name, local in weights.items():
            target = destination(model, name, params)
            if target is not None:
                target[0].copy_(local)
                continue
            linear = model.get_submodule(name.rpartition(".")[0])
            linear.weight = nn.Parameter(local, requires_grad=False)
            repack.append(linear)
    head = getattr(model, "lm_head", None)  # a network whose logits read the embedding itself has none
    if "model.embed_tokens.weight" in weights and isinstance(head, PackedLinear) and head.weight is embedding:
        repack.append(head)
    for linear in repack:
        PackedLinear.convert(linear, keep_dense=linear.weight is embedding)


def local_weights(model: PreNormDecoderLM, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """This rank's slices of the live weights by checkpoint name (packed CPU weights unpacked), copied
    to `device`: what `install_weights` takes back."""
    state = model.state_dict()
    out = {}
    for name in checkpoint_names(shape_template(model.spec, model.tp)):
        local, _ = destination(model, name, state)
        out[name] = local.detach().to(device, copy=True).contiguous()
    return out
