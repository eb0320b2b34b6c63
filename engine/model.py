"""The Qwen3 layer stack shared by `qwen3` (causal) and `sdar` (block-causal), tensor-parallel ready.

Parameter names equal the checkpoint's tensor names, so loading is a name lookup plus, under
tensor parallelism, a slice: column-parallel projections (q/k/v, gate/up) split their output rows
by head / by channel, row-parallel ones (o, down) split their input columns and all-reduce, the
embedding and LM head split the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from engine.checkpoint import CheckpointError, ModelSpec
from ops.attention import AttentionBackend, AttentionMetadata
from ops.layers import apply_rope, rms_norm, rope_cos_sin, silu_and_mul


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
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
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
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta, backend) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.tp.all_reduce(self.o_proj(out.reshape(t, -1)))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPContext):
        super().__init__()
        self.tp = tp
        inter = spec.intermediate_size // tp.size
        self.gate_proj = nn.Linear(spec.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPContext):
        super().__init__()
        self.self_attn = Attention(spec, tp)
        self.mlp = MLP(spec, tp)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta, backend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


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
    def __init__(self, spec: ModelSpec, tp: TPContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(spec, tp) for _ in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """`forward` returns final hidden states; `logits` projects only the rows asked for."""

    def __init__(self, spec: ModelSpec, tp: TPContext | None = None):
        super().__init__()
        tp = tp or TPContext()
        for name, n in (("num_attention_heads", spec.num_attention_heads),
                        ("num_key_value_heads", spec.num_key_value_heads),
                        ("intermediate_size", spec.intermediate_size)):
            if n % tp.size:
                raise ValueError(f"tp={tp.size} must divide the model's {name} ({n})")
        self.spec, self.tp = spec, tp
        self.model = Qwen3Backbone(spec, tp)
        self.lm_head = nn.Linear(spec.hidden_size, self.model.embed_tokens.shard, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.spec.head_dim, self.spec.rope_theta, x.dtype)
        backend.prepare(meta)
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, kv, meta, backend)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary float32 logits for the given hidden rows [R, hidden] -> [R, vocab]."""
        local = self.lm_head(hidden)
        return self.tp.all_gather_last_dim(local)[:, : self.spec.vocab_size].float()

    # ---- loading -------------------------------------------------------------------------
    _COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    _ROW = ("o_proj", "down_proj")

    def _shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor."""
        tp = self.tp
        if tp.size == 1:
            return tensor
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            shard = self.model.embed_tokens.shard
            padded = torch.zeros(shard * tp.size, *tensor.shape[1:], dtype=tensor.dtype)
            padded[: tensor.shape[0]] = tensor
            return padded[tp.rank * shard : (tp.rank + 1) * shard]
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in self._COLUMN:
            return tensor.chunk(tp.size, dim=0)[tp.rank]
        if len(parts) >= 2 and parts[-2] in self._ROW and parts[-1] == "weight":
            return tensor.chunk(tp.size, dim=1)[tp.rank]
        return tensor

    def load_weights(self, weights) -> None:
        """Copy (name, tensor) pairs in; tie the LM head when the checkpoint says so."""
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, tensor in weights:
            if name not in params:
                if name.startswith("lm_head") and self.spec.tie_word_embeddings:
                    continue
                if "rotary_emb" in name:
                    continue
                raise CheckpointError(f"checkpoint tensor {name!r} is not part of a Qwen3 model")
            shard = self._shard(name, tensor)
            param = params[name]
            if shard.shape != param.shape:
                raise CheckpointError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, but config.json implies "
                    f"{tuple(param.shape)} (tp={self.tp.size}); is config.json from this checkpoint?"
                )
            with torch.no_grad():
                param.copy_(shard)
            seen.add(name)
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            seen.add("lm_head.weight")
        missing = sorted(set(params) - seen)
        if missing:
            raise CheckpointError(f"checkpoint lacks tensors: {', '.join(missing[:5])}"
                                  + (" ..." if len(missing) > 5 else ""))
