"""Pointwise and per-row kernels of the decoder layers: RMSNorm, rotary embedding, SiLU-gated MLP.

`add_rms_norm` and `qk_norm_rope` are the groups of these that follow each other in a layer, written
as one function each so that ops.fused can compile every group into one kernel; eagerly they are
exactly the calls they group."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 like the HF reference, cast back."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of x + residual, x + residual): a sublayer's residual add and the norm that reads its
    result, returned together as vLLM's fused_add_rms_norm does, so the sum is read once."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of the queries and keys [T, heads, head_dim], then the rotary embedding."""
    return apply_rope(rms_norm(q, q_weight, eps), cos, sin), apply_rope(rms_norm(k, k_weight, eps), cos, sin)


def qk_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding of the queries and keys [T, heads, head_dim] (Qwen2: no per-head norm)."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


#: below this many elements the chunked search's few extra ops cost more than `max` saves
_ROW_MAX_CHUNKED_FROM = 65_536


def row_max(x: torch.Tensor, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of each row's maximum of a 2-D tensor, exactly as `x.max(-1)` (the first index
    on ties). On CPU `max(dim)` / `argmax` track indices element by element (~1 ns an element on one
    core, 4.2 ms for 32 x 151,936) while `amax` is vectorised, so: the maximum of every `chunk`
    columns, the first chunk that holds the row's maximum, and an index search inside that chunk only
    (0.64 ms there). `chunk` (None: by the row length, measured on one core: 32 columns up to 1,024,
    64 up to 16,384, 256 beyond) balances the chunk maxima against the search inside one chunk."""
    rows, n = x.shape
    if chunk is None:
        chunk = 32 if n <= 1024 else 64 if n <= 16_384 else 256
    if x.device.type != "cpu" or n < 4 * chunk or rows * n < _ROW_MAX_CHUNKED_FROM:
        return x.max(-1)
    full = n // chunk * chunk
    chunk_max = x[:, :full].view(rows, full // chunk, chunk).amax(-1)
    if full < n:
        chunk_max = torch.cat([chunk_max, x[:, full:].amax(-1, keepdim=True)], 1)
    values, best = chunk_max.max(-1)
    starts = best * chunk
    # the last chunk may be short: its clamped indices repeat column n - 1 after the real one
    cols = (starts[:, None] + torch.arange(chunk, device=x.device)).clamp_max(n - 1)
    return values, starts + x.gather(1, cols).argmax(-1)
