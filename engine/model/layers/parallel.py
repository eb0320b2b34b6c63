"""Tensor parallelism: this rank's place in the group, and how each parameter is split across it.

A module declares, next to the parameters it creates, how each one is cut from a full checkpoint
tensor: `weight_loaders` maps a parameter's leaf name to a `Split` (the default is `REPLICATED`).
A module whose parameters stack several checkpoint tensors (routed experts) also declares a
`packed_modules_mapping`: checkpoint name patterns (relative to the module) to (its parameter, shard
id), and the parameter's loader places that shard (`Split.place`). The generic loader
(engine.model.loading) only walks these declarations.

The loaders are kept on the module, not on the parameter: building on the meta device and
materialising (`to_empty`) makes new parameter objects, which would drop attributes set on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from engine.model.spec import WeightSlice


@dataclass(frozen=True)
class TPContext:
    """This process's place in the tensor-parallel group (rank 0 of 1 when not sharded)."""

    rank: int = 0
    size: int = 1
    group: object | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class Split:
    """How a full checkpoint tensor maps onto this rank's parameter: replicated (this base class),
    or cut by one of the subclasses. Each rank reads only its own part (`weight` may be a lazy
    safetensors slice)."""

    def __init__(self, tp: TPContext | None = None):
        self.tp = tp or TPContext()

    def place(self, param: torch.Tensor, shard_id: object = None) -> tuple[torch.Tensor, Split] | None:
        """(the view of `param` a checkpoint tensor fills, how it is split), or None when the shard
        is no part of the parameter. Only stacked parameters take a `shard_id`."""
        return param, self

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint tensor's shape for a rank-local part of shape `local`."""
        return local

    def read(self, weight: WeightSlice, local: tuple[int, ...]) -> torch.Tensor:
        """This rank's part of the full checkpoint tensor `weight`."""
        return weight[...]

    def checkpoint_names(self, name: str, param: torch.Tensor) -> list[str]:
        """The checkpoint tensors that fill the parameter `name`."""
        return [name]


REPLICATED = Split()


class ColumnSplit(Split):
    """Output rows split: rank r holds rows [r*n, (r+1)*n) (a column-parallel projection, its bias)."""

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        return (local[0] * self.tp.size, *local[1:])

    def read(self, weight: WeightSlice, local: tuple[int, ...]) -> torch.Tensor:
        if self.tp.size == 1:
            return weight[...]
        r = self.tp.rank
        return weight[r * local[0] : (r + 1) * local[0]]


class RowSplit(Split):
    """Input columns split (a row-parallel projection's weight; the caller all-reduces its output)."""

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        return (local[0], local[1] * self.tp.size)

    def read(self, weight: WeightSlice, local: tuple[int, ...]) -> torch.Tensor:
        if self.tp.size == 1:
            return weight[...]
        r = self.tp.rank
        return weight[:, r * local[1] : (r + 1) * local[1]]


class VocabSplit(Split):
    """Vocabulary rows split in shards of ceil(vocab / tp); the last rank's rows past the vocabulary
    are zero padding."""

    def __init__(self, tp: TPContext, vocab_size: int):
        super().__init__(tp)
        self.vocab_size = vocab_size

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        return (self.vocab_size, *local[1:])

    def read(self, weight: WeightSlice, local: tuple[int, ...]) -> torch.Tensor:
        if self.tp.size == 1:
            return weight[...]
        lo = min(self.tp.rank * local[0], self.vocab_size)
        rows = weight[lo : min(lo + local[0], self.vocab_size)]
        return torch.cat([rows, rows.new_zeros(local[0] - rows.shape[0], *local[1:])])


class FusedHeadSplit(Split):
    """A fused projection of consecutive parts (e.g. query, key and value heads) whose rows each
    split like a column-parallel projection's: rank r holds its rows of every part, part after part."""

    def __init__(self, tp: TPContext, part_rows: tuple[int, ...]):
        super().__init__(tp)
        self.part_rows = part_rows

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        return (local[0] * self.tp.size, *local[1:])

    def read(self, weight: WeightSlice, local: tuple[int, ...]) -> torch.Tensor:
        if self.tp.size == 1:
            return weight[...]
        r, n, start, parts = self.tp.rank, self.tp.size, 0, []
        for rows in self.part_rows:
            size = rows // n
            parts.append(weight[start + r * size : start + (r + 1) * size])
            start += rows
        return torch.cat(parts)


def column_parallel(linear: nn.Linear, tp: TPContext) -> nn.Linear:
    """`linear` (built with this rank's output rows), declared column-parallel: weight and bias rows split."""
    linear.weight_loaders = {"weight": ColumnSplit(tp), "bias": ColumnSplit(tp)}
    return linear


def row_parallel(linear: nn.Linear, tp: TPContext) -> nn.Linear:
    """`linear` (built with this rank's input columns), declared row-parallel: weight columns split, a
    bias replicated (added once, after the all-reduce)."""
    linear.weight_loaders = {"weight": RowSplit(tp)}
    return linear


def fused_heads(linear: nn.Linear, tp: TPContext, part_rows: tuple[int, ...]) -> nn.Linear:
    """`linear` declared a fused projection of parts with `part_rows` full rows each (see FusedHeadSplit)."""
    linear.weight_loaders = {"weight": FusedHeadSplit(tp, part_rows), "bias": FusedHeadSplit(tp, part_rows)}
    return linear


def vocab_shard(vocab_size: int, tp: TPContext) -> int:
    """Rows of the vocabulary one rank holds."""
    return -(-vocab_size // tp.size)


def lm_head(hidden_size: int, vocab_size: int, tp: TPContext) -> nn.Linear:
    """The LM head: this rank's vocabulary rows (a plain `nn.Linear`, so the CPU path packs it)."""
    head = nn.Linear(hidden_size, vocab_shard(vocab_size, tp), bias=False)
    head.weight_loaders = {"weight": VocabSplit(tp, vocab_size)}
    return head


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.shard = vocab_shard(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.shard, dim))
        self.weight_loaders = {"weight": VocabSplit(tp, vocab_size)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.tp.rank * self.shard
        inside = (local >= 0) & (local < self.shard)
        out = nn.functional.embedding(local.clamp(0, self.shard - 1), self.weight)
        return self.tp.all_reduce(out * inside[:, None].to(out.dtype))
