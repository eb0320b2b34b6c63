"""The generic pre-norm decoder LM: embedding, pre-norm attention + MLP layers, final norm, LM head.

Most families run it as it is, configured by their `ModelSpec` (q/k norm, biases, which layers are
routed); a family with other layers subclasses it and replaces `backbone` and `rotary_embedding`. Causal or
block-causal attention is the attention backend's business (the runner's block length), not the
network's.

Built on the `meta` device and materialised once in the serving dtype (`materialize`), so no float32
random init ever runs; loading (engine.model.loading) fills it from the checkpoint through the split
each module declares for its parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.layers.attention import Attention
from engine.model.layers.mlp import MLP
from engine.model.layers.moe import MoEStats, SparseMoeBlock
from engine.model.layers.norm import RMSNorm
from engine.model.layers.parallel import TPContext, VocabParallelEmbedding, lm_head
from engine.model.layers.rotary import RotaryEmbedding
from engine.model.spec import ModelSpec
from ops.attention import AttentionBackend, AttentionMetadata
from ops.fused import EAGER, Elementwise, compiled_elementwise


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP sublayers. A layer hands on its MLP output and the residual stream
    separately; the next layer (or the final norm) adds them together with its first RMSNorm, so
    every residual add is fused with the norm that reads it."""

    ops: Elementwise = EAGER

    def __init__(self, spec: ModelSpec, tp: TPContext, index: int, moe_stats: MoEStats):
        super().__init__()
        self.self_attn = Attention(spec, tp)
        if spec.moe is not None and index in spec.moe.sparse_layers:
            self.mlp = SparseMoeBlock(spec.hidden_size, spec.moe, tp, moe_stats)
        else:
            self.mlp = MLP(spec.hidden_size, spec.intermediate_size, tp)
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


class DecoderBackbone(nn.Module):
    """The embedding, the layers and the final norm (checkpoint prefix `model.`)."""

    def __init__(self, spec: ModelSpec, tp: TPContext, moe_stats: MoEStats):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(spec, tp, i, moe_stats) for i in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class PreNormDecoderLM(nn.Module):
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
        self.lm_head = lm_head(spec.hidden_size, spec.vocab_size, tp)
        self.rotary = self.rotary_embedding(spec)

    @staticmethod
    def backbone(spec: ModelSpec, tp: TPContext, moe_stats: MoEStats) -> nn.Module:
        """The embedding, layers and final norm (a family with other layers overrides this)."""
        return DecoderBackbone(spec, tp, moe_stats)

    @staticmethod
    def rotary_embedding(spec: ModelSpec) -> RotaryEmbedding:
        return RotaryEmbedding(spec)

    @property
    def embed_tokens(self) -> VocabParallelEmbedding:
        """The input embedding (also the LM head's weight when the checkpoint ties them)."""
        return self.model.embed_tokens

    def ignores_tensor(self, name: str) -> bool:
        """Tensors a checkpoint may hold that are never read: a tied LM head (the embedding is the LM
        head) and rotary tables (computed)."""
        return (name.startswith("lm_head") and self.spec.tie_word_embeddings) or "rotary_emb" in name

    def materialize(self, device: torch.device, dtype: torch.dtype) -> PreNormDecoderLM:
        """Allocate every parameter (uninitialised) in `dtype` on `device`; tie the LM head if asked.
        Untouched allocations cost no resident memory until loading writes them."""
        self.to(dtype=dtype).to_empty(device=device)
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        return self

    def use_compiled_elementwise(self) -> PreNormDecoderLM:
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
