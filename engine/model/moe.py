"""The Qwen3-MoE sparse block: a replicated softmax router and routed SwiGLU experts.

Routing is exactly Hugging Face's `Qwen3MoeSparseMoeBlock`: router logits `x @ gate^T`, softmax in
float32, the top `num_experts_per_tok` probabilities (renormalised to sum 1 when `norm_topk_prob`),
cast back to the activation dtype; a token's output is the weighted sum of its experts' outputs.

Only routed work is computed: the (token, expert) pairs are sorted by expert id, each active expert
runs one GEMM pair over exactly its rows, and the weighted rows are scattered back with one
`index_add_` in expert order (the order Hugging Face adds them in). An expert no token picked costs
nothing.

Tensor parallelism splits every expert's intermediate dimension: rank r holds rows
`[r*I/tp, (r+1)*I/tp)` of each expert's gate/up projection and the same columns of its down
projection, so each rank computes a partial sum of every routed token's output and one all-reduce
(the same one a dense MLP needs) completes it. The router is replicated: every rank sees the same
hidden states after the attention all-reduce and so picks the same experts.

`GroupLimitedMoeBlock` is LLaDA2's variant of the same block: its own router (sigmoid, expert
bias, expert groups) and shared experts, the same grouped expert GEMMs.

Weights live stacked for compute: `w13` [E, 2*I_local, H] (gate rows, then up rows: one GEMM per
expert for both) and `w2` [E, H, I_local]; the checkpoint's per-expert tensors are loaded straight
into their slots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from engine.model.checkpoint import MoESpec
from engine.model.llada2_config import LLaDA2Spec
from ops.fused import EAGER, Elementwise


@dataclass
class MoEStats:
    """Routed work done so far: (token, expert) rows through the expert GEMMs, tokens routed, and,
    when `timed` is set (benchmarks), seconds spent in the expert GEMM loop."""

    routed_rows: int = 0
    tokens: int = 0
    expert_seconds: float = 0.0
    timed: bool = False


class SparseMoeBlock(nn.Module):
    ops: Elementwise = EAGER  # the SiLU gate (ops.fused); the model switches it to the compiled one

    def __init__(self, hidden_size: int, moe: MoESpec, tp_size: int, all_reduce, stats: MoEStats):
        super().__init__()
        if moe.moe_intermediate_size % tp_size:
            raise ValueError(f"tp={tp_size} must divide the model's moe_intermediate_size "
                             f"({moe.moe_intermediate_size})")
        self.top_k, self.norm_topk_prob = moe.num_experts_per_tok, moe.norm_topk_prob
        self.num_experts = moe.num_experts
        self.inter = moe.moe_intermediate_size // tp_size
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(moe.num_experts, 2 * self.inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(moe.num_experts, hidden_size, self.inter))
        self.all_reduce = all_reduce
        self.stats = stats

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) per token."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(self.routed(x))

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the routed experts' weighted sum for every token (before the all-reduce)."""
        weights, experts = self.route(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        token_of = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x[token_of]
        out_rows = torch.empty_like(rows)
        start_time = time.perf_counter() if self.stats.timed else 0.0
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            gate, up = F.linear(rows[start : start + n], self.w13[e]).split(self.inter, dim=-1)
            out_rows[start : start + n] = F.linear(self.ops.silu_and_mul(gate, up), self.w2[e])
            start += n
        if self.stats.timed:
            self.stats.expert_seconds += time.perf_counter() - start_time
        self.stats.routed_rows += len(flat)
        self.stats.tokens += x.shape[0]
        out_rows *= weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, token_of, out_rows)


class SwiGLU(nn.Module):
    """A SwiGLU MLP's rank-local part (column-split gate/up, row-split down), without the all-reduce:
    its caller adds it to other partial sums first."""

    ops: Elementwise = EAGER

    def __init__(self, hidden_size: int, intermediate_local: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_local, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_local, bias=False)
        self.down_proj = nn.Linear(intermediate_local, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_proj(x), self.up_proj(x)))


class SigmoidRouter(nn.Module):
    """LLaDA2's router parameters: `weight` [E, H] and `expert_bias` [E] (checkpoint names
    `mlp.gate.weight`, `mlp.gate.expert_bias`)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.expert_bias = nn.Parameter(torch.empty(num_experts))


class GroupLimitedMoeBlock(SparseMoeBlock):
    """LLaDA2's sparse block: a sigmoid router in float32 whose expert bias decides only which experts
    run, group-limited top-k, the chosen experts' sigmoid scores (without the bias) normalised to sum 1
    (+1e-20, when more than one is chosen) and scaled by `routed_scaling_factor`; plus the shared
    experts, one SwiGLU of `num_shared_experts * moe_intermediate_size`, added to every token.

    Groups: the experts split into `n_group` equal groups; a group's score is the sum of its two best
    biased scores; the `topk_group` best groups stay and the top `num_experts_per_tok` biased scores
    among their experts pick the experts."""

    def __init__(self, hidden_size: int, spec: LLaDA2Spec, tp_size: int, all_reduce, stats: MoEStats):
        shared = spec.num_shared_experts * spec.moe_intermediate_size
        if shared % tp_size:
            raise ValueError(f"tp={tp_size} must divide the model's shared experts' width ({shared})")
        super().__init__(hidden_size, MoESpec(spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size,
                                              norm_topk_prob=True, sparse_layers=frozenset()),
                         tp_size, all_reduce, stats)
        self.spec = spec
        self.gate = SigmoidRouter(hidden_size, spec.num_experts)
        self.shared_experts = SwiGLU(hidden_size, shared // tp_size) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec, t = self.spec, x.shape[0]
        scores = torch.sigmoid(F.linear(x.float(), self.gate.weight.float()))
        biased = scores + self.gate.expert_bias.float()
        group_scores = biased.view(t, spec.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, spec.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        keep = keep.repeat_interleave(spec.num_experts // spec.n_group, dim=1)
        experts = torch.topk(biased.masked_fill(~keep, float("-inf")), self.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * spec.routed_scaling_factor).to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.all_reduce(out)
