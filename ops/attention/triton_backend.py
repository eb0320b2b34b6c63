"""The `triton` backend: the project's own paged-attention kernel (ops.attention.triton_paged), the one
backend whose forwards CUDA graphs replay."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import torch

from ops.attention.base import AttentionBackend, AttentionMetadata, StepPlan, planned


def triton_unmet(device: torch.device) -> list[str]:
    """Why the `triton` backend cannot serve on `device` (empty: it can). On CUDA it needs Triton
    (which CUDA builds of torch ship); on the CPU it runs only under Triton's interpreter, asked for
    with TRITON_INTERPRET=1 -- correct but far too slow to serve, which is what the tests use."""
    if importlib.util.find_spec("triton") is None:
        return ["Triton is not installed (CUDA builds of torch ship it; pip install triton)"]
    if device.type == "cuda":
        return []
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return []
    return [f"the Triton kernel runs on CUDA devices, not {device.type} (on the CPU only under Triton's "
            "interpreter, TRITON_INTERPRET=1, which is for tests)"]


def require_triton(device: torch.device) -> None:
    """A ValueError naming why `attention_backend='triton'` cannot run on `device`, if it cannot."""
    unmet = triton_unmet(device)
    if unmet:
        raise ValueError("attention_backend='triton' cannot run: " + "; ".join(unmet)
                         + ". Use attention_backend='torch' or 'auto'")


class TritonAttention(AttentionBackend):
    """Paged attention by the project's Triton kernel: K/V read through the page tables in place, the
    query heads of a K/V head packed into one tile, one launch per layer over a grid of (tiles, K/V
    heads). `plan` lists the tiles on the host; padded to a size fixed per token bucket (`tiles_for`),
    the launch is the same at every replay of a CUDA graph whatever rows the step carries."""

    name = "triton"
    graph_safe = True

    def __init__(self, query_group: int):
        from ops.attention import triton_paged  # imports Triton: only once this backend is chosen

        self.kernel = triton_paged
        self.rows_per_tile = triton_paged.block_q(query_group)

    def tiles_for(self, tokens: int, max_seqs: int) -> int:
        """The tile count every step of `tokens` rows over at most `max_seqs` sequences is padded to."""
        return self.kernel.max_tiles(tokens, max_seqs, self.rows_per_tile)

    def plan(self, q_lens: list[int], kv_lens: list[int], page_tables: list[list[int]], page_size: int,
             block_length: int | None, pad_tiles: int | None = None, bidirectional: list[bool] | None = None
             ) -> StepPlan:
        """The tiles; with `bidirectional` (every sequence's mask named) also each tile's pass kind for
        the kernel's PASSES mode: a bidirectional sequence's tiles are canvas tiles reading all of their
        keys from the cache (from key 0, none of their own beside it), the others encoder (causal)
        tiles. That mode is used for every forward that names its masks, so that a CUDA graph captured
        on one such forward replays the others."""
        arrays = self.kernel.plan_tiles(q_lens, kv_lens, self.rows_per_tile, pad_tiles)
        if bidirectional is not None:
            if block_length is not None:
                raise ValueError("the triton backend attends bidirectional rows beside causal ones only: "
                                 f"block-causal rows (block length {block_length}) cannot share their forward")
            kernel, tiles = self.kernel, arrays["tile_seq"]
            arrays["tile_kind"] = np.where(np.asarray(bidirectional)[tiles], kernel.PASS_CANVAS, kernel.PASS_ENCODE)
            arrays["tile_lo"] = arrays["tile_own_row0"] = arrays["tile_own_len"] = np.zeros(tiles.size, np.int64)
        return StepPlan(arrays=arrays)

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.extra = planned(self, meta)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        block = meta.dllm_block_length
        if meta.bidirectional is not None:
            mode = self.kernel.PASSES
        else:
            mode = self.kernel.CAUSAL if block is None else self.kernel.BLOCK_CAUSAL
        return self.kernel.run_paged_attention(q, k_cache, v_cache, meta.page_tables, meta.positions, meta.extra,
                                               scale, mode, dllm_block=block or 1)
