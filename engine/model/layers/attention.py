"""Self-attention with separate q/k/v projections (Qwen2/Qwen3 style), tensor-parallel by head: the
attention sublayer of the shared pre-norm decoder."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.layers.norm import RMSNorm
from engine.model.layers.parallel import TPContext, column_parallel, row_parallel
from engine.model.spec import ModelSpec
from ops.attention import AttentionBackend, AttentionMetadata
from ops.fused import EAGER, Elementwise


class Attention(nn.Module):
    """q/k/v projections column-parallel by head (biased when `spec.attention_bias`), an optional
    per-head RMSNorm of q and k (`spec.qk_norm`: Qwen3 has it, Qwen2 not), the rotary embedding, the
    backend's attention over the paged KV cache, and a row-parallel output projection."""

    ops: Elementwise = EAGER

    def __init__(self, spec: ModelSpec, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.num_heads = spec.num_attention_heads // tp.size
        self.num_kv_heads = spec.num_key_value_heads // tp.size
        self.head_dim = spec.head_dim
        self.scale = spec.head_dim**-0.5
        d, bias = spec.hidden_size, spec.attention_bias
        self.q_proj = column_parallel(nn.Linear(d, self.num_heads * self.head_dim, bias=bias), tp)
        self.k_proj = column_parallel(nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias), tp)
        self.v_proj = column_parallel(nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias), tp)
        self.o_proj = row_parallel(nn.Linear(self.num_heads * self.head_dim, d, bias=False), tp)
        self.qk_norm = spec.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, backend: AttentionBackend
                ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.ops.qk_norm_rope(q, k, cos, sin, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        else:
            q, k = self.ops.qk_rope(q, k, cos, sin)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.tp.all_reduce(self.o_proj(out.reshape(t, -1)))
