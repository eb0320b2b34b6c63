"""How DiffusionGemma's stacked expert tensors split under tensor parallelism: every expert keeps all
its rows of the hidden size and a 1/tp share of its intermediate channels, so each rank runs every
expert on its share and the ranks' float32 partial sums are all-reduced."""

from __future__ import annotations

import torch

from engine.model.layers.parallel import Split
from engine.model.spec import WeightSlice


class GateUpSplit(Split):
    """`gate_up_proj` [E, 2I, H] (gate rows first): rank r holds gate rows [r·i, (r+1)·i) and the same
    up rows, i = I / tp, as [E, 2i, H]."""

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        return (local[0], local[1] * self.tp.size, *local[2:])

    def read(self, weight: WeightSlice, local: tuple[int, ...]) -> torch.Tensor:
        if self.tp.size == 1:
            return weight[...]
        i, r, full = local[1] // 2, self.tp.rank, local[1] // 2 * self.tp.size
        return torch.cat([weight[:, r * i: (r + 1) * i], weight[:, full + r * i: full + (r + 1) * i]], dim=1)


class ExpertDownSplit(Split):
    """`down_proj` [E, H, I]: rank r holds intermediate columns [r·i, (r+1)·i)."""

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        return (*local[:2], local[2] * self.tp.size)

    def read(self, weight: WeightSlice, local: tuple[int, ...]) -> torch.Tensor:
        if self.tp.size == 1:
            return weight[...]
        r, i = self.tp.rank, local[2]
        return weight[:, :, r * i: (r + 1) * i]
