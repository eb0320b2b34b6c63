"""DiffusionGemma's attention over its paged K/V caches: the passes of a forward, what every backend
shares (the K/V write of encoder passes, the committed keys each pass reads), and the torch reference.

A forward holds passes of two kinds, one per sequence, contiguous in the flat batch:
- **encode** (prompt prefill, a chunk of it, or the commit of a finished canvas): causal; a sliding
  layer's query at position q sees keys at positions > q − `sliding_window`; its K/V are written.
- **canvas**: the canvas's queries see each other (bidirectional) and the committed keys — on sliding
  layers only the last `sliding_window − 1` of them, the same for every canvas query — and write
  nothing: the canvas's own K/V never leave the forward.

Each layer group (sliding, full) has its own caches and page tables; a sliding group's table may hold
freed pages (`FREED`) before the window, which are never read. A backend (`GemmaTorchAttention` here,
`flex_attention.GemmaFlexAttention`) derives what it needs once per forward and group in `prepare`
and attends every layer of the group with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from engine.model.families.diffusion_gemma.config import FULL, SLIDING

ENCODE, CANVAS = "encode", "canvas"
FREED = -1  # a sliding-group page released once it fell out of the window (the page manager's RELEASED)


@dataclass
class GemmaPass:
    """One sequence's part of a forward: `q_len` tokens at positions start, start+1, ...; `start`
    tokens are committed before it. `page_tables[kind]` maps its positions to pages per layer group."""

    kind: str
    start: int
    q_len: int
    page_tables: dict[str, list[int]]
    soft_embedding: torch.Tensor | None = None  # canvas: the self-conditioning input [L, H]; None = 0


@dataclass
class GroupPlan:
    """One layer group's share of a forward, the same for all its layers."""

    committed: list[np.ndarray]  # per pass: the cache slots (int64) of the committed keys it reads, in position order
    committed_from: list[int]  # per pass: the position of its first committed key
    rows: list[int]  # per pass: its first row in the flat batch
    write_rows: torch.Tensor  # rows of encoder passes, whose K/V go to the cache...
    write_slots: torch.Tensor  # ...at these slots
    window: int | None  # the group's sliding window (None: full attention)
    backend: dict = field(default_factory=dict)  # what the backend derived from the rest


class GemmaAttentionBackend(Protocol):
    name: str
    graph_safe: bool  # whether CUDA graphs may capture its passes (none may yet)

    def prepare(self, meta: GemmaAttentionMeta, plan: GroupPlan) -> None:
        """Derive, into `plan.backend`, what every layer of the group reuses in this forward."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: GemmaAttentionMeta, plan: GroupPlan) -> torch.Tensor:
        """q [T, H, D], this forward's k/v [T, KVH, D] (encoder passes' already in the cache) -> [T, H, D]."""


@dataclass
class GemmaAttentionMeta:
    passes: list[GemmaPass]
    page_size: int
    sliding_window: int
    device: torch.device
    backend: GemmaAttentionBackend | None = None  # None: the torch reference
    groups: dict[str, GroupPlan] = field(default_factory=dict)  # filled by `prepare`

    def committed_range(self, p: GemmaPass, kind: str) -> tuple[int, int]:
        """Positions [lo, hi) of committed keys pass `p` reads in a `kind` layer."""
        lo = 0 if kind == FULL else max(0, p.start - (self.sliding_window - 1))
        return lo, p.start

    def prepare(self) -> None:
        """Every group's plan, once per forward for all layers of the group."""
        self.backend = self.backend or GemmaTorchAttention()
        present = self.passes[0].page_tables if self.passes else {}
        for kind in (k for k in (SLIDING, FULL) if k in present):  # a network may lack one kind of layer
            committed, committed_from, rows, write_rows, write_slots, row = [], [], [], [], [], 0
            for p in self.passes:
                lo, hi = self.committed_range(p, kind)
                table = p.page_tables[kind]
                committed.append(slots_of(table, lo, hi, self.page_size))
                committed_from.append(lo)
                rows.append(row)
                if p.kind == ENCODE:
                    write_rows += range(row, row + p.q_len)
                    write_slots.append(slots_of(table, p.start, p.start + p.q_len, self.page_size))
                row += p.q_len
            writes = np.concatenate(write_slots) if write_slots else np.empty(0, dtype=np.int64)
            plan = GroupPlan(committed, committed_from, rows,
                             torch.tensor(write_rows, dtype=torch.long, device=self.device),
                             torch.from_numpy(writes).to(self.device),
                             self.sliding_window if kind == SLIDING else None)
            self.backend.prepare(self, plan)
            self.groups[kind] = plan


