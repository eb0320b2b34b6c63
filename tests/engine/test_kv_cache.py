"""Paged KV block manager (free list, page tables, prefix caching by hash chain, refcounts, LRU
eviction, DLLM key extension) and its effect at engine level."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, GenerationConfig, pipeline
from engine.kv.page_manager import KVPageManager, PageTable

# ---- unit: KVPageManager ---------------------------------------------------------------------


def toks(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def filled(kv: KVPageManager, tokens: list[int], committed: int | None = None) -> PageTable:
    """A sequence whose pages hold `tokens` and whose first `committed` tokens are final."""
    table = PageTable()
    assert kv.allocate(table, len(tokens))
    kv.register(table, tokens, len(tokens) if committed is None else committed)
    return table


def test_free_list_accounting():
    kv = KVPageManager(num_pages=8, page_size=4, enable_prefix_caching=False)
    assert kv.num_free_pages == 8
    a = PageTable()
    assert kv.pages_needed(a, 9) == 3
    assert kv.allocate(a, 9) and len(a.pages) == 3
    assert kv.num_free_pages == 5
    assert kv.allocate(a, 12) and len(a.pages) == 3  # still fits in 3 pages
    assert kv.allocate(a, 13) and len(a.pages) == 4
    b = PageTable()
    assert not kv.allocate(b, 17), "5 pages needed, 4 free: must refuse"
    assert b.pages == [] and kv.num_free_pages == 4, "a refused allocation takes nothing"
    assert kv.allocate(b, 16)
    assert kv.num_free_pages == 0
    assert len(set(a.pages) | set(b.pages)) == 8, "pages are never handed out twice"
    kv.free(a)
    assert a.pages == [] and kv.num_free_pages == 4
    kv.free(b)
    assert kv.num_free_pages == 8


def test_every_lookup_counts_its_queried_tokens_so_hits_never_exceed_them():
    """A preempted sequence looks its tokens up again (and finds more of them: its committed output
    too): the lookups' queried tokens count each time, so the hit rate stays a rate; a lookup undone
    (the sequence was not admitted after all) counts neither."""
    kv = KVPageManager(num_pages=16, page_size=4, enable_prefix_caching=True)
    prompt = toks(14)
    a = filled(kv, prompt)
    for _ in range(3):  # admitted, preempted, admitted again ...
        b = PageTable()
        kv.match_prefix(b, prompt, max_tokens=13)
        kv.free(b)
    assert (kv.prefix_hit_tokens, kv.prefix_query_tokens) == (36, 39)
    c = PageTable()
    kv.undo_match(c, kv.match_prefix(c, prompt, max_tokens=13), 13)
    assert (kv.prefix_hit_tokens, kv.prefix_query_tokens) == (36, 39)
    kv.free(a)


def test_prefix_hit_and_refcount_sharing():
    kv = KVPageManager(num_pages=16, page_size=4, enable_prefix_caching=True)
    prompt = toks(14)
    a = filled(kv, prompt)
    assert a.registered == 3, "only full pages are registered (14 tokens = 3 full pages + 2)"
    free_before = kv.num_free_pages
    b = PageTable()
    reused = kv.match_prefix(b, prompt, max_tokens=13)
    assert reused == 12 and b.pages == a.pages[:3]
    assert kv.prefix_hit_tokens == 12
    assert kv.num_free_pages == free_before, "shared pages are not taken from the free list"
    # the sharer keeps the pages alive after the owner frees
    kv.free(a)
    assert kv.num_free_pages == 16 - 3
    kv.free(b)
    assert kv.num_free_pages == 16, "unreferenced cached pages count as free"
    # max_tokens caps the reuse at whole pages
    c = PageTable()
    assert kv.match_prefix(c, prompt, max_tokens=7) == 4
    kv.free(c)


def test_hash_chain_miss_on_different_earlier_page():
    kv = KVPageManager(num_pages=16, page_size=4, enable_prefix_caching=True)
    a_tokens = toks(8)
    filled(kv, a_tokens)
    # same second page, different first page: the chain makes the second page a miss too
    other = [100, 101, 102, 103] + a_tokens[4:]
    t = PageTable()
    assert kv.match_prefix(t, other, max_tokens=8) == 0 and t.pages == []
    # same first page, different second: one page hit
    t2 = PageTable()
    assert kv.match_prefix(t2, a_tokens[:4] + [200, 201, 202, 203], max_tokens=8) == 4
    assert len(t2.pages) == 1
    kv.free(t2)


def test_register_only_committed_pages():
    kv = KVPageManager(num_pages=8, page_size=4, enable_prefix_caching=True)
    tokens = toks(12)
    a = filled(kv, tokens, committed=5)
    assert a.registered == 1, "tokens 4..7 are not committed yet: page 1 must not be published"
    probe = PageTable()
    assert kv.match_prefix(probe, tokens, max_tokens=12) == 4
    kv.free(probe)
    kv.register(a, tokens, 12)
    assert a.registered == 3
    probe = PageTable()
    assert kv.match_prefix(probe, tokens, max_tokens=12) == 12
    kv.free(probe)


def test_disabled_prefix_cache_never_hits():
    kv = KVPageManager(num_pages=8, page_size=4, enable_prefix_caching=False)
    tokens = toks(8)
    a = filled(kv, tokens)
    kv.free(a)
    b = PageTable()
    assert kv.match_prefix(b, tokens, max_tokens=8) == 0
    assert kv.prefix_hit_tokens == 0 and kv.num_free_pages == 8


def test_lru_eviction_order():
    kv = KVPageManager(num_pages=4, page_size=4, enable_prefix_caching=True)
    a_tok, b_tok = toks(8, 0), toks(8, 50)
    a, b = filled(kv, a_tok), filled(kv, b_tok)
    b_pages = list(b.pages)
    kv.free(a)  # a is released first ...
    kv.free(b)
    assert kv.num_free_pages == 4
    # ... then touched again, which makes b the least recently used
    again = PageTable()
    assert kv.match_prefix(again, a_tok, max_tokens=8) == 8
    kv.free(again)
    fresh = PageTable()
    assert kv.allocate(fresh, 8)  # the free list is empty: two cached pages must be evicted
    assert set(fresh.pages) == set(b_pages), "the least recently used cached pages are evicted first"
    probe = PageTable()
    assert kv.match_prefix(probe, b_tok, max_tokens=8) == 0, "b was least recently used: evicted"
    probe_a = PageTable()
    assert kv.match_prefix(probe_a, a_tok, max_tokens=8) == 8, "a was used more recently: kept"
    for t in (fresh, probe, probe_a):
        kv.free(t)
    assert kv.num_free_pages == 4


def test_evicted_page_is_not_matched_by_its_old_key():
    kv = KVPageManager(num_pages=2, page_size=4, enable_prefix_caching=True)
    a_tok = toks(8)
    kv.free(filled(kv, a_tok))
    other = filled(kv, toks(8, 70))  # reuses (evicts) both pages with new content
    kv.free(other)
    probe = PageTable()
    assert kv.match_prefix(probe, a_tok, max_tokens=8) == 0
    assert kv.match_prefix(PageTable(), toks(8, 70), max_tokens=8) == 8


@pytest.mark.parametrize("page_size, block", [(4, 8), (4, 6), (2, 4)])
def test_dllm_key_extends_to_the_end_of_the_block(page_size, block):
    """Under block-causal attention a page's K/V depend on the rest of its DLLM block: the page may
    only be shared when those tokens match too, and registered only when they are committed."""
    kv = KVPageManager(num_pages=32, page_size=page_size, enable_prefix_caching=True, dllm_block_length=block)
    tokens = toks(2 * block)
    a = PageTable()
    assert kv.allocate(a, len(tokens))
    kv.register(a, tokens, page_size)  # the first page is full, but its block is not committed
    assert a.registered == 0
    kv.register(a, tokens, block)
    assert a.registered == block // page_size  # pages lying entirely inside the first block
    kv.register(a, tokens, 2 * block)
    assert a.registered == 2 * block // page_size
    # same first page, different rest of its block: no reuse of page 0
    diverge = tokens[:page_size] + [999] * (len(tokens) - page_size)
    probe = PageTable()
    assert kv.match_prefix(probe, diverge, max_tokens=len(tokens)) == 0
    # identical tokens: full reuse; with max_tokens inside a block, only pages whose block fits, and
    # then only whole blocks of them (a forward from a hit feeds whole blocks)
    probe = PageTable()
    assert kv.match_prefix(probe, tokens, max_tokens=2 * block) == 2 * block
    kv.free(probe)
    probe = PageTable()
    limit = block + page_size
    reused = kv.match_prefix(probe, tokens, max_tokens=limit)
    pages = 0  # leading pages whose key (through the end of their block) fits under the limit
    while -(-((pages + 1) * page_size) // block) * block <= limit:
        pages += 1
    while pages * page_size % block:
        pages -= 1
    assert reused == pages * page_size < limit
    assert len(probe.pages) == pages  # the pages dropped to round down are not held
    kv.free(probe)
    kv.free(a)


# ---- engine level ------------------------------------------------------------------------------

N_NEW = 6


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def count_forward_tokens(pipe) -> list[int]:
    """Record the number of tokens fed to every forward (wraps the real executor, no mock)."""
    counts: list[int] = []
    real = pipe.engine.executor.execute

    def execute(batch):
        counts.append(len(batch.input_ids))
        return real(batch)

    pipe.engine.executor.execute = execute
    return counts


def gen(**kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True, **kw)


def test_ar_prefix_hits_identical_outputs_fewer_tokens(ar_ckpt):
    base = prompt(30, 1)
    shared = base[:20] + prompt(7, 2)
    with pipeline(ar_ckpt, EngineConfig(kv_block_size=4, enable_prefix_caching=False)) as ref:
        want_base, want_shared = ref(base, gen()).token_ids, ref(shared, gen()).token_ids
    with pipeline(ar_ckpt, EngineConfig(kv_block_size=4)) as pipe:
        kv = pipe.engine.kv
        start_free = kv.num_free_pages
        counts = count_forward_tokens(pipe)
        assert pipe(base, gen()).token_ids == want_base
        cold = sum(counts)
        assert cold == 30 + N_NEW - 1 and kv.prefix_hit_tokens == 0
        counts.clear()
        assert pipe(base, gen()).token_ids == want_base
        assert kv.prefix_hit_tokens == 28, "7 full pages of the 30-token prompt (the last token is recomputed)"
        assert sum(counts) == cold - 28
        counts.clear()
        assert pipe(shared, gen()).token_ids == want_shared
        assert kv.prefix_hit_tokens == 28 + 20
        assert sum(counts) == 27 - 20 + N_NEW - 1
        assert kv.num_free_pages == start_free, "every page comes back after the requests finish"


def test_ar_generated_tokens_are_cached_too(ar_ckpt):
    """A follow-up turn (prompt + previous answer + more) reuses the answer's pages."""
    base = prompt(16, 3)
    with pipeline(ar_ckpt, EngineConfig(kv_block_size=4)) as pipe:
        first = pipe(base, GenerationConfig(max_new_tokens=9, ignore_eos=True)).token_ids
        follow = base + first + prompt(3, 4)
        before = pipe.engine.kv.prefix_hit_tokens
        got = pipe(follow, gen()).token_ids
        hit = pipe.engine.kv.prefix_hit_tokens - before
    with pipeline(ar_ckpt, EngineConfig(kv_block_size=4, enable_prefix_caching=False)) as ref:
        assert got == ref(follow, gen()).token_ids
    assert hit == 24, "16 prompt tokens + the first 8 of 9 generated tokens have final K/V (6 full pages)"


