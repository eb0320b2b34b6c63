"""The SiLU-gated MLP, tensor-parallel by channel (gate/up column-parallel, down row-parallel)."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.layers.parallel import TPContext, column_parallel, row_parallel
from ops.fused import EAGER, Elementwise


class SwiGLU(nn.Module):
    """A SwiGLU MLP's rank-local part of `intermediate_size` channels, without the all-reduce: a
    caller that adds it to other partial sums (shared experts) reduces once, after the sum."""

    ops: Elementwise = EAGER

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPContext):
        super().__init__()
        inter = intermediate_size // tp.size
        self.gate_proj = column_parallel(nn.Linear(hidden_size, inter, bias=False), tp)
        self.up_proj = column_parallel(nn.Linear(hidden_size, inter, bias=False), tp)
        self.down_proj = row_parallel(nn.Linear(inter, hidden_size, bias=False), tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_proj(x), self.up_proj(x)))


class MLP(SwiGLU):
    """A dense layer's SwiGLU MLP, its output all-reduced over the ranks."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPContext):
        super().__init__(hidden_size, intermediate_size, tp)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))
