"""The LLaDA2 network (`llada2_moe`, inclusionAI's `LLaDA2MoeModelLM`), tensor-parallel ready.

Against a Qwen3 layer it differs in: one fused `attention.query_key_value` projection (the query
heads, then the key heads, then the value heads; split per rank by head),
per-head RMSNorm of q and k (`query_layernorm` / `key_layernorm`) before a NeoX rotary embedding on
only the first `rotary_dim` dims of each head, an output projection `attention.dense` that may carry
a bias (added once, after the all-reduce), dense MLPs in the first `first_k_dense_replace` layers and
LLaDA2's routed + shared experts (`LLaDA2MoeBlock`) in the others. Logits at a
position predict the token at that position (no shift); attention is block-causal like SDAR's, which
the attention backend applies from the runner's block length. A block-routed checkpoint (LLaDA2.2,
`expert_capacity`) fixes that block length to its routing block and has every forward checked to
feed whole routing blocks per request (block_routing.py).

Parameter names equal the checkpoint's (the embedding is `model.word_embeddings`; routed experts are
stacked per layer as for Qwen3-MoE). The forward, logits, `materialize` and compiled elementwise
switch are the shared pre-norm decoder's: only the layers (and block routing's checks) differ.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.nn import functional as F

from engine.model.families.llada2_moe.block_routing import check_block_length, check_segments
from engine.model.families.llada2_moe.config import LLaDA2Spec
from engine.model.families.llada2_moe.moe import LLaDA2MoeBlock
from engine.model.layers.decoder import DecoderLayer, PreNormDecoderLM
from engine.model.layers.mlp import MLP
from engine.model.layers.moe import MoEStats
from engine.model.layers.norm import RMSNorm
from engine.model.layers.parallel import TPContext, VocabParallelEmbedding, fused_heads, row_parallel
from engine.model.layers.rotary import RotaryEmbedding, partial_rope
from engine.model.spec import ModelSpec
from ops.attention import AttentionBackend, AttentionMetadata
from ops.fused import EAGER, Elementwise


class _BiasAfterReduce(nn.Linear):
    """A row-parallel projection with a bias: each rank computes its partial product only; the caller
    adds the bias once, after the all-reduce. (Not a plain nn.Linear, so the CPU path leaves it unpacked.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class LLaDA2Attention(nn.Module):
    ops: Elementwise = EAGER

    def __init__(self, spec: ModelSpec, tp: TPContext):
        super().__init__()
        extra: LLaDA2Spec = spec.extra
        self.tp = tp
        self.num_heads = spec.num_attention_heads // tp.size
        self.num_kv_heads = spec.num_key_value_heads // tp.size
        self.head_dim, self.rotary_dim = spec.head_dim, extra.rotary_dim
        self.scale = spec.head_dim**-0.5
        d = spec.hidden_size
        q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
        self.query_key_value = fused_heads(nn.Linear(d, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
                                                     bias=spec.attention_bias), tp, (q, kv, kv))
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:
            self.query_layernorm = RMSNorm(self.head_dim, spec.rms_norm_eps)
            self.key_layernorm = RMSNorm(self.head_dim, spec.rms_norm_eps)
        dense = _BiasAfterReduce if extra.dense_bias else nn.Linear
        self.dense = row_parallel(dense(self.num_heads * self.head_dim, d, bias=extra.dense_bias), tp)

    def _rotate(self, x: torch.Tensor, norm: RMSNorm | None, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if norm is not None:
            x = self.ops.rms_norm(x, norm.weight, norm.eps)
        return partial_rope(x, cos, sin, self.rotary_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, backend: AttentionBackend
                ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.query_key_value(x).view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        q = self._rotate(q, self.query_layernorm if self.qk_norm else None, cos, sin)
        k = self._rotate(k, self.key_layernorm if self.qk_norm else None, cos, sin)
        out = backend.forward(q, k, v.contiguous(), kv_cache[0], kv_cache[1], meta, self.scale)
        out = self.tp.all_reduce(self.dense(out.reshape(t, -1)))
        return out if self.dense.bias is None else out + self.dense.bias


class LLaDA2Layer(DecoderLayer):
    """The shared pre-norm layer (its forward: residual adds fused with the next norm) with LLaDA2's
    attention under the checkpoint's name `attention`, and its dense or routed MLP."""

    def __init__(self, spec: ModelSpec, tp: TPContext, index: int, moe_stats: MoEStats):
        nn.Module.__init__(self)
        extra: LLaDA2Spec = spec.extra
        self.attention = LLaDA2Attention(spec, tp)
        if extra.is_sparse(index):
            self.mlp = LLaDA2MoeBlock(spec.hidden_size, extra, tp, moe_stats)
        else:
            self.mlp = MLP(spec.hidden_size, spec.intermediate_size, tp)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    @property
    def self_attn(self) -> LLaDA2Attention:
        """The attention under the name the inherited forward calls."""
        return self.attention


class LLaDA2Backbone(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPContext, moe_stats: MoEStats):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp)
        self.layers = nn.ModuleList(LLaDA2Layer(spec, tp, i, moe_stats) for i in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    @property
    def embed_tokens(self) -> VocabParallelEmbedding:
        """The embedding under the name the runner and the shared forward use."""
        return self.word_embeddings


class LLaDA2MoeModelLM(PreNormDecoderLM):
    """LLaDA2's layers under the shared pre-norm decoder's forward and logits."""

    fixes_block_length = True  # engine.model.interfaces: a block-routed checkpoint decodes in its routing block

    @staticmethod
    def backbone(spec: ModelSpec, tp: TPContext, moe_stats: MoEStats) -> nn.Module:
        return LLaDA2Backbone(spec, tp, moe_stats)

    @staticmethod
    def rotary_embedding(spec: ModelSpec) -> RotaryEmbedding:
        # the rotary tables span only the rotated dims (frequencies over rotary_dim, as transformers')
        return RotaryEmbedding(replace(spec, head_dim=spec.extra.rotary_dim))

    def check_block_length(self, block_length: int | None) -> None:
        """Refuse a DLLM block length other than the routing block of a block-routed checkpoint (the
        runner asks before serving)."""
        if self.spec.extra.routing_block is not None:
            check_block_length(block_length, self.spec.extra.routing_block)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata, backend: AttentionBackend
                ) -> torch.Tensor:
        if self.spec.extra.routing_block is not None:
            check_segments(meta, self.spec.extra.routing_block)
        return super().forward(input_ids, positions, kv_caches, meta, backend)
