"""Paged KV write and paged attention over variable-length batches.

A batch is a flat list of query tokens from several sequences (prefill chunks, DLLM blocks and AR
decode rows mixed). Each sequence's keys live in fixed-size pages of the KV cache, named by its
page table. Two masks exist:

* causal (AR): query at position p sees keys at positions <= p;
* block-causal (DLLM, block length B): query at p sees keys at positions j with j // B <= p // B.

Backends:

* `TorchAttention` -- the reference: gathers each sequence's keys into a padded tensor and runs
  `scaled_dot_product_attention` with an explicit mask. Runs everywhere.
* `FlashAttention` -- vllm-flash-attn's `flash_attn_varlen_func` reading the paged cache through
  `block_table`. Block-causal attention is expressed without a custom mask: every DLLM block of
  queries becomes its own varlen entry that sees keys up to its block end, non-causally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _import_flash():
    try:  # the kernels current vllm ships
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func
    except ImportError:
        pass
    try:  # the standalone vllm-flash-attn wheel
        from vllm_flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func
    except ImportError:
        return None


flash_attn_varlen_func = _import_flash()


def flash_available() -> bool:
    return flash_attn_varlen_func is not None and torch.cuda.is_available()


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


class AttentionBackend:
    """One way to attend over the paged cache. `prepare` derives what every layer of a forward shares
    (into `meta.extra`); `forward` writes this forward's K/V into the cache, then `attend`s."""

    name = "base"

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
        q_lens = torch.tensor(q_list, device=device)
        kv_lens = torch.tensor(kv_list, device=device)
        # bucket query index -> (seq, row) in the padded layout
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)
        first = torch.cumsum(q_lens, 0) - q_lens
        row_of_token = torch.arange(len(seq_of_token), device=device) - first[seq_of_token]
        # padded key gather index: slot of key j of sequence s
        j = torch.arange(max_kv, device=device)
        tables = meta.page_tables if only else meta.page_tables[torch.tensor(seqs, device=device)]
        pages = tables[:, (j // meta.page_size).clamp(max=tables.shape[1] - 1)]
        key_slots = pages * meta.page_size + (j % meta.page_size)
        # key validity and mask [S, 1, max_q, max_kv]
        positions = meta.positions if rows is None else meta.positions[rows]
        q_pos = torch.full((num_seqs, max_q), -1, dtype=torch.long, device=device)
        q_pos[seq_of_token, row_of_token] = positions
        valid_key = j[None, :] < kv_lens[:, None]
        if meta.dllm_block_length is None:
            visible = j[None, None, :] <= q_pos[:, :, None]
        else:
            b = meta.dllm_block_length
            visible = (j // b)[None, None, :] <= (q_pos // b)[:, :, None]
        mask = visible & valid_key[:, None, :]
        mask[q_pos < 0] = False
        mask[..., 0] |= q_pos < 0  # padded query rows see one key, so softmax stays finite
        return {
            "rows": rows,
            # row of each query token in the padded [S * max_q] layout; None = no padding
            # (every sequence feeds max_q tokens, e.g. AR decode or same-size DLLM blocks)
            "padded_row": None if min(q_list) == max_q else seq_of_token * max_q + row_of_token,
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
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    out = out.transpose(1, 2).reshape(num_seqs * max_q, heads, d)
    return out if padded_row is None else out.index_select(0, padded_row)


class FlashAttention(AttentionBackend):
    """vllm-flash-attn over the paged cache (CUDA only; needs page_size a multiple of 16)."""

    name = "flash"

    def prepare(self, meta: AttentionMetadata) -> None:
        device = meta.positions.device
        b = meta.dllm_block_length
        q_lens, k_lens, tables, causal = [], [], [], b is None
        for s, (q_len, kv_len) in enumerate(zip(meta.q_lens, meta.kv_lens)):
            if causal:
                q_lens.append(q_len)
                k_lens.append(kv_len)
                tables.append(s)
                continue
            # one entry per DLLM block of queries, seeing keys up to that block's end
            first = kv_len - q_len
            pos = first
            while pos < kv_len:
                block_end = min((pos // b + 1) * b, kv_len)
                q_lens.append(block_end - pos)
                k_lens.append(block_end)
                tables.append(s)
                pos = block_end
        meta.extra = {
            "cu_seqlens_q": _cumulative(q_lens, device),
            # with block_table, cu_seqlens_k only carries per-entry key lengths (both the standalone
            # vllm-flash-attn 2.6 wheel and vllm's bundled kernels accept it)
            "cu_seqlens_k": _cumulative(k_lens, device),
            "block_table": meta.page_tables[torch.tensor(tables, device=device)].to(torch.int32),
            "max_seqlen_q": max(q_lens),
            "max_seqlen_k": max(k_lens),
            "causal": causal,
        }

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        ex = meta.extra
        return flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            max_seqlen_q=ex["max_seqlen_q"],
            cu_seqlens_q=ex["cu_seqlens_q"],
            max_seqlen_k=ex["max_seqlen_k"],
            cu_seqlens_k=ex["cu_seqlens_k"],
            softmax_scale=scale,
            causal=ex["causal"],
            block_table=ex["block_table"],
        )


def _cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    out[1:] = torch.cumsum(torch.tensor(lengths, device=device), 0)
    return out


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Paged KV write: token t's K/V go to flat slot `slots[t]` (overwriting what was there)."""
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slots, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slots, v)


def make_attention_backend(name: str, device: torch.device) -> TorchAttention | FlashAttention:
    """`auto` picks flash on CUDA when vllm-flash-attn imports, else the torch reference."""
    if name == "flash":
        if not flash_available():
            raise ValueError(
                "attention_backend='flash' needs CUDA and vllm-flash-attn "
                "(pip install 'blockserve[cuda]'); use 'torch' or 'auto'"
            )
        return FlashAttention()
    if name == "auto" and device.type == "cuda" and flash_available():
        return FlashAttention()
    return TorchAttention()
