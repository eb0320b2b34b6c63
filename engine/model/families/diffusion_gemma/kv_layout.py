"""The K/V page geometry of DiffusionGemma's two layer groups.

Sliding layers (small head, more K/V heads) and full layers (large head, few K/V heads) keep their
K/V in separate page pools with their own page ids: a page of a group holds `page_size` tokens of
every layer of that group. The sliding group never needs more than the window's pages per sequence
(the last `sliding_window − 1` committed tokens, plus the tokens an encoder pass writes), so its pool
is sized for that and the rest of the memory budget goes to the full group, which keeps the whole
context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.families.diffusion_gemma.config import FULL, SLIDING, GemmaSpec

GROUPS = (SLIDING, FULL)


@dataclass(frozen=True)
class KVLayout:
    spec: GemmaSpec
    page_size: int
    tp_size: int = 1

    def layers(self, kind: str) -> list[int]:
        return [i for i, g in enumerate(self.spec.layers) if g.kind == kind]

    def page_bytes(self, kind: str, dtype: torch.dtype) -> int:
        """Bytes one page of group `kind` takes on one shard (K and V of every layer of the group)."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(2 * self.page_size * g.num_kv_heads // self.tp_size * g.head_dim * size
                   for g in self.spec.layers if g.kind == kind)

    def windows(self) -> dict[str, int | None]:
        """Each group's sliding window (None: the group keeps the whole context)."""
        return {SLIDING: self.spec.sliding_window, FULL: None}

    def window_pages(self, new_tokens: int) -> int:
        """Sliding-group pages one sequence can hold at once: its last `sliding_window − 1` committed
        tokens and the `new_tokens` an encoder pass writes, wherever they fall on page boundaries."""
        return -(-(self.spec.sliding_window - 1 + new_tokens) // self.page_size) + 1

    def pool_sizes(self, budget_bytes: int, dtype: torch.dtype, max_sequences: int, max_new_tokens: int,
                   max_full_pages: int) -> dict[str, int]:
        """Pages per group for a memory budget: the sliding group what `max_sequences` sequences can
        hold at once, the full group the rest (at most `max_full_pages`, at least one page each). A
        group without layers has no pool (a group of no pages could never hold a sequence)."""
        sliding = max(1, max_sequences * self.window_pages(max_new_tokens)) if self.layers(SLIDING) else 0
        rest = budget_bytes - sliding * self.page_bytes(SLIDING, dtype)
        full_bytes = self.page_bytes(FULL, dtype)
        full = max(1, min(max_full_pages, rest // full_bytes if full_bytes else max_full_pages))
        return {kind: n for kind, n in ((SLIDING, sliding), (FULL, full)) if self.layers(kind)}

    def allocate(self, pools: dict[str, int], dtype: torch.dtype, device: torch.device
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K cache, V cache), each [pages of its group, page_size, local K/V heads, head_dim]."""
        return [torch.zeros(2, pools[g.kind], self.page_size, g.num_kv_heads // self.tp_size, g.head_dim,
                            dtype=dtype, device=device).unbind(0)
                for g in self.spec.layers]
