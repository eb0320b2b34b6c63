"""DiffusionGemma's attention over its paged K/V caches (the torch reference).

A forward holds passes of two kinds, one per sequence, contiguous in the flat batch:
- **encode** (prompt prefill, a chunk of it, or the commit of a finished canvas): causal; a sliding
  layer's query at position q sees keys at positions > q − `sliding_window`; its K/V are written.
- **canvas**: the canvas's queries see each other (bidirectional) and the committed keys — on sliding
  layers only the last `sliding_window − 1` of them, the same for every canvas query — and write
  nothing: the canvas's own K/V never leave the forward.

Each layer group (sliding, full) has its own caches and page tables; a sliding group's table may hold
freed pages (`FREED`) before the window, which are never read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
class GemmaAttentionMeta:
    passes: list[GemmaPass]
    page_size: int
    sliding_window: int
    device: torch.device
    # derived by `prepare`: per group, per pass (key slots of committed keys, mask or None), write slots
    groups: dict[str, dict] = field(default_factory=dict)

    def committed_range(self, p: GemmaPass, kind: str) -> tuple[int, int]:
        """Positions [lo, hi) of committed keys pass `p` reads in a `kind` layer."""
        lo = 0 if kind == FULL else max(0, p.start - (self.sliding_window - 1))
        return lo, p.start

    def prepare(self) -> None:
        """Key slots, masks and write slots of every pass, once per forward for all layers of a group."""
        for kind in (SLIDING, FULL):
            per_pass, write_rows, write_slots, row = [], [], [], 0
            for p in self.passes:
                lo, hi = self.committed_range(p, kind)
                table = p.page_tables[kind]
                slots = [_slot(table, pos, self.page_size) for pos in range(lo, hi)]
                per_pass.append((row, torch.tensor(slots, dtype=torch.long, device=self.device),
                                 self._mask(p, kind, lo)))
                if p.kind == ENCODE:
                    write_rows += range(row, row + p.q_len)
                    write_slots += [_slot(table, p.start + i, self.page_size) for i in range(p.q_len)]
                row += p.q_len
            self.groups[kind] = {
                "passes": per_pass,
                "write_rows": torch.tensor(write_rows, dtype=torch.long, device=self.device),
                "write_slots": torch.tensor(write_slots, dtype=torch.long, device=self.device),
            }

    def _mask(self, p: GemmaPass, kind: str, lo: int) -> torch.Tensor | None:
        if p.kind == CANVAS:
            return None
        q = torch.arange(p.start, p.start + p.q_len, device=self.device)[:, None]
        k = torch.cat([torch.arange(lo, p.start, device=self.device),
                       torch.arange(p.start, p.start + p.q_len, device=self.device)])[None, :]
        visible = k <= q
        if kind == SLIDING:
            visible &= k > q - self.sliding_window
        return visible


def _slot(table: list[int], pos: int, page_size: int) -> int:
    page = table[pos // page_size]
    if page == FREED:
        raise RuntimeError(f"position {pos} lies on a freed page: the sliding window no longer holds it")
    return page * page_size + pos % page_size


def gemma_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: GemmaAttentionMeta, kind: str) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D], caches [pages, page_size, KVH, D] -> [T, H, D]; scaling 1.0.
    Encode passes' K/V are written first; canvas passes' only attend."""
    group = meta.groups[kind]
    kvh, d = k_cache.shape[-2:]
    flat_k, flat_v = k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)
    if len(group["write_rows"]):
        flat_k.index_copy_(0, group["write_slots"], k.index_select(0, group["write_rows"]))
        flat_v.index_copy_(0, group["write_slots"], v.index_select(0, group["write_rows"]))
    out = torch.empty_like(q)
    for p, (row, slots, mask) in zip(meta.passes, group["passes"], strict=True):
        rows = slice(row, row + p.q_len)
        keys = torch.cat([flat_k.index_select(0, slots), k[rows]])
        values = torch.cat([flat_v.index_select(0, slots), v[rows]])
        out[rows] = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=mask, scale=1.0, enable_gqa=True)[0].transpose(0, 1)
    return out
