"""The reference backend: each sequence's keys gathered into a padded tensor, masked SDPA."""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ops.attention.base import AttentionBackend, AttentionMetadata

# `enable_gqa` arrived in torch 2.5; before it, K/V heads are repeated for SDPA instead.
SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)
# SDPA's CUDA implementations for a masked call, minus cuDNN's. cuDNN builds and caches an execution
# plan per distinct shape, and a serving batch's key length changes every step: on an H200 in bfloat16
# (where SDPA prefers cuDNN) each call spent ~1.7 ms of CPU building one, 60 % of the engine's CPU
# time, which made one request at a time 2.5x slower in bfloat16 than in float32. Flash takes no mask
# and memory-efficient refuses unequal query / K-V head counts, so on CUDA a K/V head's query heads go
# in as one head's rows (`sdpa_heads_folded`) and memory-efficient runs (math where it declines).
CUDA_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class TorchAttention(AttentionBackend):
    """Reference backend: gather each sequence's keys into a padded tensor, masked SDPA.

    Sequences are grouped into a few buckets of similar (query length, key length), one SDPA call per
    bucket, because a padded call does max_q x max_kv work for every sequence in it: one bucket for a
    decode batch with one prefill chunk in it would pad every decode row to the chunk's length."""

    name = "torch"
    max_buckets = 4

    def prepare(self, meta: AttentionMetadata) -> None:
        starts = [0, *accumulate(meta.q_lens)]
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
        if meta.bidirectional is not None and any(meta.bidirectional[s] for s in seqs):
            # a bidirectional sequence's rows see every key it holds
            sees_all = torch.tensor([meta.bidirectional[s] for s in seqs], device=device)
            visible = visible | sees_all[:, None, None]
        # padded query rows see key 0 alone, so softmax stays finite
        mask = torch.where((q_pos >= 0)[:, :, None], visible & valid_key[:, None, :], j == 0)
        return {
            "rows": rows,
            # row of each query token in the padded [S * max_q] layout; None = no padding
            # (every sequence feeds max_q tokens, e.g. AR decode or same-size DLLM blocks)
            "padded_row": None if min(q_list) == max_q else padded_row,
            "key_slots": key_slots.reshape(-1),  # index_select on a flat index: ~8x faster than 2-D indexing
            "mask": mask[:, None],
            "masks": {},  # SDPA's mask per (dtype, query heads per K/V head), made once per forward (_additive_mask)
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
    """Sequences grouped so that padding each group to its longest query and key costs little. The
    sequences of one (query, key) shape always share a group; a shape, largest first, joins the group
    its padded box grows least, unless that costs more than half the shape's own work again and a new
    group may still be opened. One group (in order) when nothing is gained.

    The greedy runs per distinct shape, not per sequence: sequences of one query and key length (a batch
    admitted together, one prompt length) are placed once, and only the last pass, which hands each
    sequence its group, walks the sequences. Where contexts differ, most sequences are a shape of their
    own, so the greedy's loop makes no function calls per shape."""
    n = len(q_lens)
    if n == 1 or (min(q_lens) == max(q_lens) and min(kv_lens) * 2 > max(kv_lens)):
        return [list(range(n))]
    # largest work first (ties: the larger shape)
    shapes = sorted([(q * kv, q, kv, count) for (q, kv), count in Counter(zip(q_lens, kv_lens)).items()],
                    reverse=True)
    groups: list[list] = []  # [shapes, max_q, max_kv, sequences]
    for work, q, kv, count in shapes:
        best, best_extra = None, None
        for g in groups:
            gq, gkv = g[1], g[2]
            extra = (q if q > gq else gq) * (kv if kv > gkv else gkv) * (g[3] + count) - gq * gkv * g[3]
            if best is None or extra < best_extra:
                best, best_extra = g, extra
        if best is None or (best_extra > 1.5 * work * count and len(groups) < max_buckets):
            groups.append([[(q, kv)], q, kv, count])
        else:
            best[0].append((q, kv))
            if q > best[1]:
                best[1] = q
            if kv > best[2]:
                best[2] = kv
            best[3] += count
    if len(groups) == 1:
        return [list(range(n))]
    group_of = {shape: i for i, g in enumerate(groups) for shape in g[0]}
    of_seq = list(map(group_of.__getitem__, zip(q_lens, kv_lens)))
    return [[s for s, i in enumerate(of_seq) if i == k] for k in range(len(groups))]


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bucket: dict,
            scale: float) -> torch.Tensor:
    """Padded, masked SDPA of one bucket: q [T_b, H, D] (its query rows) -> [T_b, H, D]."""
    num_seqs, max_q, max_kv = bucket["shape"]
    heads, kvh, d = q.shape[1], k_cache.shape[-2], k_cache.shape[-1]
    slots = bucket["key_slots"]
    keys = k_cache.view(-1, kvh, d).index_select(0, slots).view(num_seqs, max_kv, kvh, d)
    values = v_cache.view(-1, kvh, d).index_select(0, slots).view(num_seqs, max_kv, kvh, d)
    padded_row = bucket["padded_row"]
    if padded_row is None:
        qp = q.reshape(num_seqs, max_q, heads, d)
    else:
        qp = q.new_zeros(num_seqs * max_q, heads, d).index_copy_(0, padded_row, q).view(num_seqs, max_q, heads, d)
    q, k, v = qp.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
    if SDPA_HAS_GQA and not q.is_cuda:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=_additive_mask(bucket, q.dtype, 1), scale=scale,
                                             enable_gqa=True)
    else:
        out = sdpa_heads_folded(q, k, v, _additive_mask(bucket, q.dtype, heads // kvh), scale)
    out = out.transpose(1, 2).reshape(num_seqs * max_q, heads, d)
    return out if padded_row is None else out.index_select(0, padded_row)


def _additive_mask(bucket: dict, dtype: torch.dtype, group: int) -> torch.Tensor:
    """The bucket's mask as SDPA takes it, made once per forward and kept for every layer: additive (SDPA
    would convert a bool mask in every call), its rows tiled `group` times for `sdpa_heads_folded`, and
    on CUDA its rows' stride a multiple of 16 elements (the memory-efficient kernel copies a mask whose
    strides are not aligned, in every call)."""
    mask = bucket["masks"].get((dtype, group))
    if mask is None:
        visible = bucket["mask"]  # [S, 1, Q, K] bool
        num_seqs, _, max_q, max_kv = visible.shape
        aligned = -(-max_kv // 16) * 16 if visible.is_cuda else max_kv
        mask = torch.zeros(num_seqs, 1, group, max_q, aligned, dtype=dtype, device=visible.device)[..., :max_kv]
        mask.masked_fill_(~visible[:, :, None], float("-inf"))
        mask = mask.view(num_seqs, 1, group * max_q, max_kv)
        bucket["masks"][(dtype, group)] = mask
    return mask


def sdpa_heads_folded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """SDPA with grouped K/V heads, no K/V copied: q [S, H, Q, D], k/v [S, KVH, K, D], `mask` [S, 1, G*Q, K]
    with G = H // KVH (the Q-row mask tiled G times) -> [S, H, Q, D]. Query head h reads K/V head h // G,
    as FlashAttention and Hugging Face group them: the G query heads of one K/V head go in as that head's
    G*Q query rows (row g*Q + i is query i of head kvh*G + g), so each K/V head is read in place instead of
    repeated G times (on an H200 the repeat was the largest part of the step's device time). Each row's
    result is the same SDPA row either way. On CUDA the memory-efficient kernel runs (math where it
    declines): cuDNN builds a plan per shape and a serving batch's shape changes every step."""
    num_seqs, heads, q_len, d = q.shape
    kvh = k.shape[1]
    folded = q.reshape(num_seqs, kvh, heads // kvh * q_len, d)
    with sdpa_kernel(CUDA_SDPA_BACKENDS) if q.is_cuda else nullcontext():
        out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, heads, q_len, d)  # a copy only where the kernel wrote another layout
