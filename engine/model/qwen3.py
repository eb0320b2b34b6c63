"""The Qwen3 layer stack shared by `qwen3` / `qwen3_moe` (causal) and `sdar` / `sdar_moe`
(block-causal), tensor-parallel ready. With `ModelSpec.qk_norm` off and biased q/k/v projections it
is the Qwen2 stack (`Fast_dLLM_Qwen`, block-causal).

Parameter names equal the checkpoint's tensor names except for routed experts (stacked per layer,
see engine/model/moe.py), so loading (engine/model/loading.py) is a name lookup plus, under tensor parallelism, a slice:
column-parallel projections (q/k/v, gate/up) split their output rows by head / by channel,
row-parallel ones (o, down) split their input columns and all-reduce, the embedding and LM head
split the vocabulary, norms and the MoE router are replicated. Each rank reads only its own slice
of each tensor (loading takes lazy safetensors slices), and the model is built on the `meta`
device and materialised once in the serving dtype (`materialize`), so no float32 random init ever runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from engine.model.checkpoint import ModelSpec, RopeScaling
from engine.model.moe import MoEStats, SparseMoeBlock
from ops.attention import AttentionBackend, AttentionMetadata
from ops.fused import EAGER, Elementwise, compiled_elementwise


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


class RMSNorm(nn.Module):
    """An RMSNorm's weight and epsilon. The layers apply it through their `Elementwise` functions, each
    norm together with the residual add before it or the rotary embedding after it."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    ops: Elementwise = EAGER

    def __init__(self, spec: ModelSpec, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.num_heads = spec.num_attention_heads // tp.size
        self.num_kv_heads = spec.num_key_value_heads // tp.size
        self.head_dim = spec.head_dim
        self.scale = spec.head_dim**-0.5
        d, bias = spec.hidden_size, spec.attention_bias
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        self.qk_norm = spec.qk_norm  # Qwen3 normalises each head of q and k; Qwen2 (Fast-dLLM v2) does not
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


class MLP(nn.Module):
    ops: Elementwise = EAGER

    def __init__(self, spec: ModelSpec, tp: TPContext):
        super().__init__()
        self.tp = tp
        inter = spec.intermediate_size // tp.size
        self.gate_proj = nn.Linear(spec.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.ops.silu_and_mul(self.gate_proj(x), self.up_proj(x))))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP sublayers. A layer hands on its MLP output and the residual stream
    separately; the next layer (or the final norm) adds them together with its first RMSNorm, so
    every residual add is fused with the norm that reads it."""

    ops: Elementwise = EAGER

    def __init__(self, spec: ModelSpec, tp: TPContext, index: int, moe_stats: MoEStats):
        super().__init__()
        self.self_attn = Attention(spec, tp)
        if spec.moe is not None and index in spec.moe.sparse_layers:
            self.mlp = SparseMoeBlock(spec.hidden_size, spec.moe, tp.size, tp.all_reduce, moe_stats)
        else:
            self.mlp = MLP(spec, tp)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, backend: AttentionBackend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it) from the previous layer's pair;
        the first layer gets (embeddings, None)."""
        norm = self.input_layernorm
        if residual is None:
            residual, h = x, self.ops.rms_norm(x, norm.weight, norm.eps)
        else:
            h, residual = self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.self_attn(h, cos, sin, kv_cache, meta, backend)
        norm = self.post_attention_layernorm
        h, residual = self.ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(h), residual


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.shard = -(-vocab_size // tp.size)
        self.weight = nn.Parameter(torch.empty(self.shard, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.tp.rank * self.shard
        inside = (local >= 0) & (local < self.shard)
        out = nn.functional.embedding(local.clamp(0, self.shard - 1), self.weight)
        return self.tp.all_reduce(out * inside[:, None].to(out.dtype))


class Qwen3Backbone(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPContext, moe_stats: MoEStats):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(spec, tp, i, moe_stats) for i in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


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


class Qwen3ForCausalLM(nn.Module):
    """`forward` returns final hidden states; `logits` projects only the rows asked for.

    Build it under `torch.device("meta")`, then `materialize(device, dtype)` and `engine.model.loading.load_weights`.
    `use_compiled_elementwise()` switches its elementwise work to fused compiled kernels."""

    ops: Elementwise = EAGER

    def __init__(self, spec: ModelSpec, tp: TPContext | None = None):
        super().__init__()
        tp = tp or TPContext()
        for name, n in (("num_attention_heads", spec.num_attention_heads),
                        ("num_key_value_heads", spec.num_key_value_heads),
                        ("intermediate_size", spec.intermediate_size)):
            if n % tp.size:
                raise ValueError(f"tp={tp.size} must divide the model's {name} ({n})")
        self.spec, self.tp = spec, tp
        self.moe_stats = MoEStats()
        self.model = self.backbone(spec, tp, self.moe_stats)
        self.lm_head = nn.Linear(spec.hidden_size, self.model.embed_tokens.shard, bias=False)
        self.rotary = self.rotary_embedding(spec)

    @staticmethod
    def backbone(spec: ModelSpec, tp: TPContext, moe_stats: MoEStats) -> nn.Module:
        """The embedding, layers and final norm (a family with other layers overrides this)."""
        return Qwen3Backbone(spec, tp, moe_stats)

    @staticmethod
    def rotary_embedding(spec: ModelSpec) -> RotaryEmbedding:
        return RotaryEmbedding(spec)

    def materialize(self, device: torch.device, dtype: torch.dtype) -> Qwen3ForCausalLM:
        """Allocate every parameter (uninitialised) in `dtype` on `device`; tie the LM head if asked.
        Untouched allocations cost no resident memory until loading writes them."""
        self.to(dtype=dtype).to_empty(device=device)
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        return self

    def use_compiled_elementwise(self) -> Qwen3ForCausalLM:
        """Run every layer's norms, rotary embedding, SiLU gate and residual adds through the compiled
        fused functions of ops.fused (eager again, after one warning, where compiling fails); matmuls,
        attention and collectives stay as they are. Parameters and state dict are unchanged."""
        ops = compiled_elementwise()
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        if meta.extra is None:  # the model runner prepares before the forward; other callers may not
            backend.prepare(meta)
        residual = None
        for layer, kv in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv, meta, backend)
        norm = self.model.norm
        return self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary float32 logits for the given hidden rows [R, hidden] -> [R, vocab]."""
        local = self.lm_head(hidden)
        return self.tp.all_gather_last_dim(local)[:, : self.spec.vocab_size].float()
