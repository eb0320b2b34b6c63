"""DiffusionGemma's encoder and canvas passes on the project's Triton paged-attention kernel.

One launch per layer for the whole forward, in the kernel's PASSES mode (ops.attention.triton_paged):
a tile is up to 16 query rows x heads of one pass. An encoder tile reads its pass's keys through the
group's page table, causally, and on sliding layers only inside the window (its own K/V were written
first). A canvas tile reads its pass's committed keys through the page table -- on sliding layers
from the window's anchor `start - (sliding_window - 1)`, the same for every canvas row -- and then the
forward's own K/V rows of its canvas, which never enter the cache. Keys before a tile's first
visible one are never loaded, so a sliding table's freed pages are never touched. Scaling 1.0, as
the network's attention is.
"""

from __future__ import annotations

import torch

from engine.model.families.diffusion_gemma.attention import CANVAS, GemmaAttentionMeta, GroupPlan
from engine.model.families.diffusion_gemma.config import FULL, SLIDING, GemmaSpec


class GemmaTritonAttention:
    """The kernel for a DiffusionGemma forward: `prepare` lists each group's tiles on the host and
    uploads them; `attend` launches once per layer."""

    name = "triton"
    graph_safe = False  # its canvas steps are not captured yet

    def __init__(self, gemma: GemmaSpec):
        from ops.attention import triton_paged  # imports Triton: only once this backend is chosen

        self.kernel = triton_paged
        heads = gemma.num_attention_heads
        self.rows_per_tile = {geo.kind: triton_paged.block_q(heads // geo.num_kv_heads) for geo in gemma.layers}

    def prepare(self, meta: GemmaAttentionMeta, plan: GroupPlan) -> None:
        kind = FULL if plan.window is None else SLIDING
        per_tile = self.rows_per_tile.get(kind, 1)
        arrays: dict[str, list[int]] = {name: [] for name in (
            "tile_seq", "tile_row0", "tile_rows", "tile_kv_len", "tile_kind", "tile_lo", "tile_own_row0",
            "tile_own_len")}
        positions: list[int] = []
        for s, (p, row, lo) in enumerate(zip(meta.passes, plan.rows, plan.committed_from, strict=True)):
            canvas = p.kind == CANVAS
            positions += range(p.start, p.start + p.q_len)
            for first in range(row, row + p.q_len, per_tile):
                arrays["tile_seq"].append(s)
                arrays["tile_row0"].append(first)
                arrays["tile_rows"].append(min(per_tile, row + p.q_len - first))
                arrays["tile_kv_len"].append(p.start if canvas else p.start + p.q_len)  # the cached keys' end
                arrays["tile_kind"].append(self.kernel.PASS_CANVAS if canvas else self.kernel.PASS_ENCODE)
                arrays["tile_lo"].append(lo if canvas else 0)
                arrays["tile_own_row0"].append(row)
                arrays["tile_own_len"].append(p.q_len if canvas else 0)
        tables = [p.page_tables[kind] for p in meta.passes]
        width = max(1, max(len(t) for t in tables))
        device = meta.device
        plan.backend["triton"] = {
            "tiles": {name: torch.tensor(values, dtype=torch.long, device=device) for name, values in arrays.items()},
            "positions": torch.tensor(positions, dtype=torch.long, device=device),
            "tables": torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device),
        }

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: GemmaAttentionMeta, plan: GroupPlan) -> torch.Tensor:
        planned = plan.backend["triton"]
        if k.stride() != v.stride():  # the kernel reads a canvas's own K and V rows with one set of strides
            k, v = k.contiguous(), v.contiguous()
        return self.kernel.run_paged_attention(q, k_cache, v_cache, planned["tables"], planned["positions"],
                                               planned["tiles"], 1.0, self.kernel.PASSES,
                                               window=plan.window or 0, own_k=k, own_v=v)