def slots_of(table: list[int], lo: int, hi: int, page_size: int) -> np.ndarray:
    """The cache slots of positions [lo, hi) through `table`, as int64, worked out a page at a time (a long
    context's committed keys are thousands a pass, every forward); RuntimeError when one lies on a freed
    page."""
    if hi <= lo:
        return np.empty(0, dtype=np.int64)
    first = lo // page_size
    pages = np.asarray(table[first: (hi - 1) // page_size + 1], dtype=np.int64)
    freed = np.flatnonzero(pages == FREED)
    if freed.size:
        pos = max(lo, (first + int(freed[0])) * page_size)
        raise RuntimeError(f"position {pos} lies on a freed page: the sliding window no longer holds it")
    offset = lo - first * page_size
    return (pages[:, None] * page_size + np.arange(page_size)).reshape(-1)[offset: offset + hi - lo]


def gemma_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: GemmaAttentionMeta, kind: str) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D], caches [pages, page_size, KVH, D] -> [T, H, D]; scaling 1.0.
    Encode passes' K/V are written first; canvas passes' only attend."""
    plan = meta.groups[kind]
    kvh, d = k_cache.shape[-2:]
    if len(plan.write_rows):
        k_cache.view(-1, kvh, d).index_copy_(0, plan.write_slots, k.index_select(0, plan.write_rows))
        v_cache.view(-1, kvh, d).index_copy_(0, plan.write_slots, v.index_select(0, plan.write_rows))
    return meta.backend.attend(q, k, v, k_cache, v_cache, meta, plan)


class GemmaTorchAttention:
    """The reference: per pass, its committed keys gathered beside its own, one SDPA call."""

    name = "torch"
    graph_safe = False

    def prepare(self, meta: GemmaAttentionMeta, plan: GroupPlan) -> None:
        plan.backend["torch"] = [
            (torch.from_numpy(slots).to(meta.device), self._mask(p, lo, plan.window, meta.device))
            for p, slots, lo in zip(meta.passes, plan.committed, plan.committed_from, strict=True)]

    @staticmethod
    def _mask(p: GemmaPass, lo: int, window: int | None, device: torch.device) -> torch.Tensor | None:
        if p.kind == CANVAS:
            return None
        q = torch.arange(p.start, p.start + p.q_len, device=device)[:, None]
        k = torch.cat([torch.arange(lo, p.start, device=device),
                       torch.arange(p.start, p.start + p.q_len, device=device)])[None, :]
        visible = k <= q
        if window is not None:
            visible &= k > q - window
        return visible

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: GemmaAttentionMeta, plan: GroupPlan) -> torch.Tensor:
        if "torch" not in plan.backend:  # a backend that handed over to this one mid-forward
            self.prepare(meta, plan)
        kvh, d = k_cache.shape[-2:]
        flat_k, flat_v = k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)
        out = torch.empty_like(q)
        for p, row, (slots, mask) in zip(meta.passes, plan.rows, plan.backend["torch"], strict=True):
            rows = slice(row, row + p.q_len)
            keys = torch.cat([flat_k.index_select(0, slots), k[rows]])
            values = torch.cat([flat_v.index_select(0, slots), v[rows]])
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=mask, scale=1.0, enable_gqa=True)[0].transpose(0, 1)
        return out
