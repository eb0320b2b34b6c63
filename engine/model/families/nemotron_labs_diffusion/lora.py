"""The release's draft adapter, `linear_spec_lora/`: a PEFT LoRA on every layer's `o_proj` that the
release runs on LinearSpec's draft passes only -- its verifies, its prefill and every `ar` or
`diffusion` forward use the plain weights.

The adapter is added per row, not merged: one forward may hold a request's draft rows beside other
requests' causal rows, so each `o_proj` output gets `scale * B (A x)` on the rows a [T] 0/1 factor
flags (a product, no data-dependent shapes). Under tensor parallelism `o_proj` is row-parallel (a
rank holds its heads' input columns; the partial sums are all-reduced after it): each rank holds the
same columns of A and all of B, so the ranks' `B (A_r x_r)` add up to `B (A x)` inside that
all-reduce.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from engine.errors import CheckpointError
from engine.model.layers.parallel import TPContext

ADAPTER_DIR = "linear_spec_lora"  # the release's folder, beside config.json
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.o_proj\.lora_([AB])\.weight$")
# adapter_config.json fields that must keep PEFT's plain-LoRA value: (field, accepted values)
_ONLY = (("peft_type", (None, "LORA")), ("use_dora", (None, False)), ("bias", (None, "none")),
         ("layers_to_transform", (None,)), ("rank_pattern", (None, {})), ("alpha_pattern", (None, {})))


@dataclass(frozen=True)
class DraftLoRA:
    """One rank's share of the adapter: per layer A's columns of this rank [r, in / tp] and B with the
    scale folded in [hidden, r]."""

    a: list[torch.Tensor]
    b: list[torch.Tensor]

    def to(self, device: torch.device, dtype: torch.dtype) -> DraftLoRA:
        return DraftLoRA([t.to(device, dtype) for t in self.a], [t.to(device, dtype) for t in self.b])


def lora_scale(config: dict) -> float:
    """PEFT's scale: lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`."""
    r, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _check_config(config: dict, where: Path) -> None:
    targets = config.get("target_modules")
    if targets not in (["o_proj"], "o_proj"):
        raise CheckpointError(f"{where}: target_modules={targets!r} is not supported for the draft adapter "
                              "(supported: ['o_proj'], the release's)")
    for name, accepted in _ONLY:
        if config.get(name) not in accepted:
            raise CheckpointError(f"{where}: {name}={config[name]!r} is not supported for the draft adapter "
                                  f"(supported: {accepted[-1]!r})")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise CheckpointError(f"{where}: r={config.get('r')!r} must be a positive integer")


def read_draft_lora(path: str | Path, num_layers: int, in_features: int, hidden_size: int,
                    tp: TPContext | None = None) -> DraftLoRA:
    """The adapter in folder `path` (adapter_config.json, adapter_model.safetensors) for a decoder of
    `num_layers` whose o_proj maps `in_features` (all heads) to `hidden_size`, cut for `tp`'s rank, or
    a CheckpointError naming what does not fit."""
    path, tp = Path(path), tp or TPContext()
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise CheckpointError(f"{path}: the draft adapter needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    config = json.loads((path / CONFIG_FILE).read_text())
    _check_config(config, path / CONFIG_FILE)
    r, scale = config["r"], lora_scale(config)
    found: dict[tuple[int, str], torch.Tensor] = {}
    for name, tensor in load_file(str(path / WEIGHTS_FILE)).items():
        match = _TENSOR.search(name)
        if match is None or int(match.group(1)) >= num_layers:
            raise CheckpointError(f"{path / WEIGHTS_FILE}: tensor {name!r} is no LoRA of a layer's o_proj "
                                  f"(the model has {num_layers} layers)")
        found[int(match.group(1)), match.group(2)] = tensor.float()
    shard = in_features // tp.size
    a, b = [], []
    for layer in range(num_layers):
        for part, shape in (("A", (r, in_features)), ("B", (hidden_size, r))):
            tensor = found.get((layer, part))
            if tensor is None or tuple(tensor.shape) != shape:
                got = "missing" if tensor is None else f"shape {list(tensor.shape)}"
                raise CheckpointError(f"{path / WEIGHTS_FILE}: layer {layer}'s o_proj lora_{part} is {got}, "
                                      f"the model needs {list(shape)} (r={r})")
        a.append(found[layer, "A"][:, tp.rank * shard:(tp.rank + 1) * shard].contiguous())
        b.append(found[layer, "B"] * scale)
    return DraftLoRA(a, b)


class DraftAdapter:
    """The adapter hooked onto a decoder's `o_proj` modules. Its delta is added only inside `rows(...)`,
    on the rows that factor flags; elsewhere the modules compute the plain weights."""

    def __init__(self, lora: DraftLoRA, o_projs: list[nn.Module]):
        self.lora = lora
        self._rows: torch.Tensor | None = None
        self.handles = [o_proj.register_forward_hook(self._hook(i)) for i, o_proj in enumerate(o_projs)]

    def _hook(self, layer: int) -> Callable:
        a, b = self.lora.a[layer], self.lora.b[layer]

        def add_delta(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor):
            if self._rows is None:
                return None
            return output + (inputs[0] @ a.T) @ b.T * self._rows

        return add_delta

    @contextmanager
    def rows(self, flags: torch.Tensor | None) -> Iterator[None]:
        """Within: the adapter runs on the rows where `flags` [T] is true (nowhere when None). The flags
        are a factor, never read on the host: a forward with no draft row passes None."""
        self._rows = None if flags is None else flags.to(self.lora.b[0].dtype)[:, None]
        try:
            yield
        finally:
            self._rows = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
