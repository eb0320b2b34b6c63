"""RMSNorm parameters (the math is ops.layers', applied through the layers' `Elementwise` functions)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """An RMSNorm's weight and epsilon. The layers apply it through their `Elementwise` functions, each
    norm together with the residual add before it or the rotary embedding after it."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
