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
        passes = meta.passes
        canvas = [p.kind == CANVAS for p in passes]
        # the tiles as the engine's own plan lists them (a pass a sequence; a canvas's cached keys end at its
        # start), and per tile what the passes mode adds
        arrays = self.kernel.plan_tiles([p.q_len for p in passes],
                                        [p.start if c else p.start + p.q_len for p, c in zip(passes, canvas)],
                                        per_tile)
        seqs = arrays["tile_seq"].tolist()
        arrays["tile_kind"] = [self.kernel.PASS_CANVAS if canvas[s] else self.kernel.PASS_ENCODE for s in seqs]
        arrays["tile_lo"] = [plan.committed_from[s] if canvas[s] else 0 for s in seqs]
        arrays["tile_own_row0"] = [plan.rows[s] for s in seqs]
        arrays["tile_own_len"] = [passes[s].q_len if canvas[s] else 0 for s in seqs]
        positions = [pos for p in passes for pos in range(p.start, p.start + p.q_len)]
        tables = [p.page_tables[kind] for p in passes]
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
