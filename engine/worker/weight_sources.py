"""Where new weights come from: the three ways a trainer pushes them between rollouts.

A checkpoint directory (`DiskWeights`), full tensors by Hugging Face name (`TensorWeights`, also
decoded from SGLang's `flattened_bucket` payload) or a torch.distributed broadcast from the trainer,
rank 0 of a group every engine rank joined (`BroadcastWeights`). Each yields (name, full tensor or
lazy slice) pairs; every rank reads its own slice of each (engine.worker.weight_staging). An
unknown `load_format` is refused, never ignored.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from engine.errors import WeightUpdateError
from engine.model.checkpoint import ModelSpec, WeightSlice, iter_weights

_SPEC_FIELDS_FREE_TO_DIFFER = ("path", "torch_dtype", "eos_token_ids")


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
    """Full tensors broadcast by rank 0 of the update group `group_name`: one broadcast per name, in
    order, or with `flattened` one broadcast of SGLang's FlattenedTensorBucket layout (every tensor's
    bytes concatenated in `names` order, one uint8 buffer; a bucket of a single dtype sent as that
    dtype has the same bytes)."""

    group_name: str
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    flattened: bool = False
    complete = False

    def bucket_bytes(self) -> list[int]:
        """The byte size of each tensor of a flattened bucket, in order."""
        return [math.prod(shape) * dtype.itemsize for dtype, shape in zip(self.dtypes, self.shapes)]

    def named_weights(self, groups: dict[str, Any], device: torch.device) -> Iterator[tuple[str, WeightSlice]]:
        group = groups.get(self.group_name)
        if group is None:
            raise WeightUpdateError(f"no weight update group {self.group_name!r}: call init_weights_update_group "
                                    f"first (groups: {sorted(groups) or 'none'})")
        # Buffers start as all-ones bytes (NaN in every float dtype): a trainer sending fewer bytes
        # than announced (gloo fills what arrives and says nothing) leaves NaNs that staging refuses.
        where = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        if not self.flattened:
            for name, dtype, shape in zip(self.names, self.dtypes, self.shapes):
                buffer = torch.full((math.prod(shape) * dtype.itemsize,), 255, dtype=torch.uint8, device=where)
                buffer = buffer.view(dtype).reshape(shape)
                dist.broadcast(buffer, src=0, group=group)
                yield name, buffer
            return
        sizes = self.bucket_bytes()
        bucket = torch.full((sum(sizes),), 255, dtype=torch.uint8, device=where)
        dist.broadcast(bucket, src=0, group=group)
        start = 0
        for name, dtype, shape, size in zip(self.names, self.dtypes, self.shapes, sizes):
            part = bucket[start : start + size]
            if start % dtype.itemsize:  # a view must start on a multiple of its element size
                part = part.clone()
            yield name, part.view(dtype).reshape(shape)
            start += size


WeightSource = DiskWeights | TensorWeights | BroadcastWeights


def parse_dtype(value: str | torch.dtype, name: str) -> torch.dtype:
    """A torch dtype from `torch.bfloat16` or its name (`"bfloat16"`, `"torch.bfloat16"`)."""
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"tensor {name!r}: dtype {value!r} is not a torch dtype")
    return dtype


def broadcast_source(names: list[str], dtypes: list, shapes: list, group_name: str,
                     load_format: str | None = None) -> BroadcastWeights:
    """The source for `update_weights_from_distributed`: one broadcast per name (`load_format` None),
    or one flattened bucket (`"flattened_bucket"`). Everything that can be refused without receiving
    is refused here, before the trainer's broadcast is touched."""
    if load_format not in (None, "flattened_bucket"):
        raise WeightUpdateError(f"load_format={load_format!r} is not supported for broadcasts "
                                "(None: one broadcast per name, or 'flattened_bucket': one broadcast)")
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightUpdateError(f"names, dtypes and shapes must have one entry per tensor: got {len(names)}, "
                                f"{len(dtypes)} and {len(shapes)}")
    if load_format == "flattened_bucket" and not names:
        raise WeightUpdateError("names is empty: a flattened bucket holds at least one tensor")
    parsed = []
    for name, shape in zip(names, shapes):
        try:
            dims = tuple(int(x) for x in shape)
        except (TypeError, ValueError) as e:
            raise WeightUpdateError(f"tensor {name!r}: shape {shape!r} is not a list of integers") from e
        if any(d < 0 for d in dims):
            raise WeightUpdateError(f"tensor {name!r}: shape {list(dims)} has a negative dimension")
        parsed.append(dims)
    return BroadcastWeights(group_name, [str(n) for n in names], [parse_dtype(d, n) for d, n in zip(dtypes, names)],
                            parsed, flattened=load_format == "flattened_bucket")


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


def disk_source(model_path: str, load_format: str | None = None) -> DiskWeights:
    """The source for `update_weights_from_disk`: a checkpoint of safetensors files (SGLang's
    `load_format` None, "auto" or "safetensors"; other formats are refused)."""
    if load_format not in (None, "auto", "safetensors"):
        raise WeightUpdateError(f"load_format={load_format!r} is not supported for checkpoints "
                                "(None, 'auto' or 'safetensors': the weights are *.safetensors files)")
    return DiskWeights(str(model_path))


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
