"""Weight updates as a two-phase commit over the tensor-parallel ranks.

A trainer pushes new weights between rollouts in one of three ways: a checkpoint directory
(`DiskWeights`), full tensors by Hugging Face name (`TensorWeights`, also decoded from SGLang's
`flattened_bucket` payload) or a torch.distributed broadcast from the trainer, rank 0 of a group
every engine rank joined (`BroadcastWeights`). Each rank reads only its own slice of every tensor,
with the model's own loading code (`_destination` / `_full_shape` / `_read_shard` of
`Qwen3ForCausalLM`), so a slice is exactly what a fresh load from the same tensors would hold.

`update_weights` runs the phases on every rank through the executor (`stage_update`, then
`commit_update` or `discard_update`; a caller updating several engines at once -- the data-parallel
replicas of a deployment -- runs phase one everywhere before phase two anywhere):

1. *stage*: each rank checks every tensor (a name of this model, the full shape the model's config
   implies, a floating dtype, finite values in its own slice) and copies its slice, in the serving
   dtype on the serving device, into a staging area. A checkpoint must also hold every tensor.
2. if any rank refused, every rank *discards* its staging area and the refusal (naming the tensor
   and the rank) goes to the caller: the old weights keep serving, untouched.
3. otherwise every rank *commits*: the staged slices replace the live ones (on CPU the oneDNN
   packed copies are rebuilt), the prefix cache is flushed and `weight_version` moves on.

A broadcast source receives every tensor even after a refusal (the trainer's collective must
complete); a staging area costs the updated tensors' slices once more until the commit.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

from engine.checkpoint import ModelSpec, WeightSlice, iter_weights, load_model_spec, weight_shape
from engine.model import Qwen3ForCausalLM, TPContext
from ops.cpu_linear import PackedLinear

if TYPE_CHECKING:
    from engine.engine import LLMEngine

WEIGHT_OP_TIMEOUT_S = 1800.0  # staging by broadcast waits for the trainer: far longer than a forward
_SPEC_FIELDS_FREE_TO_DIFFER = ("path", "torch_dtype", "eos_token_ids")


class WeightUpdateError(ValueError):
    """An update was refused; no rank changed its weights."""


# ---- sources ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DiskWeights:
    """Every tensor of a checkpoint directory of the serving architecture."""

    path: str
    complete = True  # a checkpoint must hold every tensor of the model

    def named_weights(self, groups: dict[str, Any], device: torch.device) -> Iterator[tuple[str, WeightSlice]]:
        return iter_weights(self.path)


@dataclass(frozen=True)
class TensorWeights:
    """Full (unsharded) tensors by checkpoint name; any subset of the model's tensors."""

    named_tensors: list[tuple[str, torch.Tensor]]
    complete = False

    def named_weights(self, groups: dict[str, Any], device: torch.device) -> Iterator[tuple[str, WeightSlice]]:
        return iter(self.named_tensors)


@dataclass(frozen=True)
class BroadcastWeights:
    """Full tensors broadcast by rank 0 of the update group `group_name`, one per name, in order."""

    group_name: str
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    complete = False

    def named_weights(self, groups: dict[str, Any], device: torch.device) -> Iterator[tuple[str, WeightSlice]]:
        group = groups.get(self.group_name)
        if group is None:
            raise WeightUpdateError(f"no weight update group {self.group_name!r}: call init_weights_update_group "
                                    f"first (groups: {sorted(groups) or 'none'})")
        where = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        for name, dtype, shape in zip(self.names, self.dtypes, self.shapes):
            buffer = torch.empty(shape, dtype=dtype, device=where)
            dist.broadcast(buffer, src=0, group=group)
            yield name, buffer


WeightSource = DiskWeights | TensorWeights | BroadcastWeights


def parse_dtype(value: str | torch.dtype, name: str) -> torch.dtype:
    """A torch dtype from `torch.bfloat16` or its name (`"bfloat16"`, `"torch.bfloat16"`)."""
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"tensor {name!r}: dtype {value!r} is not a torch dtype")
    return dtype


def broadcast_source(names: list[str], dtypes: list, shapes: list, group_name: str) -> BroadcastWeights:
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightUpdateError(f"names, dtypes and shapes must have one entry per tensor: got {len(names)}, "
                                f"{len(dtypes)} and {len(shapes)}")
    return BroadcastWeights(group_name, list(names), [parse_dtype(d, n) for d, n in zip(dtypes, names)],
                            [tuple(int(x) for x in s) for s in shapes])


