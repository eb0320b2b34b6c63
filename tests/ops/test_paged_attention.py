"""Paged KV write and the reference paged attention (`ops.attention.TorchAttention`) against dense
SDPA, per sequence, with causal, block-causal and bidirectional rows, random page tables and GQA;
bidirectional rows beside causal ones also through the flex and triton backends, and the flash plan."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import ops.attention as attention
from ops.attention import AttentionMetadata, TorchAttention, write_kv

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8

# (q_len, kv_len) per sequence: full prefills, decode rows (q_len 1), prefill chunks that start
# mid-sequence (q_len < kv_len), and one short sequence inside a single page.
MIXES = [
    [(11, 11), (1, 9), (5, 13), (1, 1)],
    [(1, 30), (16, 16), (7, 23), (1, 4), (3, 8)],
    [(8, 24), (1, 17), (24, 24)],
]


def dense_reference(q, keys, values, first_pos, block_length, bidirectional=False):
    """SDPA over one sequence: q [Q, H, D] at positions first_pos.., keys/values [L, KVH, D]
    (`bidirectional`: every row sees every key)."""
    q_len, kv_len = q.shape[0], keys.shape[0]
    p = torch.arange(first_pos, first_pos + q_len)[:, None]
    j = torch.arange(kv_len)[None, :]
    visible = j <= p if block_length is None else (j // block_length) <= (p // block_length)
    visible = visible | bidirectional
    group = HEADS // KV_HEADS
    k = keys.repeat_interleave(group, dim=1)  # GQA: query head h reads kv head h // group
    v = values.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=visible, scale=HEAD_DIM**-0.5)
    return out.transpose(0, 1)


def run_case(mix, page_size, block_length, seed, bidirectional=None, backend=None):
    """`bidirectional`: per sequence whether its rows see all of its keys; `backend`: TorchAttention's
    stand-in (the reference by default)."""
    g = torch.Generator().manual_seed(seed)
    pages_per_seq = [math.ceil(kv / page_size) for _, kv in mix]
    num_pages = sum(pages_per_seq) + 5  # a few pages nobody owns
    # every page holds finite garbage first: anything read by mistake changes the result
    k_cache = torch.randn(num_pages, page_size, KV_HEADS, HEAD_DIM, generator=g) * 30
    v_cache = torch.randn(num_pages, page_size, KV_HEADS, HEAD_DIM, generator=g) * 30
    order = torch.randperm(num_pages, generator=g).tolist()  # shuffled page ids
    tables, at = [], 0
    for n in pages_per_seq:
        tables.append(order[at : at + n])
        at += n

    qs, ks, vs, positions, slots, full_k, full_v = [], [], [], [], [], [], []
    for (q_len, kv_len), table in zip(mix, tables, strict=True):
        keys = torch.randn(kv_len, KV_HEADS, HEAD_DIM, generator=g)
        values = torch.randn(kv_len, KV_HEADS, HEAD_DIM, generator=g)
        full_k.append(keys)
        full_v.append(values)
        first = kv_len - q_len
        # the earlier keys are already in the cache (written by earlier forwards)
        for pos in range(first):
            k_cache[table[pos // page_size], pos % page_size] = keys[pos]
            v_cache[table[pos // page_size], pos % page_size] = values[pos]
        qs.append(torch.randn(q_len, HEADS, HEAD_DIM, generator=g))
        ks.append(keys[first:])
        vs.append(values[first:])
        positions += range(first, kv_len)
        slots += [table[pos // page_size] * page_size + pos % page_size for pos in range(first, kv_len)]

    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        q_lens=[q for q, _ in mix],
        kv_lens=[kv for _, kv in mix],
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        page_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        page_size=page_size,
        dllm_block_length=block_length,
        bidirectional=bidirectional,
    )
    before = (k_cache.clone(), v_cache.clone())
    backend = backend or TorchAttention()
    backend.prepare(meta)
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, HEAD_DIM**-0.5)
    assert out.shape == (sum(q for q, _ in mix), HEADS, HEAD_DIM)

    row = 0
    for s, ((q_len, kv_len), q) in enumerate(zip(mix, qs, strict=True)):
        want = dense_reference(q, full_k[s], full_v[s], kv_len - q_len, block_length,
                               bidirectional is not None and bidirectional[s])
        torch.testing.assert_close(out[row : row + q_len], want, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, s=s: f"sequence {s}: {m}")
        row += q_len
    return k_cache, v_cache, before, meta.slot_mapping, tables, full_k, full_v


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("mix", MIXES, ids=["mix0", "mix1", "mix2"])
def test_causal_equals_dense_sdpa(mix, page_size, seed):
    run_case(mix, page_size, None, seed)


# Block-causal (DLLM): query p sees key j iff j // B <= p // B. A DLLM forward feeds whole blocks
# ending on a block boundary; MIXES_DLLM does that (kv_len a multiple of B) plus decode-like rows.
MIXES_DLLM = [
    [(8, 8), (8, 16), (4, 24), (16, 32)],
    [(24, 24), (8, 40), (8, 8)],
]


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("page_size", [4, 8, 16])
@pytest.mark.parametrize("block_length", [4, 8])
@pytest.mark.parametrize("mix", MIXES_DLLM, ids=["dllm0", "dllm1"])
def test_block_causal_equals_dense_sdpa(mix, block_length, page_size, seed):
    run_case(mix, page_size, block_length, seed)


@pytest.mark.parametrize("block_length", [4, 8])
def test_block_causal_queries_see_later_keys_of_their_block(block_length):
    """A query at the start of a block must see the whole block (the mask is not causal inside it):
    changing the block's last key changes the first query's output; the next block's keys do not."""
    b = block_length
    g = torch.Generator().manual_seed(7)
    page_size = 4
    kv_len = 2 * b
    num_pages = kv_len // page_size
    q = torch.randn(kv_len, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(kv_len, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(kv_len, KV_HEADS, HEAD_DIM, generator=g)

    def attend(k, v):
        meta = AttentionMetadata(q_lens=[kv_len], kv_lens=[kv_len], positions=torch.arange(kv_len),
                                 slot_mapping=torch.arange(kv_len), page_tables=torch.arange(num_pages)[None],
                                 page_size=page_size, dllm_block_length=b)
        backend = TorchAttention()
        backend.prepare(meta)
        caches = [torch.zeros(num_pages, page_size, KV_HEADS, HEAD_DIM) for _ in range(2)]
        return backend.forward(q, k, v, *caches, meta, HEAD_DIM**-0.5)

    base = attend(k, v)
    v2 = v.clone()
    v2[b - 1] += 5.0  # last key of block 0
    changed = attend(k, v2)
    assert not torch.allclose(base[0], changed[0]), "query 0 must see key B-1 (same block)"
    v3 = v.clone()
    v3[b] += 5.0  # first key of block 1
    later = attend(k, v3)
    torch.testing.assert_close(base[:b], later[:b])  # block 0 never sees block 1
    assert not torch.allclose(base[b:], later[b:])


# per sequence of each mix: its rows bidirectional (a block denoised over its prefix) or causal
BIDIRECTIONAL_MIXES = [
    ([(8, 8), (1, 9), (8, 20), (5, 13), (1, 1)], [True, False, True, False, True]),
    ([(32, 45), (3, 3), (16, 16)], [True, False, False]),
]


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("backend", ["torch", "flex", "triton"])
@pytest.mark.parametrize(("mix", "bidirectional"), BIDIRECTIONAL_MIXES, ids=["bidirectional0", "bidirectional1"])
def test_bidirectional_rows_beside_causal_ones_equal_dense_sdpa(mix, bidirectional, backend, page_size, seed):
    """A bidirectional sequence's rows see every key below its kv_len; the others stay causal (the Triton
    kernel, under its interpreter here: its pass mode, canvas tiles reading all their keys from the cache)."""
    chosen = {"torch": TorchAttention, "flex": lambda: attention.FlexAttention(compiled=False),
              "triton": lambda: attention.TritonAttention(HEADS // KV_HEADS)}[backend]()
    run_case(mix, page_size, None, seed, bidirectional, chosen)


def test_triton_plans_pass_kinds_padded_and_refuses_block_causal_rows_beside_bidirectional_ones():
    backend = attention.TritonAttention(HEADS // KV_HEADS)
    plan = {name: list(values) for name, values in
            backend.plan([8, 1], [8, 9], [[0, 1], [2, 3]], 4, None, 16, [True, False]).arrays.items()}
    assert len(plan["tile_kind"]) == 16 and plan["tile_kind"][:2] == [1, 0] and plan["tile_rows"][2:] == [0] * 14
    assert plan["tile_lo"] == plan["tile_own_len"] == [0] * 16
    with pytest.raises(ValueError, match="block-causal"):
        backend.plan([8, 1], [8, 9], [[0, 1], [2, 3]], 4, 4, None, [True, False])


def test_flash_plans_bidirectional_rows_as_one_entry_and_causal_rows_alone():
    """The flash kernel takes one causal flag per call: beside a bidirectional sequence every causal row
    is an entry of its own, seeing the keys up to its position."""
    kernel = type("Kernel", (), {"key_lengths": "seqused_k"})()
    plan = attention.FlashAttention(kernel).plan([3, 4, 1], [5, 12, 7], [[0], [1], [2]], 16, None, None,
                                                 [False, True, False])
    assert plan.scalars["causal"] is False
    assert plan.arrays["cu_seqlens_q"] == [0, 1, 2, 3, 7, 8]
    assert plan.arrays["key_lengths"] == [3, 4, 5, 12, 7] and plan.arrays["table_rows"] == [0, 0, 0, 1, 2]
    causal = attention.FlashAttention(kernel).plan([3, 1], [5, 7], [[0], [2]], 16, None, None, [False, False])
    assert causal.scalars["causal"] is True and causal.arrays["cu_seqlens_q"] == [0, 3, 4]


def test_decode_rows_in_block_causal_batch_match_dense():
    """Rows of one token (e.g. a block of one masked position) at arbitrary positions."""
    run_case([(1, 5), (1, 12), (2, 14), (6, 6)], 4, 4, seed=11)


# A denoising step of many sequences: a few shapes, each shared by several sequences in no order (blocks
# with and without the previous block's commit, at two key lengths), and one long prefill chunk.
STEP_OF_SHAPES = [(4, 24), (8, 24), (4, 40), (8, 24), (4, 24), (4, 40), (32, 32), (8, 24), (4, 24), (4, 40)]


def test_a_step_of_repeated_shapes_is_bucketed_by_shape_and_equals_dense():
    """The reference backend pads each bucket to its longest query and key: a shape's sequences share a
    bucket, every sequence is in exactly one (in order within it), at most `max_buckets` of them, and the
    long prefill does not pad the decoding rows to its length."""
    q_lens, kv_lens = [q for q, _ in STEP_OF_SHAPES], [kv for _, kv in STEP_OF_SHAPES]
    groups = attention.torch_reference._buckets(q_lens, kv_lens, TorchAttention.max_buckets)
    assert sorted(s for g in groups for s in g) == list(range(len(STEP_OF_SHAPES)))
    assert all(g == sorted(g) for g in groups) and 1 < len(groups) <= TorchAttention.max_buckets
    bucket_of = {STEP_OF_SHAPES[s]: i for i, g in enumerate(groups) for s in g}
    assert all(bucket_of[STEP_OF_SHAPES[s]] == i for i, g in enumerate(groups) for s in g)  # shapes whole
    assert [s for g in groups if 6 in g for s in g] == [6]  # the prefill alone
    for seed in range(2):
        run_case(STEP_OF_SHAPES, 8, 4, seed)


def test_gqa_heads_read_their_own_kv_head():
    """Query heads 0,1 read kv head 0; heads 2,3 read kv head 1 (Qwen3 / HF grouping)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(3, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.zeros(3, KV_HEADS, HEAD_DIM)
    v[:, 0] = 1.0
    v[:, 1] = -1.0
    meta = AttentionMetadata(q_lens=[3], kv_lens=[3], positions=torch.arange(3), slot_mapping=torch.arange(3),
                             page_tables=torch.tensor([[0]]), page_size=4, dllm_block_length=None)
    backend = TorchAttention()
    backend.prepare(meta)
    caches = [torch.zeros(1, 4, KV_HEADS, HEAD_DIM) for _ in range(2)]
    out = backend.forward(q, k, v, *caches, meta, HEAD_DIM**-0.5)
    torch.testing.assert_close(out[:, :2], torch.ones(3, 2, HEAD_DIM))
    torch.testing.assert_close(out[:, 2:], -torch.ones(3, 2, HEAD_DIM))


def test_write_kv_writes_exactly_the_given_slots():
    g = torch.Generator().manual_seed(5)
    num_pages, page_size = 6, 4
    k_cache = torch.randn(num_pages, page_size, KV_HEADS, HEAD_DIM, generator=g)
    v_cache = torch.randn(num_pages, page_size, KV_HEADS, HEAD_DIM, generator=g)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([17, 2, 23, 8, 9, 0])  # scattered over pages 4, 0, 5, 2, 2, 0
    k = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=g)
    write_kv(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, KV_HEADS, HEAD_DIM), v_cache.view(-1, KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(flat_k[slots], k, rtol=0, atol=0)
    torch.testing.assert_close(flat_v[slots], v, rtol=0, atol=0)
    untouched = torch.ones(num_pages * page_size, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_k[untouched], k_before.view(-1, KV_HEADS, HEAD_DIM)[untouched])
    assert torch.equal(flat_v[untouched], v_before.view(-1, KV_HEADS, HEAD_DIM)[untouched])


def test_forward_writes_new_kv_into_the_cache_and_nothing_else():
    """TorchAttention.forward writes this forward's K/V at slot_mapping (the paged KV write)."""
    mix = [(5, 13), (1, 9)]
    page_size = 4
    k_cache, v_cache, (k_before, v_before), slots, tables, full_k, full_v = run_case(mix, page_size, None, seed=21)
    for (_, kv_len), table, keys, values in zip(mix, tables, full_k, full_v, strict=True):
        for pos in range(kv_len):
            torch.testing.assert_close(k_cache[table[pos // page_size], pos % page_size], keys[pos])
            torch.testing.assert_close(v_cache[table[pos // page_size], pos % page_size], values[pos])
    untouched = torch.ones(k_cache.shape[0] * page_size, dtype=torch.bool)
    untouched[slots] = False
    for cache, before in ((k_cache, k_before), (v_cache, v_before)):
        flat, flat_before = cache.view(-1, KV_HEADS, HEAD_DIM), before.view(-1, KV_HEADS, HEAD_DIM)
        assert torch.equal(flat[untouched], flat_before[untouched])


@pytest.mark.parametrize("mix, block_length", [(MIXES[1], None), (MIXES_DLLM[0], 4)])
def test_query_heads_folded_instead_of_enable_gqa_give_the_same_result(monkeypatch, mix, block_length):
    """The path that folds each K/V head's query heads into one head's rows instead of passing
    `enable_gqa` (`sdpa_heads_folded`): torch < 2.5 has no `enable_gqa` (the vllm-flash-attn 2.6 wheel
    pins torch 2.4), and on CUDA a masked GQA call would leave SDPA only cuDNN or math, so the reference
    backend folds the heads there too. SDPA sees as many query heads as K/V heads."""
    sdpa = F.scaled_dot_product_attention

    def sdpa_torch_2_4(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        assert q.shape[-3] == k.shape[-3], "torch 2.4 SDPA needs as many K/V heads as query heads"
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)

    monkeypatch.setattr(attention.torch_reference, "SDPA_HAS_GQA", False)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa_torch_2_4)
    run_case(mix, 4, block_length, seed=5)
