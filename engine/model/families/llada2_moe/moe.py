"""LLaDA2's sparse block: the shared routed-expert block (engine.model.layers.moe) with LLaDA2's
sigmoid router (group-limited, or LLaDA2.2's block routing) and its shared experts."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from engine.model.families.llada2_moe.block_routing import allowed_experts
from engine.model.families.llada2_moe.config import LLaDA2Spec
from engine.model.layers.mlp import SwiGLU
from engine.model.layers.moe import MoEStats, SparseMoeBlock
from engine.model.layers.parallel import TPContext
from engine.model.spec import MoESpec


class SigmoidRouter(nn.Module):
    """LLaDA2's router parameters: `weight` [E, H] and `expert_bias` [E] (checkpoint names
    `mlp.gate.weight`, `mlp.gate.expert_bias`)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.expert_bias = nn.Parameter(torch.empty(num_experts))


class LLaDA2MoeBlock(SparseMoeBlock):
    """LLaDA2's sparse block: a sigmoid router in float32 whose expert bias decides only which experts
    run: each token takes the top `num_experts_per_tok` biased scores among the experts it is allowed;
    the chosen experts' sigmoid scores (without the bias) normalised to sum 1 (+1e-20, when more than
    one is chosen) and scaled by `routed_scaling_factor` are its weights. Plus the shared experts, one
    SwiGLU of `num_shared_experts * moe_intermediate_size`, added to every token.

    Which experts a token is allowed: with `expert_capacity` (LLaDA2.2), its routing block's
    (block_routing.py); otherwise group-limited: the experts split into `n_group` equal groups, a
    group's score is the sum of its two best biased scores, and the `topk_group` best groups' experts."""

    def __init__(self, hidden_size: int, spec: LLaDA2Spec, tp: TPContext, stats: MoEStats):
        shared = spec.num_shared_experts * spec.moe_intermediate_size
        if shared % tp.size:
            raise ValueError(f"tp={tp.size} must divide the model's shared experts' width ({shared})")
        super().__init__(hidden_size, MoESpec(spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size,
                                              norm_topk_prob=True, sparse_layers=frozenset()), tp, stats)
        self.spec = spec
        self.gate = SigmoidRouter(hidden_size, spec.num_experts)
        self.shared_experts = SwiGLU(hidden_size, shared, tp) if shared else None

    def allowed(self, biased: torch.Tensor) -> torch.Tensor:
        """[T, E] mask of the experts each token may choose from."""
        spec, t = self.spec, biased.shape[0]
        if spec.expert_capacity is not None:
            return allowed_experts(biased, spec.routing_block, spec.expert_capacity)
        group_scores = biased.view(t, spec.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, spec.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        return keep.repeat_interleave(spec.num_experts // spec.n_group, dim=1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(F.linear(x.float(), self.gate.weight.float()))
        biased = scores + self.gate.expert_bias.float()
        experts = torch.topk(biased.masked_fill(~self.allowed(biased), float("-inf")), self.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.spec.routed_scaling_factor).to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.all_reduce(out)
