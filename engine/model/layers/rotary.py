"""Rotary position embeddings: the default and YaRN frequencies as transformers computes them, the
cos/sin tables for absolute positions, and the partial variant that turns only a head's leading dims."""

from __future__ import annotations

import math

import torch

from engine.model.spec import ModelSpec, RopeScaling
from ops.layers import apply_rope


def rope_inv_freq(spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2], factor applied to cos and sin), as transformers computes
    them for the default rotary embedding and for YaRN."""
    dim, base = spec.head_dim, spec.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    scaling: RopeScaling | None = spec.rope_scaling
    if scaling is None:
        return 1.0 / pos_freqs, 1.0

    def correction_dim(rotations: float) -> float:
        turns = scaling.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (scaling.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, scaling.attention_factor


class RotaryEmbedding:
    """cos/sin tables [T, head_dim] (rotate-half layout) for absolute positions, scaled like HF."""

    def __init__(self, spec: ModelSpec):
        self.inv_freq, self.scaling = rope_inv_freq(spec)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype), sin.to(dtype)


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """The rotary embedding of the first `rotary_dim` dims of each head of x [T, heads, head_dim] (cos
    and sin span only those dims); the other dims pass unchanged."""
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    return apply_rope(x, cos, sin)
