"""The Qwen3-MoE sparse block: a replicated softmax router and routed SwiGLU experts.

Routing is exactly Hugging Face's `Qwen3MoeSparseMoeBlock`: router logits `x @ gate^T`, softmax in
float32, the top `num_experts_per_tok` probabilities (renormalised to sum 1 when `norm_topk_prob`),
cast back to the activation dtype; a token's output is the weighted sum of its experts' outputs.

Only routed work is computed: the (token, expert) pairs are sorted by expert id, every expert's
GEMM pair runs over exactly its rows (one grouped GEMM per projection, `ops.grouped_gemm`), and the
weighted rows are scattered back with one `index_add_` in expert order (the order Hugging Face adds
them in). An expert no token picked costs nothing.

Tensor parallelism splits every expert's intermediate dimension: rank r holds rows
`[r*I/tp, (r+1)*I/tp)` of each expert's gate/up projection and the same columns of its down
projection, so each rank computes a partial sum of every routed token's output and one all-reduce
(the same one a dense MLP needs) completes it. The router is replicated: every rank sees the same
hidden states after the attention all-reduce and so picks the same experts.

A family with another router (e.g. a group-limited sigmoid router) subclasses the block and
replaces `route`.

Weights live stacked for compute: `w13` [E, 2*I_local, H] (gate rows, then up rows: one GEMM per
expert for both) and `w2` [E, H, I_local]. The block's `packed_modules_mapping` names the
checkpoint's per-expert tensors (`experts.<e>.gate_proj.weight`, ...) and `StackedExperts` places
each one straight into its slot, split like the dense MLP's projection it replaces.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from engine.model.layers.parallel import ColumnSplit, RowSplit, Split, TPContext
from engine.model.spec import MoESpec
from ops.fused import EAGER, Elementwise
from ops.grouped_gemm import group_ends, grouped_linear


class StackedExperts(Split):
    """A stacked parameter [E, rows, cols] holding each expert's checkpoint tensors `projs` one after
    the other along its rows (`w13[e]`: gate rows, then up rows), each split like the dense MLP's
    projection it stands for (`split`: column-parallel gate/up, row-parallel down)."""

    def __init__(self, projs: tuple[str, ...], split: Split):
        super().__init__(split.tp)
        self.projs, self.split = projs, split

    def place(self, param: torch.Tensor, shard_id: object = None) -> tuple[torch.Tensor, Split] | None:
        expert, proj = shard_id
        if expert >= param.shape[0]:
            return None
        rows, i = param.shape[1] // len(self.projs), self.projs.index(proj)
        return param[expert, i * rows : (i + 1) * rows], self.split

    def checkpoint_names(self, name: str, param: torch.Tensor) -> list[str]:
        prefix = name.rpartition(".")[0]
        return [f"{prefix}.experts.{e}.{p}.weight" for e in range(param.shape[0]) for p in self.projs]


@dataclass
class MoEStats:
    """Routed work done so far: (token, expert) rows through the expert GEMMs, tokens routed, and,
    when `timed` is set (benchmarks), seconds spent in the expert GEMM loop. Counted by the host as
    the forward runs, so a CUDA graph's replays add nothing (bench/moe.py measures eagerly)."""

    routed_rows: int = 0
    tokens: int = 0
    expert_seconds: float = 0.0
    timed: bool = False


class SparseMoeBlock(nn.Module):
    ops: Elementwise = EAGER  # the SiLU gate (ops.fused); the model switches it to the compiled one

    #: checkpoint tensor names below this module -> (stacked parameter, shard id); the first group is the expert
    packed_modules_mapping = {
        r"experts\.(\d+)\.gate_proj\.weight": ("w13", "gate_proj"),
        r"experts\.(\d+)\.up_proj\.weight": ("w13", "up_proj"),
        r"experts\.(\d+)\.down_proj\.weight": ("w2", "down_proj"),
    }

    def __init__(self, hidden_size: int, moe: MoESpec, tp: TPContext, stats: MoEStats):
        super().__init__()
        if moe.moe_intermediate_size % tp.size:
            raise ValueError(f"tp={tp.size} must divide the model's moe_intermediate_size "
                             f"({moe.moe_intermediate_size})")
        self.top_k, self.norm_topk_prob = moe.num_experts_per_tok, moe.norm_topk_prob
        self.num_experts = moe.num_experts
        self.inter = moe.moe_intermediate_size // tp.size
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(moe.num_experts, 2 * self.inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(moe.num_experts, hidden_size, self.inter))
        self.weight_loaders = {"w13": StackedExperts(("gate_proj", "up_proj"), ColumnSplit(tp)),
                               "w2": StackedExperts(("down_proj",), RowSplit(tp))}
        self.all_reduce = tp.all_reduce
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
        ends = group_ends(flat, self.num_experts)
        start_time = time.perf_counter() if self.stats.timed else 0.0
        gate, up = grouped_linear(x[token_of], self.w13, ends).split(self.inter, dim=-1)
        out_rows = grouped_linear(self.ops.silu_and_mul(gate, up), self.w2, ends)
        if self.stats.timed:
            self.stats.expert_seconds += time.perf_counter() - start_time
        self.stats.routed_rows += len(flat)
        self.stats.tokens += x.shape[0]
        out_rows *= weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, token_of, out_rows)
