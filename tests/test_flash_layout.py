"""The flash backend's varlen layout, checked on CPU.

The CUDA kernel cannot run here. What can be checked is the part we own: how `FlashAttention`
turns a mixed batch into varlen entries (causal sequences; one non-causal entry per DLLM block of
queries seeing keys up to its block end) and page tables. We run that layout through a plain-torch
implementation of `flash_attn_varlen_func`'s documented semantics (paged K/V via block_table,
per-entry key lengths from cu_seqlens_k, causal aligned bottom-right) and require the same output
as the reference `TorchAttention` backend.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ops.attention as attention
from ops.attention import AttentionMetadata, FlashAttention, TorchAttention


def varlen_paged_semantics(q, k_cache, v_cache, *, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k,
                           softmax_scale, causal, block_table):
    page = k_cache.shape[1]
    out = torch.empty_like(q)
    for e in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[e]), int(cu_seqlens_q[e + 1])
        k_len = int(cu_seqlens_k[e + 1] - cu_seqlens_k[e])
        slots = torch.tensor([int(block_table[e, j // page]) * page + j % page for j in range(k_len)])
        keys = k_cache.flatten(0, 1)[slots]
        values = v_cache.flatten(0, 1)[slots]
        n_q = qe - qs
        mask = torch.ones(n_q, k_len, dtype=torch.bool)
        if causal:  # bottom-right aligned: query r sees keys <= k_len - n_q + r
            mask = torch.arange(k_len)[None, :] <= (k_len - n_q + torch.arange(n_q))[:, None]
        o = F.scaled_dot_product_attention(q[qs:qe].transpose(0, 1), keys.transpose(0, 1),
                                           values.transpose(0, 1), attn_mask=mask, scale=softmax_scale,
                                           enable_gqa=True)
        out[qs:qe] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("block_length", [None, 4])
def test_flash_layout_matches_reference(monkeypatch, block_length):
    monkeypatch.setattr(attention, "flash_attn_varlen_func", varlen_paged_semantics)
    torch.manual_seed(0)
    page, heads, kv_heads, dim = 4, 4, 2, 8
    # (tokens already cached, tokens fed now): a prefill, a chunk mid-sequence, a decode-sized row,
    # and (DLLM) a fused commit + next block of 2B tokens
    shapes = [(0, 12), (8, 8), (12, 4), (16, 8)] if block_length else [(0, 9), (5, 6), (11, 1), (3, 1)]
    num_pages = 40
    perm = torch.randperm(num_pages).tolist()
    tables, slots, positions, q_lens, kv_lens = [], [], [], [], []
    for cached, fed in shapes:
        n_pages = -(-(cached + fed) // page)
        table = [perm.pop() for _ in range(n_pages)]
        tables.append(table + [0] * (6 - n_pages))
        positions += range(cached, cached + fed)
        slots += [table[p // page] * page + p % page for p in range(cached, cached + fed)]
        q_lens.append(fed)
        kv_lens.append(cached + fed)
    total = sum(q_lens)
    q = torch.randn(total, heads, dim)
    k = torch.randn(total, kv_heads, dim)
    v = torch.randn(total, kv_heads, dim)
    cache = torch.randn(2, num_pages, page, kv_heads, dim)

    def run(backend):
        meta = AttentionMetadata(q_lens=q_lens, kv_lens=kv_lens, positions=torch.tensor(positions),
                                 slot_mapping=torch.tensor(slots), page_tables=torch.tensor(tables),
                                 page_size=page, dllm_block_length=block_length)
        kc, vc = cache[0].clone(), cache[1].clone()
        backend.prepare(meta)
        return backend.forward(q, k, v, kc, vc, meta, dim**-0.5)

    torch.testing.assert_close(run(FlashAttention()), run(TorchAttention()), rtol=1e-5, atol=1e-5)