def test_ar_batch_with_shared_prefix_and_pages_return(ar_ckpt):
    system = prompt(24, 10)
    prompts = [system + prompt(3 + i, 20 + i) for i in range(4)]
    with pipeline(ar_ckpt, EngineConfig(kv_block_size=4, enable_prefix_caching=False)) as ref:
        want = [r.token_ids for r in ref(prompts, gen())]
    with pipeline(ar_ckpt, EngineConfig(kv_block_size=4, num_kv_blocks=64)) as pipe:
        assert pipe.engine.kv.num_free_pages == 64
        pipe(system + [1], gen())  # warm the shared prefix
        got = [r.token_ids for r in pipe(prompts, gen())]
        assert pipe.engine.kv.prefix_hit_tokens == 4 * 24
        assert pipe.engine.kv.num_free_pages == 64
    assert got == want


@pytest.mark.parametrize("block", [4, 8])
def test_dllm_prefix_hits_identical_outputs(dllm_ckpt, block):
    cfg = dict(kv_block_size=4, dllm_block_length=block)
    base = prompt(22, 30)
    # same first page as `base` but a different rest of its DLLM block (block 8): the first page's
    # K/V differ under block-causal attention, so it must not be reused
    twin = base[:4] + prompt(18, 31)
    with pipeline(dllm_ckpt, EngineConfig(enable_prefix_caching=False, **cfg)) as ref:
        want_base, want_twin = ref(base, gen()), ref(twin, gen())
    with pipeline(dllm_ckpt, EngineConfig(**cfg)) as pipe:
        kv = pipe.engine.kv
        start_free = kv.num_free_pages
        counts = count_forward_tokens(pipe)
        cold = pipe(base, gen())
        cold_tokens = sum(counts)
        counts.clear()
        warm = pipe(base, gen())
        hit = kv.prefix_hit_tokens
        assert hit >= 16, "the committed prompt blocks are reused"
        assert sum(counts) < cold_tokens
        twin_out = pipe(twin, gen())
        assert kv.prefix_hit_tokens - hit == (4 if block == 4 else 0)
        assert kv.num_free_pages == start_free
    for got in (cold, warm):
        assert (got.token_ids, got.step_map) == (want_base.token_ids, want_base.step_map)
    assert (twin_out.token_ids, twin_out.step_map) == (want_twin.token_ids, want_twin.step_map)


def test_pages_return_after_abort_and_stream_break(ar_ckpt):
    with pipeline(ar_ckpt, EngineConfig(kv_block_size=4, num_kv_blocks=40)) as pipe:
        engine = pipe.engine
        rid = engine.add_request(prompt(10, 40), gen())
        engine.step()
        assert engine.kv.num_free_pages < 40
        chunk = engine.abort(rid)
        assert chunk is not None and chunk.finish_reason == "abort"
        assert engine.kv.num_free_pages == 40 and not engine.has_unfinished()
        stream = pipe.stream(prompt(10, 41), GenerationConfig(max_new_tokens=20, ignore_eos=True))
        next(stream)
        stream.close()  # the client went away
        assert engine.kv.num_free_pages == 40 and not engine.has_unfinished()
