"""DiffusionGemma's attention passes for the backend tests (FlexAttention and the Triton kernel against the
torch reference, attention alone, float32 on the CPU): the batch kinds, forwards over shuffled pages of
both layer groups with garbage wherever nothing was committed, and one group's attention over them."""

from __future__ import annotations

import torch

from engine.model.families.diffusion_gemma.attention import (
    CANVAS,
    ENCODE,
    FREED,
    GemmaAttentionMeta,
    GemmaPass,
    gemma_attention,
)
from engine.model.families.diffusion_gemma.config import FULL, SLIDING

PAGE, WINDOW, HEADS, NUM_PAGES = 4, 8, 4, 64
# (kind, committed tokens, tokens fed) per sequence
BATCHES = {
    "prefills": [(ENCODE, 0, 1), (ENCODE, 0, 9), (ENCODE, 0, 40)],
    "canvases_inside_and_beyond_the_window": [(CANVAS, 3, 16), (CANVAS, 7, 16), (CANVAS, 30, 16)],
    "commit_beside_canvases": [(CANVAS, 12, 16), (ENCODE, 21, 16), (CANVAS, 0, 16)],
    "chunk_after_a_long_context": [(ENCODE, 50, 24), (CANVAS, 1, 16)],
    "one_row_passes": [(ENCODE, 9, 1), (CANVAS, 2, 1), (ENCODE, 0, 2)],
    "canvas_over_three_tiles": [(ENCODE, 0, 5), (CANVAS, 3, 40)],
}


def make_forward(shapes: list[tuple[str, int, int]], kv_heads: int, dim: int, seed: int = 0):
    """Passes over shuffled pages of both groups, the sliding group's pages before the window freed;
    every cache slot no pass has committed holds large garbage (a key read from the wrong slot changes
    the result). Returns (meta factory, q, k, v, caches per group)."""
    g = torch.Generator().manual_seed(seed)
    perms = {kind: torch.randperm(NUM_PAGES, generator=g).tolist() for kind in (SLIDING, FULL)}
    caches = {kind: torch.randn(2, NUM_PAGES, PAGE, kv_heads, dim, generator=g) * 30 for kind in (SLIDING, FULL)}
    passes = []
    for kind, start, fed in shapes:
        tables = {}
        for group, perm in perms.items():
            table = [perm.pop() for _ in range(-(-(start + fed) // PAGE))]
            for pos in range(start):
                caches[group][:, table[pos // PAGE], pos % PAGE] = torch.randn(2, kv_heads, dim, generator=g)
            if group == SLIDING:  # pages wholly before the window, as the page manager releases them
                keep_from = max(0, start - (WINDOW - 1)) // PAGE
                table = [FREED] * keep_from + table[keep_from:]
            tables[group] = table
        passes.append((kind, start, fed, tables))
    total = sum(fed for _, _, fed in shapes)
    q = torch.randn(total, HEADS, dim, generator=g)
    k = torch.randn(total, kv_heads, dim, generator=g)
    v = torch.randn(total, kv_heads, dim, generator=g)

    def meta(backend) -> GemmaAttentionMeta:
        return GemmaAttentionMeta([GemmaPass(kind, start, fed, tables) for kind, start, fed, tables in passes],
                                  PAGE, WINDOW, torch.device("cpu"), backend)

    return meta, q, k, v, caches


def attend(backend, forward, group: str) -> tuple[torch.Tensor, GemmaAttentionMeta]:
    meta_of, q, k, v, caches = forward
    meta = meta_of(backend)
    meta.prepare()
    k_cache, v_cache = caches[group][0].clone(), caches[group][1].clone()
    return gemma_attention(q, k, v, k_cache, v_cache, meta, group), meta


CASES = [(name, group, kv_heads, dim) for name in BATCHES for group, kv_heads, dim in ((SLIDING, 2, 16), (FULL, 1, 32))]
IDS = [f"{name}-{group}" for name, group, _, _ in CASES]
