"""FlexAttention over the paged cache where it lies, with a BlockMask built from the page tables."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ops.attention.base import AttentionBackend, AttentionMetadata, StepPlan, planned
from ops.attention.torch_reference import TorchAttention

log = logging.getLogger(__name__)


FLEX_TILE = 16  # query rows per BlockMask tile


class FlexAttention(AttentionBackend):
    """FlexAttention over the paged cache where it lies.

    Keys are the whole cache seen as one sequence, [1, KVH, pages * page_size, D]; queries the flat
    batch, [1, H, T, D]. The BlockMask lists, per tile of `FLEX_TILE` query rows, the pages of the
    sequences in that tile up to the furthest key one of its rows sees, so a compiled kernel reads
    only those pages. The mask then decides per query row and key slot: slot `i` lies in page
    `i // page_size`, which is page number `logical[seq, page]` of the query's sequence (-1: not one
    of its pages), i.e. key position `logical * page_size + i % page_size`, visible when below the
    row's key limit (causal: position + 1; block-causal: the end of the row's DLLM block, at most the
    sequence's length; a bidirectional sequence's rows: its length). Padded rows of the last tile have
    limit 0 and see nothing."""

    name = "flex"
    plans_from_page_tables = True

    def __init__(self, compiled: bool, dynamic: bool = False):
        self.compiled = compiled
        self.fn = flex_attention_fn(compiled, dynamic)
        self.fallback: TorchAttention | None = None  # serves instead once the compiled kernel failed

    def plan(self, q_lens: list[int], kv_lens: list[int], page_tables: list[list[int]], page_size: int,
             block_length: int | None, pad_tiles: int | None = None, bidirectional: list[bool] | None = None
             ) -> StepPlan:
        b, page, tables = block_length, page_size, page_tables
        q_seq: list[int] = []
        q_limit: list[int] = []
        for s, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
            q_seq += [s] * q_len
            if bidirectional is not None and bidirectional[s]:
                q_limit += [kv_len] * q_len
                continue
            q_limit += (range(kv_len - q_len + 1, kv_len + 1) if b is None else
                        (min((p // b + 1) * b, kv_len) for p in range(kv_len - q_len, kv_len)))
        total, starts = len(q_seq), [0, *accumulate(q_lens)]
        # pages each tile may read: for every sequence in it, its pages up to the furthest key its rows
        # there see (the limit of its last row in the tile: limits grow along a sequence's rows)
        tile_pages: list[list[int]] = [[] for _ in range(-(-total // FLEX_TILE))]
        own_seq: list[int] = []
        own_page: list[int] = []
        own_logical: list[int] = []
        for s, (table, kv_len) in enumerate(zip(tables, kv_lens, strict=True)):
            lo, hi = starts[s], starts[s + 1]
            for t in range(lo // FLEX_TILE, (hi - 1) // FLEX_TILE + 1):
                tile_pages[t] += table[: -(-q_limit[min(hi, (t + 1) * FLEX_TILE) - 1] // page)]
            n = -(-kv_len // page)
            own_seq += [s] * n
            own_page += table[:n]
            own_logical += range(n)
        tiles = [list(dict.fromkeys(pages)) for pages in tile_pages]  # a page shared by prefix caching once
        width = max(len(t) for t in tiles)
        pad = -total % FLEX_TILE
        return StepPlan(
            arrays={"q_seq": q_seq + [0] * pad, "q_limit": q_limit + [0] * pad,
                    "kv_num_blocks": [len(t) for t in tiles],
                    "kv_indices": [p for t in tiles for p in t + [0] * (width - len(t))],
                    "own_seq": own_seq, "own_page": own_page, "own_logical": own_logical},
            scalars={"tiles": len(tiles), "width": width, "num_tokens": total, "num_seqs": len(tables)})

    def prepare(self, meta: AttentionMetadata) -> None:
        if self.fallback is not None:
            self.fallback.prepare(meta)
            return
        arrays, scalars = planned(self, meta), meta.plan.scalars
        meta.extra = {
            **{name: arrays[name] for name in ("q_seq", "q_limit", "own_seq", "own_page", "own_logical")},
            "kv_num_blocks": arrays["kv_num_blocks"].to(torch.int32)[None, None],
            "kv_indices": arrays["kv_indices"].to(torch.int32).view(scalars["tiles"], scalars["width"])[None, None],
            **scalars,
            "block_mask": None,  # needs the cache's size: made by the first layer, reused by the others
        }

    def block_mask(self, meta: AttentionMetadata, num_pages: int) -> BlockMask:
        """The forward's BlockMask over a cache of `num_pages` pages (device ops only, no sync)."""
        extra, page = meta.extra, meta.page_size
        q_seq, q_limit = extra["q_seq"], extra["q_limit"]
        logical = torch.full((extra["num_seqs"], num_pages), -1, dtype=torch.long, device=q_seq.device)
        logical[extra["own_seq"], extra["own_page"]] = extra["own_logical"]

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            index = logical[q_seq[q_idx], kv_idx // page]
            return (index >= 0) & (index * page + kv_idx % page < q_limit[q_idx])

        kv_indices = extra["kv_indices"]
        if self.compiled and not kv_indices.is_cuda:  # the CPU kernel wants a column per page of keys
            kv_indices = F.pad(kv_indices, (0, num_pages - kv_indices.shape[-1]))
        return BlockMask.from_kv_blocks(extra["kv_num_blocks"], kv_indices, BLOCK_SIZE=(FLEX_TILE, page),
                                        mask_mod=mask_mod, seq_lengths=(extra["num_tokens"], num_pages * page),
                                        compute_q_blocks=False)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        if self.fallback is not None:
            return self.fallback.attend(q, k_cache, v_cache, meta, scale)
        if meta.extra["block_mask"] is None:
            meta.extra["block_mask"] = self.block_mask(meta, k_cache.shape[0])
        kvh, d = k_cache.shape[-2:]
        keys = k_cache.view(-1, kvh, d).transpose(0, 1)[None]
        values = v_cache.view(-1, kvh, d).transpose(0, 1)[None]
        try:
            out = self.fn(q.transpose(0, 1)[None], keys, values, block_mask=meta.extra["block_mask"], scale=scale,
                          enable_gqa=True)
        except Exception as error:  # noqa: BLE001 -- whatever the compiler raised; eager errors propagate
            if not self.compiled:
                raise
            return self._fall_back(error, q, k_cache, v_cache, meta, scale)
        return out[0].transpose(0, 1)

    def _fall_back(self, error: Exception, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """A compiled kernel that fails to build (no C compiler for Triton's launcher, a compiler bug) must
        not take the engine down: the torch backend serves from this call on, and says so."""
        log.error("compiled FlexAttention failed (%s: %s); the torch attention backend serves instead",
                  type(error).__name__, error)
        self.fallback, self.name = TorchAttention(), "torch (compiled flex failed)"
        meta.extra = None
        self.fallback.prepare(meta)
        return self.fallback.attend(q, k_cache, v_cache, meta, scale)




def flex_attention_fn(compiled: bool, dynamic: bool) -> Callable[..., torch.Tensor]:
    """`flex_attention`, compiled (whole graph) or eager. `dynamic` (for serving): the query count and
    the BlockMask's width change every step, so one symbolic-shape compile instead of a recompile per
    new shape (past dynamo's recompile limit it would fall back to eager, which materialises query x
    key scores). torch 2.13's CPU kernel fails to build with symbolic shapes, so the CPU tests compile
    static shapes. On CUDA the compiled call carries `triton_tiles` of its BlockMask."""
    if not compiled:
        return flex_attention
    kernel = torch.compile(flex_attention, fullgraph=True, dynamic=dynamic)

    def compiled_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_mask: BlockMask,
                      **kwargs: object) -> torch.Tensor:
        options = triton_tiles(block_mask) if q.is_cuda else None
        return kernel(q, k, v, block_mask=block_mask, kernel_options=options, **kwargs)

    return compiled_flex


def triton_tiles(block_mask: BlockMask) -> dict[str, object]:
    """The Triton kernel's tile sizes for a BlockMask of small blocks (16 query rows x one 16-slot page
    here). Inductor's default tiles (64-128) must divide the mask's blocks, so without these it refuses
    the mask ("Q and KV block size must be divisible by BLOCK_M and BLOCK_N"). And the main kernel
    always: for short queries inductor would pick its split-KV decoding kernel, which found no valid
    configuration for these masks (torch 2.11, H200)."""
    q_block, kv_block = block_mask.BLOCK_SIZE
    return {"BLOCK_M": min(q_block, 64), "BLOCK_N": min(kv_block, 64), "FORCE_USE_FLEX_ATTENTION": True}


def flex_unmet(device: torch.device) -> list[str]:
    """Why compiled FlexAttention cannot serve here (eager FlexAttention runs anywhere, but it builds the
    full query x cache score matrix: a reference, not a serving path)."""
    unmet = []
    if device.type != "cuda":
        unmet.append(f"device is {device.type}; compiled FlexAttention serves on cuda (on the CPU torch is faster)")
    if importlib.util.find_spec("triton") is None:
        unmet.append("triton is not installed (torch.compile generates the FlexAttention kernel with it)")
    return unmet