def decode_flattened_bucket(payload: dict | list[dict]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from SGLang's `flattened_bucket` load format: one bucket or a list of them,
    each `{"flattened_tensor": 1-D tensor, "metadata": [...]}` whose entries (FlattenedTensorMetadata
    objects or dicts) carry name, shape, dtype, start_idx and end_idx. Current SGLang flattens every
    tensor to bytes (a uint8 buffer, offsets in bytes, several dtypes per bucket); older versions
    concatenate one dtype's elements (offsets in elements). Both decode here."""
    out: list[tuple[str, torch.Tensor]] = []
    for bucket in payload if isinstance(payload, list) else [payload]:
        try:
            flat, metadata = bucket["flattened_tensor"], bucket["metadata"]
        except (KeyError, TypeError) as e:
            raise WeightUpdateError("a flattened_bucket payload is {'flattened_tensor': tensor, 'metadata': "
                                    f"[...]}}; got {type(bucket).__name__} without {e}") from e
        for meta in metadata:
            field = meta.get if isinstance(meta, dict) else lambda key, m=meta: getattr(m, key)
            name = field("name")
            dtype, shape = parse_dtype(field("dtype"), name), tuple(int(x) for x in field("shape"))
            start, end = int(field("start_idx")), int(field("end_idx"))
            if not 0 <= start <= end <= flat.numel():
                raise WeightUpdateError(f"tensor {name!r}: bucket range [{start}, {end}) is outside the "
                                        f"flattened tensor of {flat.numel()} elements")
            part = flat[start:end]
            try:
                if flat.dtype == torch.uint8 and dtype != torch.uint8:
                    part = part.view(dtype)
                out.append((name, part.to(dtype).reshape(shape)))
            except RuntimeError as e:
                raise WeightUpdateError(f"tensor {name!r}: bucket range [{start}, {end}) of a {flat.dtype} "
                                        f"buffer does not hold a {dtype} tensor of shape {list(shape)} ({e})") from e
    return out


def check_same_architecture(serving: ModelSpec, new: ModelSpec) -> None:
    """Refuse a checkpoint whose config differs from the serving one in anything but its path, dtype
    and eos ids (the model is updated in place, never rebuilt)."""
    for f in fields(ModelSpec):
        if f.name in _SPEC_FIELDS_FREE_TO_DIFFER:
            continue
        old, got = getattr(serving, f.name), getattr(new, f.name)
        if old != got:
            raise WeightUpdateError(f"{new.path}: config.json {f.name}={got!r} differs from the serving model's "
                                    f"{old!r}; a weight update keeps the architecture (start a new engine)")


# ---- one rank: stage, install ---------------------------------------------------------------------
def shape_template(spec: ModelSpec, tp: TPContext) -> Qwen3ForCausalLM:
    """The model on the meta device: its loading code and parameter shapes, no memory."""
    with torch.device("meta"):
        return Qwen3ForCausalLM(spec, tp)


def stage_weights(template: Qwen3ForCausalLM, weights: Iterable[tuple[str, WeightSlice]], complete: bool,
                  device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """This rank's slice of every tensor, checked, in `dtype` on `device`, by checkpoint name.

    Every (name, weight) pair is consumed even after a refusal (a broadcast must run to its end);
    the first refusal is raised once they all came."""
    slots = dict(template.named_parameters(remove_duplicate=False))
    staged: dict[str, torch.Tensor] = {}
    error: WeightUpdateError | None = None
    for name, weight in weights:
        if error is not None:
            continue
        if (name.startswith("lm_head") and template.spec.tie_word_embeddings) or "rotary_emb" in name:
            continue  # the loader's rule: tied LM head = embedding; rotary tables are computed
        try:
            staged[name] = _stage_one(template, slots, name, weight, device, dtype)
        except WeightUpdateError as e:
            error = e
    if error is None and complete:
        missing = [n for n in template.checkpoint_names() if n not in staged]
        if missing:
            error = WeightUpdateError(f"the checkpoint lacks tensors: {', '.join(missing[:5])}"
                                      + (" ..." if len(missing) > 5 else ""))
    if error is not None:
        raise error
    return staged


def _stage_one(template: Qwen3ForCausalLM, slots: dict, name: str, weight: WeightSlice,
               device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    target = template._destination(name, slots)
    if target is None:
        raise WeightUpdateError(f"tensor {name!r} is not part of a {template.spec.model_type} model")
    local, kind = target
    want, shape = template._full_shape(kind, tuple(local.shape)), weight_shape(weight)
    if shape != want:
        raise WeightUpdateError(f"tensor {name!r} has shape {list(shape)}, the serving model's is {list(want)}")
    part = template._read_shard(kind, weight, tuple(local.shape))
    if not part.is_floating_point():
        raise WeightUpdateError(f"tensor {name!r} has dtype {part.dtype}; weights are floating point")
    with torch.no_grad():
        staged = part.to(device=device, dtype=dtype, copy=True).contiguous()
    if not bool(torch.isfinite(staged).all()):
        raise WeightUpdateError(f"tensor {name!r} holds non-finite values")
    return staged


def install_weights(model: Qwen3ForCausalLM, weights: dict[str, torch.Tensor]) -> None:
    """Write staged slices (by checkpoint name) into the model. A CPU linear whose dense weight was
    dropped for its oneDNN packed copy takes the staged tensor as its weight and is packed again, as
    is a tied LM head whose embedding changed."""
    params = dict(model.named_parameters(remove_duplicate=False))
    embedding = model.model.embed_tokens.weight
    repack: list[PackedLinear] = []
    with torch.no_grad():
        for name, local in weights.items():
            target = model._destination(name, params)
            if target is not None:
                target[0].copy_(local)
                continue
            linear = model.get_submodule(name.rpartition(".")[0])
            linear.weight = nn.Parameter(local, requires_grad=False)
            repack.append(linear)
    if "model.embed_tokens.weight" in weights and isinstance(model.lm_head, PackedLinear) \
            and model.lm_head.weight is embedding:
        repack.append(model.lm_head)
    for linear in repack:
        PackedLinear.convert(linear, keep_dense=linear.weight is embedding)


def local_weights(model: Qwen3ForCausalLM, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """This rank's slices of the live weights by checkpoint name (packed CPU weights unpacked), copied
    to `device`: what `install_weights` takes back."""
    state = model.state_dict()
    out = {}
    for name in shape_template(model.spec, model.tp).checkpoint_names():
        local, _ = model._destination(name, state)
        out[name] = local.detach().to(device, copy=True).contiguous()
    return out


# ---- the update group ------------------------------------------------------------------------------
def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout_s: float = WEIGHT_OP_TIMEOUT_S):
    """A process group of its own (its own TCP store, keys under `group_name`), beside any default
    group the process already has: the trainer (rank 0, hosting the store) and the engine ranks of
    other worlds meet here. Trainers create theirs the same way (SGLang's and verl's
    `init_custom_process_group`), so the store keys agree."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


# ---- the whole engine ------------------------------------------------------------------------------
def stage_update(engine: LLMEngine, source: WeightSource) -> None:
    """Phase one: every rank stages its slices of `source`. Raises WeightUpdateError when any rank
    refuses; every rank has then discarded what it staged (nothing changed)."""
    if isinstance(source, DiskWeights):
        check_same_architecture(engine.spec, load_model_spec(source.path))
    executor = engine.executor
    try:
        executor.run_on_ranks("stage_weights", source, timeout_s=WEIGHT_OP_TIMEOUT_S)
    except Exception as e:
        if getattr(e, "fatal", False):
            raise
        discard_update(engine)
        if isinstance(e, WeightUpdateError):
            raise
        raise WeightUpdateError(f"weight update failed while staging ({type(e).__name__}: {e})") from e


def commit_update(engine: LLMEngine, weight_version: str | None = None) -> str:
    """Phase two: every rank swaps its staged slices in; the prefix cache is flushed and the new
    weights named. Returns the new `weight_version`: the given one, else the number of updates
    applied so far ("1", "2", ...)."""
    engine.executor.run_on_ranks("commit_weights")
    engine.flush_cache()
    engine.stats.weight_updates += 1
    engine.weight_version = str(engine.stats.weight_updates) if weight_version is None else str(weight_version)
    return engine.weight_version


def discard_update(engine: LLMEngine) -> None:
    """Phase two of a refused update: every rank drops what it staged."""
    engine.executor.run_on_ranks("discard_weights")


def update_weights(engine: LLMEngine, source: WeightSource, weight_version: str | None = None) -> str:
    """Stage on every rank, then commit on every rank (or, refused, discard on every rank and raise
    WeightUpdateError: nothing changed). Returns the new `weight_version`."""
    stage_update(engine, source)
    return commit_update(engine, weight_version)


def tensor_source(named_tensors: Any, load_format: str | None) -> TensorWeights:
    """The source for `update_weights_from_tensor`'s payload: (name, tensor) pairs (a list or a dict),
    or SGLang's `flattened_bucket` payload."""
    if load_format == "flattened_bucket":
        return TensorWeights(decode_flattened_bucket(named_tensors))
    if load_format is not None:
        raise WeightUpdateError(f"load_format={load_format!r} is not supported (None or 'flattened_bucket')")
    pairs = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
    for pair in pairs:
        if not (isinstance(pair, tuple | list) and len(pair) == 2 and isinstance(pair[1], torch.Tensor)):
            raise WeightUpdateError(f"named_tensors: expected (name, tensor) pairs, got {type(pair).__name__}")
    return TensorWeights([(str(n), t) for n, t in pairs])
