"""Where each checkpoint tensor goes in a (tensor-parallel) model, and the one checked loop that
reads a checkpoint's tensors into it.

Parameter names equal the checkpoint's tensor names except for routed experts, which are stacked
per layer (`w13` = gate and up, `w2` = down). Under tensor parallelism each tensor is split by its
kind: column-parallel projections (q/k/v, gate/up) by output rows, a fused QKV projection by output
rows of each of its three parts (a rank's query, key and value heads), row-parallel ones (o, down,
LLaDA2's `dense`) by input columns, the embedding and LM head by vocabulary rows (the last rank
zero-padded), everything else replicated. Each rank reads only its own slice (the weights may be
lazy safetensors slices).

`checked_shards` is used both to load a model (`Qwen3ForCausalLM.load_weights`) and to stage a
weight update (engine.worker.weight_staging), so both apply the same skip rule (a tied LM head is
the embedding; rotary tables are computed) and the same name, shape and completeness checks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.model.checkpoint import CheckpointError, WeightSlice, weight_shape

if TYPE_CHECKING:
    from engine.model.qwen3 import Qwen3ForCausalLM

_EXPERT_TENSOR = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj", "dense")  # `dense`: LLaDA2's attention output projection
_VOCAB = ("embed_tokens.weight", "word_embeddings.weight", "lm_head.weight")
_FUSED_QKV = "query_key_value"  # LLaDA2: the query heads, then the key heads, then the value heads


@dataclass
class Shard:
    """One checkpoint tensor read for this rank: `data` is the rank's slice, `dest` the (view of the)
    parameter it belongs in, of the same shape."""

    name: str
    dest: torch.Tensor
    data: torch.Tensor


def checkpoint_names(model: Qwen3ForCausalLM) -> list[str]:
    """Every tensor name a checkpoint must hold for `model` (per-expert names for routed layers)."""
    names = []
    for name, param in model.named_parameters(remove_duplicate=False):
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("w13", "w2"):
            projs = ("gate_proj", "up_proj") if leaf == "w13" else ("down_proj",)
            names += [f"{prefix}.experts.{e}.{p}.weight" for e in range(param.shape[0]) for p in projs]
        elif not (name == "lm_head.weight" and model.spec.tie_word_embeddings):
            names.append(name)
    return names


def _split_kind(name: str) -> str:
    parts = name.split(".")
    if name.endswith(_VOCAB):
        return "vocab"
    if len(parts) >= 2 and parts[-2] == _FUSED_QKV:
        return "qkv"
    if len(parts) >= 2 and parts[-2] in _COLUMN:
        return "column"
    if len(parts) >= 2 and parts[-2] in _ROW and parts[-1] == "weight":
        return "row"
    return "replicated"


def _full_shape(model: Qwen3ForCausalLM, kind: str, local: tuple[int, ...]) -> tuple[int, ...]:
    n = model.tp.size
    if kind == "vocab":
        return (model.spec.vocab_size, *local[1:])
    if kind in ("column", "qkv"):
        return (local[0] * n, *local[1:])
    if kind == "row":
        return (local[0], local[1] * n)
    return local


def _read_shard(model: Qwen3ForCausalLM, kind: str, weight: WeightSlice, local: tuple[int, ...]) -> torch.Tensor:
    """Read only this rank's part of a full checkpoint tensor (`weight` may be a lazy slice)."""
    r, vocab = model.tp.rank, model.spec.vocab_size
    if model.tp.size == 1 or kind == "replicated":
        return weight[...]
    if kind == "vocab":  # the last rank's rows past the vocabulary are zero padding
        lo = min(r * local[0], vocab)
        rows = weight[lo : min(lo + local[0], vocab)]
        return torch.cat([rows, rows.new_zeros(local[0] - rows.shape[0], *local[1:])])
    if kind == "column":
        return weight[r * local[0] : (r + 1) * local[0]]
    if kind == "qkv":  # this rank's query heads, then its key heads, then its value heads
        spec, n = model.spec, model.tp.size
        q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
        parts = [(0, q // n), (q, kv // n), (q + kv, kv // n)]
        return torch.cat([weight[start + r * size : start + (r + 1) * size] for start, size in parts])
    return weight[:, r * local[1] : (r + 1) * local[1]]


def destination(model: Qwen3ForCausalLM, name: str, params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, str] | None:
    """(the tensor of `params` this checkpoint tensor fills, how it is split), or None if it is no part
    of the model. `params` is `named_parameters` or a `state_dict` of `model`."""
    expert = _EXPERT_TENSOR.match(name)
    if expert is None:
        return (params[name], _split_kind(name)) if name in params else None
    prefix, e, proj = expert.group(1), int(expert.group(2)), expert.group(3)
    stacked = params.get(f"{prefix}.{'w2' if proj == 'down_proj' else 'w13'}")
    if stacked is None or e >= stacked.shape[0]:
        return None
    if proj == "down_proj":
        return stacked[e], "row"
    inter = stacked.shape[1] // 2
    return (stacked[e, :inter] if proj == "gate_proj" else stacked[e, inter:]), "column"


def is_skipped(model: Qwen3ForCausalLM, name: str) -> bool:
    """Tensors a checkpoint may hold that are never read: a tied LM head (the embedding is the LM
    head) and rotary tables (computed)."""
    return (name.startswith("lm_head") and model.spec.tie_word_embeddings) or "rotary_emb" in name


def checked_shards(model: Qwen3ForCausalLM, weights: Iterable[tuple[str, WeightSlice]],
                   complete: bool) -> Iterator[Shard]:
    """This rank's slice of every tensor of `weights`, checked against `model` (which may live on the
    meta device). Raises CheckpointError for a tensor the model does not have, a shape that differs
    from the model's, or, when `complete`, a tensor the model needs that never came."""
    params = dict(model.named_parameters(remove_duplicate=False))
    seen: set[str] = set()
    for name, weight in weights:
        if is_skipped(model, name):
            continue
        target = destination(model, name, params)
        if target is None:
            raise CheckpointError(f"tensor {name!r} is not part of a {model.spec.model_type} model")
        dest, kind = target
        want, shape = _full_shape(model, kind, tuple(dest.shape)), weight_shape(weight)
        if shape != want:
            raise CheckpointError(f"tensor {name!r} has shape {list(shape)}, the serving model's is {list(want)} "
                                  "(from its config.json)")
        yield Shard(name, dest, _read_shard(model, kind, weight, tuple(dest.shape)))
        seen.add(name)
    if complete:
        missing = [n for n in checkpoint_names(model) if n not in seen]
        if missing:
            raise CheckpointError(f"the checkpoint lacks tensors: {', '.join(missing[:5])}"
                                  + (" ..." if len(missing) > 5 else ""))


def load_weights(model: Qwen3ForCausalLM, weights: Iterable[tuple[str, WeightSlice]]) -> None:
    """Copy a whole checkpoint's (name, tensor or lazy slice) pairs into `model`'s parameters."""
    with torch.no_grad():
        for shard in checked_shards(model, weights, complete=True):
            shard.dest.copy_(shard.data)

