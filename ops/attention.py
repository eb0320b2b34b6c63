"""Paged KV write and paged attention over variable-length batches.

A batch is a flat list of query tokens from several sequences (prefill chunks, DLLM blocks and AR
decode rows mixed). Each sequence's keys live in fixed-size pages of the KV cache, named by its
page table. Two masks exist:

* causal (AR): query at position p sees keys at positions <= p;
* block-causal (DLLM, block length B): query at p sees keys at positions j with j // B <= p // B.

Backends:

* `TorchAttention` -- the reference: gathers each sequence's keys into a padded tensor and runs
  `scaled_dot_product_attention` with an explicit mask. Runs everywhere.
* `FlashAttention` -- the FlashAttention-2 paged varlen kernel (`ops.flash_kernel`: vllm's bundled
  copy, the standalone vllm-flash-attn wheel, or torch's own `aten._flash_attention_forward`) reading
  the paged cache through `block_table`. Block-causal attention is expressed without a custom mask:
  every DLLM block of queries becomes its own varlen entry that sees keys up to its block end,
  non-causally.
* `FlexAttention` -- `torch.nn.attention.flex_attention` over the whole cache in place, with a
  `BlockMask` built from the page tables (which pages each 16-query tile may read) and a mask that
  maps a physical key slot back to its position in the query's sequence. Native GQA, no gather.
  Compiled on CUDA; eager (the dense reference implementation) elsewhere, which is how it is tested.

Per-step metadata is derived on the host: `plan` turns the batch's lists into int arrays and host
scalars without touching the device, the model runner uploads those with the rest of the step in
one copy (`meta.planned`), and `prepare` only slices and combines device tensors. A caller that
skips `plan` (tests, benchmarks) gets it done inside `prepare`, at the cost of extra copies.

`make_attention_backend` picks one from the config and the settings the kernels depend on.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ops import flash_kernel
from ops.flash_kernel import FlashKernel, flash_unmet

log = logging.getLogger(__name__)

# `enable_gqa` arrived in torch 2.5; before it, K/V heads are repeated for SDPA instead.
SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)
# SDPA's CUDA implementations for a masked call, minus cuDNN's. cuDNN builds and caches an execution
# plan per distinct shape, and a serving batch's key length changes every step: on an H200 in bfloat16
# (where SDPA prefers cuDNN) each call spent ~1.7 ms of CPU building one, 60 % of the engine's CPU
# time, which made one request at a time 2.5x slower in bfloat16 than in float32. Flash takes no mask
# and memory-efficient refuses unequal query / K-V head counts, so on CUDA the K/V heads are repeated
# and memory-efficient runs (math where it declines).
CUDA_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class AttentionMetadata:
    """Everything a layer needs to attend over the paged cache; built once per forward.

    `q_lens[s]` query tokens of sequence s (contiguous in the flat batch, in order) end at position
    `kv_lens[s] - 1`: this forward writes them and they are the newest keys of the sequence.
    """

    q_lens: list[int]
    kv_lens: list[int]
    positions: torch.Tensor  # [T] absolute positions of the query tokens
    slot_mapping: torch.Tensor  # [T] flat cache slot (page * page_size + offset) of each token
    page_tables: torch.Tensor  # [S, max_pages] int64, padded with 0
    page_size: int
    dllm_block_length: int | None  # None = causal
    # Derived, filled by the backend's `prepare` once per forward and reused by every layer.
    extra: dict | None = None
    # The page tables as host lists (unpadded), when the caller has them: `plan` reads these.
    page_table_lists: list[list[int]] | None = None
    # The backend's `plan` for this forward, and its arrays as device tensors (uploaded by the caller).
    plan: StepPlan | None = None
    planned: dict[str, torch.Tensor] | None = None


@dataclass
class StepPlan:
    """What a backend derives from a batch on the host: flat int arrays (uploaded with the step's
    other metadata) and host values (sizes, flags) that `prepare` needs without reading the device."""

    arrays: dict[str, list[int]] = field(default_factory=dict)
    scalars: dict[str, object] = field(default_factory=dict)


def planned(backend: AttentionBackend, meta: AttentionMetadata) -> dict[str, torch.Tensor]:
    """`meta.planned`, planning and uploading here (one copy per array) if the caller did not."""
    if meta.planned is None:
        tables = meta.page_table_lists
        if tables is None and backend.plans_from_page_tables:  # read back, each cut to its keys' pages
            tables = [row[: -(-kv // meta.page_size)]
                      for row, kv in zip(meta.page_tables.tolist(), meta.kv_lens, strict=True)]
        meta.plan = backend.plan(meta.q_lens, meta.kv_lens, tables or [], meta.page_size, meta.dllm_block_length)
        device = meta.positions.device
        meta.planned = {name: torch.tensor(values, dtype=torch.long, device=device)
                        for name, values in meta.plan.arrays.items()}
    return meta.planned


class AttentionBackend:
    """One way to attend over the paged cache. `prepare` derives what every layer of a forward shares
    (into `meta.extra`); `forward` writes this forward's K/V into the cache, then `attend`s."""

    name = "base"
    plans_from_page_tables = False  # whether `plan` reads the page tables

    def plan(self, q_lens: list[int], kv_lens: list[int], page_tables: list[list[int]], page_size: int,
             block_length: int | None) -> StepPlan:
        """Host-side metadata of a forward from the batch's lists alone (as `AttentionMetadata`'s fields;
        `page_tables` unpadded)."""
        return StepPlan()

    def prepare(self, meta: AttentionMetadata) -> None:
        raise NotImplementedError

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; caches: [pages, page_size, KVH, D]. Returns [T, H, D]."""
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta, scale)


class TorchAttention(AttentionBackend):
    """Reference backend: gather each sequence's keys into a padded tensor, masked SDPA.

    Sequences are grouped into a few buckets of similar (query length, key length), one SDPA call per
    bucket, because a padded call does max_q x max_kv work for every sequence in it: one bucket for a
    decode batch with one prefill chunk in it would pad every decode row to the chunk's length."""

    name = "torch"
    max_buckets = 4

    def prepare(self, meta: AttentionMetadata) -> None:
        starts = [0]
        for q_len in meta.q_lens:
            starts.append(starts[-1] + q_len)
        groups = _buckets(meta.q_lens, meta.kv_lens, self.max_buckets)
        meta.extra = {"buckets": [self._bucket(meta, seqs, starts, len(groups) == 1) for seqs in groups]}

    @staticmethod
    def _bucket(meta: AttentionMetadata, seqs: list[int], starts: list[int], only: bool) -> dict:
        device = meta.positions.device
        q_list = [meta.q_lens[s] for s in seqs]
        kv_list = [meta.kv_lens[s] for s in seqs]
        num_seqs, max_q, max_kv = len(seqs), max(q_list), max(kv_list)
        # this bucket's query rows in the flat batch; None = all of them, in order
        rows = None if only else torch.tensor([t for s in seqs for t in range(starts[s], starts[s + 1])],
                                              dtype=torch.long, device=device)
        # row of each of the bucket's query tokens in the padded [S * max_q] layout, built on the host:
        # one copy, no device sync to learn an output size
        padded_row = torch.tensor([i * max_q + r for i, n in enumerate(q_list) for r in range(n)],
                                  dtype=torch.long, device=device)
        kv_lens = torch.tensor(kv_list, dtype=torch.long, device=device)
        # padded key gather index: slot of key j of sequence s
        j = torch.arange(max_kv, device=device)
        tables = meta.page_tables if only else meta.page_tables[torch.tensor(seqs, device=device)]
        pages = tables[:, (j // meta.page_size).clamp(max=tables.shape[1] - 1)]
        key_slots = pages * meta.page_size + (j % meta.page_size)
        # key validity and mask [S, 1, max_q, max_kv]
        positions = meta.positions if rows is None else meta.positions[rows]
        q_pos = torch.full((num_seqs * max_q,), -1, dtype=torch.long, device=device)
        q_pos = q_pos.index_copy_(0, padded_row, positions).view(num_seqs, max_q)
        valid_key = j[None, :] < kv_lens[:, None]
        if meta.dllm_block_length is None:
            visible = j[None, None, :] <= q_pos[:, :, None]
        else:
            b = meta.dllm_block_length
            visible = (j // b)[None, None, :] <= (q_pos // b)[:, :, None]
        # padded query rows see key 0 alone, so softmax stays finite
        mask = torch.where((q_pos >= 0)[:, :, None], visible & valid_key[:, None, :], j == 0)
        return {
            "rows": rows,
            # row of each query token in the padded [S * max_q] layout; None = no padding
            # (every sequence feeds max_q tokens, e.g. AR decode or same-size DLLM blocks)
            "padded_row": None if min(q_list) == max_q else padded_row,
            "key_slots": key_slots.reshape(-1),  # index_select on a flat index: ~8x faster than 2-D indexing
            "mask": mask[:, None],
            "masks": {},  # additive float mask per dtype, made once per forward, not once per layer
            "shape": (num_seqs, max_q, max_kv),
        }

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        buckets = meta.extra["buckets"]
        if len(buckets) == 1:
            return _attend(q, k_cache, v_cache, buckets[0], scale)
        out = torch.empty_like(q)
        for bucket in buckets:
            rows = bucket["rows"]
            out.index_copy_(0, rows, _attend(q.index_select(0, rows), k_cache, v_cache, bucket, scale))
        return out


def _buckets(q_lens: list[int], kv_lens: list[int], max_buckets: int) -> list[list[int]]:
    """Sequences grouped so that padding each group to its longest query and key costs little: a
    sequence joins the group its padded box grows least, unless that costs more than half its own
    work again and a new group may still be opened. One group (in order) when nothing is gained."""
    n = len(q_lens)
    if n == 1 or (min(q_lens) == max(q_lens) and min(kv_lens) * 2 > max(kv_lens)):
        return [list(range(n))]
    groups: list[list] = []  # [members, max_q, max_kv]
    for s in sorted(range(n), key=lambda s: (q_lens[s] * kv_lens[s], s), reverse=True):
        q, kv = q_lens[s], kv_lens[s]
        best, best_extra = None, None
        for g in groups:
            mq, mkv = max(g[1], q), max(g[2], kv)
            extra = mq * mkv * (len(g[0]) + 1) - g[1] * g[2] * len(g[0])
            if best is None or extra < best_extra:
                best, best_extra = g, extra
        if best is None or (best_extra > 1.5 * q * kv and len(groups) < max_buckets):
            groups.append([[s], q, kv])
        else:
            best[0].append(s)
            best[1], best[2] = max(best[1], q), max(best[2], kv)
    if len(groups) == 1:
        return [list(range(n))]
    return [sorted(g[0]) for g in groups]


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bucket: dict,
            scale: float) -> torch.Tensor:
    """Padded, masked SDPA of one bucket: q [T_b, H, D] (its query rows) -> [T_b, H, D]."""
    num_seqs, max_q, max_kv = bucket["shape"]
    heads, kvh, d = q.shape[1], k_cache.shape[-2], k_cache.shape[-1]
    slots = bucket["key_slots"]
    keys = k_cache.view(-1, kvh, d).index_select(0, slots).view(num_seqs, max_kv, kvh, d)
    values = v_cache.view(-1, kvh, d).index_select(0, slots).view(num_seqs, max_kv, kvh, d)
    mask = bucket["masks"].get(q.dtype)
    if mask is None:  # SDPA would turn a bool mask into this in every layer
        mask = torch.zeros(bucket["mask"].shape, dtype=q.dtype, device=q.device)
        mask.masked_fill_(~bucket["mask"], float("-inf"))
        bucket["masks"][q.dtype] = mask
    padded_row = bucket["padded_row"]
    if padded_row is None:
        qp = q.reshape(num_seqs, max_q, heads, d)
    else:
        qp = q.new_zeros(num_seqs * max_q, heads, d).index_copy_(0, padded_row, q).view(num_seqs, max_q, heads, d)
    out = sdpa_gqa(qp.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), mask, scale)
    out = out.transpose(1, 2).reshape(num_seqs * max_q, heads, d)
    return out if padded_row is None else out.index_select(0, padded_row)


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA with grouped K/V heads: q [S, H, Q, D], k/v [S, KVH, K, D]; query head h reads K/V head
    h // (H // KVH), as FlashAttention and Hugging Face group them."""
    if SDPA_HAS_GQA and not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    with sdpa_kernel(CUDA_SDPA_BACKENDS) if q.is_cuda else nullcontext():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class FlashAttention(AttentionBackend):
    """The paged varlen FlashAttention kernel (CUDA; fp16/bf16; page size a multiple of 16)."""

    name = "flash"

    def __init__(self, kernel: FlashKernel):
        self.kernel = kernel

    def plan(self, q_lens: list[int], kv_lens: list[int], page_tables: list[list[int]], page_size: int,
             block_length: int | None) -> StepPlan:
        b = block_length
        entry_q, k_lens, tables, causal = [], [], [], b is None
        for s, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
            if causal:
                entry_q.append(q_len)
                k_lens.append(kv_len)
                tables.append(s)
                continue
            # one entry per DLLM block of queries, seeing keys up to that block's end
            pos = kv_len - q_len
            while pos < kv_len:
                block_end = min((pos // b + 1) * b, kv_len)
                entry_q.append(block_end - pos)
                k_lens.append(block_end)
                tables.append(s)
                pos = block_end
        key_lengths = k_lens if self.kernel.key_lengths == "seqused_k" else [0, *accumulate(k_lens)]
        return StepPlan(arrays={"cu_seqlens_q": [0, *accumulate(entry_q)], "key_lengths": key_lengths,
                                "table_rows": tables},
                        scalars={"max_seqlen_q": max(entry_q), "max_seqlen_k": max(k_lens), "causal": causal})

    def prepare(self, meta: AttentionMetadata) -> None:
        arrays = planned(self, meta)
        meta.extra = {
            "cu_seqlens_q": arrays["cu_seqlens_q"].to(torch.int32),
            self.kernel.key_lengths: arrays["key_lengths"].to(torch.int32),
            "block_table": meta.page_tables[arrays["table_rows"]].to(torch.int32),
            **meta.plan.scalars,
        }

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        return self.kernel.fn(q, k_cache, v_cache, softmax_scale=scale, **meta.extra)


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
    sequence's length). Padded rows of the last tile have limit 0 and see nothing."""

    name = "flex"
    plans_from_page_tables = True

    def __init__(self, compiled: bool, dynamic: bool = False):
        """`dynamic` (for serving): the query count and the BlockMask's width change every step, so one
        symbolic-shape compile instead of a recompile per new shape (past dynamo's recompile limit it
        would fall back to eager, which materialises query x cache scores). torch 2.13's CPU kernel
        fails to build with symbolic shapes, so the CPU test compiles static shapes."""
        self.compiled = compiled
        self.fn: Callable[..., torch.Tensor] = (torch.compile(flex_attention, fullgraph=True, dynamic=dynamic)
                                                 if compiled else flex_attention)
        self.fallback: TorchAttention | None = None  # serves instead once the compiled kernel failed

    def plan(self, q_lens: list[int], kv_lens: list[int], page_tables: list[list[int]], page_size: int,
             block_length: int | None) -> StepPlan:
        b, page, tables = block_length, page_size, page_tables
        q_seq: list[int] = []
        q_limit: list[int] = []
        for s, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
            q_seq += [s] * q_len
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


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Paged KV write: token t's K/V go to flat slot `slots[t]` (overwriting what was there)."""
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slots, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slots, v)


def flex_unmet(device: torch.device) -> list[str]:
    """Why compiled FlexAttention cannot serve here (eager FlexAttention runs anywhere, but it builds the
    full query x cache score matrix: a reference, not a serving path)."""
    unmet = []
    if device.type != "cuda":
        unmet.append(f"device is {device.type}; compiled FlexAttention serves on cuda (on the CPU torch is faster)")
    if importlib.util.find_spec("triton") is None:
        unmet.append("triton is not installed (torch.compile generates the FlexAttention kernel with it)")
    return unmet


def usable_flash_kernel(device: torch.device, dtype: torch.dtype, page_size: int, head_dim: int
                        ) -> tuple[FlashKernel | None, list[str]]:
    """The first of vllm's flash kernels and torch's own that can run these settings, or None and why
    none can (each reason once, prefixed by its kernel when there are two)."""
    kernels = [k for k in (flash_kernel.INSTALLED, flash_kernel.TORCH_KERNEL) if k is not None]
    if not kernels:
        return None, flash_unmet(None, device, dtype, page_size, head_dim)
    reasons = []
    for kernel in kernels:
        unmet = flash_unmet(kernel, device, dtype, page_size, head_dim)
        if not unmet:
            return kernel, []
        reasons += [f"{kernel.source}: {r}" if len(kernels) > 1 else r for r in unmet]
    return None, reasons


def make_attention_backend(name: str, device: torch.device, dtype: torch.dtype, page_size: int,
                           head_dim: int) -> AttentionBackend:
    """The backend for `EngineConfig.attention_backend`: `torch` always; `flash` when an installed
    kernel can run these settings, `flex` on any device (compiled where it can serve, eager
    elsewhere), else a ValueError naming every unmet condition; `auto` the fastest that can run --
    flash, then compiled flex, then torch -- logging which and why."""
    if name == "torch":
        return TorchAttention()
    if name == "flex":
        return FlexAttention(compiled=not flex_unmet(device), dynamic=True)
    kernel, unmet = usable_flash_kernel(device, dtype, page_size, head_dim)
    if name == "flash" and kernel is None:
        raise ValueError("attention_backend='flash' cannot run: " + "; ".join(unmet)
                         + ". Use attention_backend='torch' or 'auto'")
    if kernel is not None:
        log.info("attention backend: flash (%s, key lengths by %s)", kernel.source, kernel.key_lengths)
        return FlashAttention(kernel)
    flex_reasons = flex_unmet(device)
    if not flex_reasons:
        log.info("attention backend: flex, compiled (flash not used: %s)", "; ".join(unmet))
        return FlexAttention(compiled=True, dynamic=True)
    log.info("attention backend: torch (flash not used: %s; flex not used: %s)", "; ".join(unmet),
             "; ".join(flex_reasons))
    return TorchAttention()
