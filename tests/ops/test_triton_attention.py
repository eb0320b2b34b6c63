"""The Triton paged-attention kernel (ops.attention.triton_paged) and its backend, on the CPU.

tests/conftest.py sets TRITON_INTERPRET=1 before Triton is imported, so the kernel runs here under
Triton's interpreter: the same program, tile by tile, in numpy. Checked:

* the `triton` backend against the `torch` reference backend (float32, within 2e-6) on every row kind
  the engine feeds -- AR prefill chunks and decode rows, DLLM denoising blocks, commit + next block,
  block-causal prefill chunks, mixed steps, one-row blocks -- with shuffled pages and garbage in every
  slot no sequence wrote, across GQA groups 1-8, head sizes 64-256 and pages of 16 and 256;
* a plan padded with empty tiles (as CUDA graphs replay it) gives bitwise the same output;
* page-table columns past a sequence's keys, and a sliding window's pages before it (which the engine
  may have freed), are never read: junk there (a page of NaN, ids past the cache) changes nothing;
* the modes the backend does not reach (bidirectional, sliding windows) against a dense per-row
  softmax written here, through `run_paged_attention` directly;
* bfloat16 storage: the interpreter's `tl.dot` is wrong on bfloat16, so the kernel computes in float32
  there (UPCAST) -- what this checks is the bfloat16 loads, stores and addressing, within 2e-2 (and
  within one bfloat16 unit of the float32 result: the interpreter casts to bfloat16 by truncation);
* `plan_tiles`: tiles stay within one sequence, hold at most `block_q(group)` rows, never outnumber
  `max_tiles`, and a plan too small to pad to is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from ops.attention import AttentionMetadata, TorchAttention, TritonAttention, triton_unmet, write_kv
from ops.attention.triton_paged import (
    BIDIRECTIONAL,
    BLOCK_CAUSAL,
    CAUSAL,
    block_q,
    max_tiles,
    plan_tiles,
    run_paged_attention,
)
from tests.support.attention_batches import AR_BATCHES, DLLM_BATCHES

F32_TOL = 2e-6
BF16_TOL = 2e-2
SPARE_PAGES = 3  # pages no sequence uses, all NaN: a valid-but-wrong target for junk table entries
GARBAGE = 30.0  # scale of the values in every slot no sequence wrote: a stray read shows


@dataclass(frozen=True)
class Layout:
    """Heads and cache geometry of a batch."""

    heads: int = 4
    kv_heads: int = 2
    dim: int = 64
    page: int = 16

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def scale(self) -> float:
        return self.dim**-0.5


@dataclass
class Batch:
    """One forward: `shapes` (tokens already cached, tokens fed now) per sequence over shuffled pages.
    The caches hold this forward's state *before* its K/V are written; `spare` are pages no sequence
    uses (all NaN)."""

    shapes: list[tuple[int, int]]
    block_length: int | None
    layout: Layout
    tables: list[list[int]]
    spare: list[int]
    positions: torch.Tensor
    slots: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    @property
    def q_lens(self) -> list[int]:
        return [fed for _, fed in self.shapes]

    @property
    def kv_lens(self) -> list[int]:
        return [cached + fed for cached, fed in self.shapes]

    def page_tables(self, fill: int = 0, spare_columns: int = 2) -> torch.Tensor:
        """[S, width] int64, every column past a sequence's pages holding `fill`."""
        width = max(len(t) for t in self.tables) + spare_columns
        return torch.tensor([t + [fill] * (width - len(t)) for t in self.tables], dtype=torch.long)

    def meta(self, fill: int = 0) -> AttentionMetadata:
        return AttentionMetadata(q_lens=self.q_lens, kv_lens=self.kv_lens, positions=self.positions,
                                 slot_mapping=self.slots, page_tables=self.page_tables(fill),
                                 page_size=self.layout.page, dllm_block_length=self.block_length,
                                 page_table_lists=[list(t) for t in self.tables])

    def written_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the caches with this forward's K/V written (what `attend` reads)."""
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        write_kv(self.k, self.v, k_cache, v_cache, self.slots)
        return k_cache, v_cache

    def to(self, dtype: torch.dtype) -> Batch:
        cast = {name: getattr(self, name).to(dtype) for name in ("q", "k", "v", "k_cache", "v_cache")}
        return Batch(self.shapes, self.block_length, self.layout, self.tables, self.spare, self.positions,
                     self.slots, **cast)


def make_batch(shapes: list[tuple[int, int]], block_length: int | None, layout: Layout = Layout(),
               seed: int = 0) -> Batch:
    """A float32 forward over `shapes`: each sequence's pages drawn from a shuffled pool (its page table
    out of order), earlier forwards' keys ordinary values, every slot of its pages no forward wrote
    garbage of scale GARBAGE. Page 0 (what page tables are padded with) belongs to no sequence and holds
    garbage; the SPARE_PAGES pages `spare` hold NaN, so a read of one that reaches P.V poisons the row
    even where the softmax weight is zero."""
    g = torch.Generator().manual_seed(seed)
    page, kvh, dim = layout.page, layout.kv_heads, layout.dim
    needed = [-(-(cached + fed) // page) for cached, fed in shapes]
    num_pages = 1 + sum(needed) + SPARE_PAGES
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    tables = [[perm.pop() for _ in range(n)] for n in needed]

    def slots_of(table: list[int], span: range) -> list[int]:
        return [table[p // page] * page + p % page for p in span]

    positions = [p for cached, fed in shapes for p in range(cached, cached + fed)]
    slots = [s for (cached, fed), t in zip(shapes, tables, strict=True)
             for s in slots_of(t, range(cached, cached + fed))]
    total = len(positions)
    q = torch.randn(total, layout.heads, dim, generator=g)
    k = torch.randn(total, kvh, dim, generator=g)
    v = torch.randn(total, kvh, dim, generator=g)
    k_cache, v_cache = torch.randn(2, num_pages, page, kvh, dim, generator=g) * GARBAGE
    old = torch.tensor([s for (cached, _), t in zip(shapes, tables, strict=True) for s in slots_of(t, range(cached))],
                       dtype=torch.long)
    for cache in (k_cache, v_cache):
        cache.view(-1, kvh, dim)[old] = torch.randn(len(old), kvh, dim, generator=g)
        cache[perm] = float("nan")
    return Batch(shapes, block_length, layout, tables, perm, torch.tensor(positions, dtype=torch.long),
                 torch.tensor(slots, dtype=torch.long), q, k, v, k_cache, v_cache)


def backend_forward(backend: TorchAttention | TritonAttention, batch: Batch, meta: AttentionMetadata | None = None
                    ) -> torch.Tensor:
    """`backend.forward` over the batch: this forward's K/V written into copies of the caches, then attended."""
    meta = batch.meta() if meta is None else meta
    backend.prepare(meta)
    return backend.forward(batch.q, batch.k, batch.v, batch.k_cache.clone(), batch.v_cache.clone(), meta,
                           batch.layout.scale)


def reference(batch: Batch) -> torch.Tensor:
    return backend_forward(TorchAttention(), batch)


def triton(batch: Batch, meta: AttentionMetadata | None = None) -> torch.Tensor:
    return backend_forward(TritonAttention(batch.layout.group), batch, meta)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def tile_arrays(batch: Batch) -> dict[str, torch.Tensor]:
    """The batch's unpadded plan as `run_paged_attention` takes it: int64 tensors."""
    plan = plan_tiles(batch.q_lens, batch.kv_lens, block_q(batch.layout.group))
    return {name: torch.tensor(values, dtype=torch.long) for name, values in plan.items()}


BATCH_KINDS = ([(name, shapes, None) for name, shapes in AR_BATCHES.items()]
               + [(name, shapes, 4) for name, shapes in DLLM_BATCHES.items()]
               + [("one_row_blocks_b1", [(4, 1), (11, 1), (13, 2), (0, 3)], 1),  # block 1: each row its own block
                  ("odd_blocks_b3", [(9, 6), (4, 2), (0, 7), (13, 1)], 3),  # blocks not a power of two, not aligned
                  ("commit_and_next_block_b8", [(24, 16), (8, 8), (61, 3)], 8)])


@pytest.mark.parametrize("name, shapes, block_length", BATCH_KINDS, ids=[kind[0] for kind in BATCH_KINDS])
def test_the_backend_equals_the_reference_on_every_row_kind(name: str, shapes: list[tuple[int, int]],
                                                            block_length: int | None) -> None:
    batch = make_batch(shapes, block_length)
    assert max_abs(triton(batch), reference(batch)) <= F32_TOL


# Pairwise covering of (GQA group, head size, page): every pair of values of any two of them meets in
# some case, and pages of 256 get sequences longer than a page (tables of several pages, out of order).
LAYOUTS = [Layout(heads=2 * group, kv_heads=2, dim=dim, page=page) for group, dim, page in [
    (1, 64, 16), (1, 128, 256), (1, 256, 16),
    (2, 64, 256), (2, 128, 16), (2, 256, 256),
    (4, 64, 16), (4, 128, 256), (4, 256, 16),
    (8, 64, 256), (8, 128, 16), (8, 256, 256),
]] + [Layout(heads=8, kv_heads=1, dim=128, page=16)]  # all eight query heads on one K/V head
LONG_BATCHES = [("ar", [(250, 12), (300, 1), (0, 9)], None), ("dllm", [(256, 8), (276, 4), (0, 12)], 4)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lo: f"g{lo.group}-kv{lo.kv_heads}-d{lo.dim}-p{lo.page}")
@pytest.mark.parametrize("name, shapes, block_length", LONG_BATCHES, ids=[kind[0] for kind in LONG_BATCHES])
def test_the_backend_equals_the_reference_across_layouts(layout: Layout, name: str, shapes: list[tuple[int, int]],
                                                         block_length: int | None) -> None:
    batch = make_batch(shapes, block_length, layout, seed=layout.dim + layout.group)
    if layout.page == 256:
        assert any(len(t) > 1 for t in batch.tables)
    assert max_abs(triton(batch), reference(batch)) <= F32_TOL


@pytest.mark.parametrize("group", [1, 4])
def test_a_padded_plan_gives_the_same_output(group: int) -> None:
    """Padded to the bucket's tile count (many empty tiles, as every CUDA-graph replay launches), the
    output is bitwise the unpadded plan's."""
    layout = Layout(heads=2 * group, kv_heads=2)
    batch = make_batch(DLLM_BATCHES["mixed"], 4, layout)
    backend = TritonAttention(group)
    tokens, max_seqs = 64, 16  # the bucket: more rows and sequences than this step has
    pad = backend.tiles_for(tokens, max_seqs)
    assert pad == max_tiles(tokens, max_seqs, block_q(group))
    meta = batch.meta()
    meta.plan = backend.plan(batch.q_lens, batch.kv_lens, batch.tables, layout.page, 4, pad_tiles=pad)
    meta.planned = {name: torch.tensor(values, dtype=torch.long) for name, values in meta.plan.arrays.items()}
    empty = meta.plan.arrays["tile_rows"].tolist().count(0)
    assert len(meta.plan.arrays["tile_rows"]) == pad and empty >= pad // 2
    padded = backend_forward(backend, batch, meta)
    unpadded = triton(batch)
    assert torch.equal(padded, unpadded)
    assert max_abs(unpadded, reference(batch)) <= F32_TOL


@pytest.mark.parametrize("junk", ["nan_page", "huge", "negative"])
@pytest.mark.parametrize("name, shapes, block_length", [("ar", AR_BATCHES["prefill_chunk_and_decode"], None),
                                                        ("dllm", DLLM_BATCHES["mixed"], 4)], ids=["ar", "dllm"])
def test_page_table_columns_past_the_keys_are_never_read(junk: str, name: str, shapes: list[tuple[int, int]],
                                                         block_length: int | None) -> None:
    """Every column past a sequence's pages holds junk: a valid page full of NaN, an id far past the
    cache, or -1 (a read of either would fault). The output is bitwise that of a zero-padded table."""
    batch = make_batch(shapes, block_length)
    fill = {"nan_page": batch.spare[0], "huge": 10**9, "negative": -1}[junk]
    want = triton(batch)
    got = triton(batch, batch.meta(fill))
    assert torch.equal(got, want)


def test_the_nan_page_poisons_the_rows_that_read_it() -> None:
    """The junk test's NaN page is not inert: a table naming it where a sequence's keys lie poisons that
    sequence's rows (so the test above would see a stray read), and no other row."""
    batch = make_batch(DLLM_BATCHES["mixed"], 4)
    tables = batch.page_tables()
    tables[0, 0] = batch.spare[0]
    k_cache, v_cache = batch.written_caches()
    wrong = run_paged_attention(batch.q, k_cache, v_cache, tables, batch.positions, tile_arrays(batch),
                                batch.layout.scale, BLOCK_CAUSAL, 4)
    right = run_paged_attention(batch.q, k_cache, v_cache, batch.page_tables(), batch.positions, tile_arrays(batch),
                                batch.layout.scale, BLOCK_CAUSAL, 4)
    rows = batch.q_lens[0]
    assert wrong[:rows].isnan().all() and not right.isnan().any()
    assert torch.equal(wrong[rows:], right[rows:])


# ---- run_paged_attention against a dense per-row softmax --------------------------------------------------------
def visible_span(pos: int, kv_len: int, mode: int, block: int, window: int) -> range:
    """The keys a row at `pos` sees, as the kernel documents them."""
    if mode == CAUSAL:
        hi = pos + 1
    elif mode == BLOCK_CAUSAL:
        hi = min((pos // block + 1) * block, kv_len)
    else:
        hi = kv_len
    lo = max(pos - window + 1, 0) if window > 0 else 0
    return range(lo, hi)


def dense_reference(batch: Batch, k_cache: torch.Tensor, v_cache: torch.Tensor, mode: int, block: int = 1,
                    window: int = 0) -> torch.Tensor:
    """Row by row in float64: softmax over the row's visible keys, gathered from the cache through its
    sequence's page table. Returns [T, H, D]."""
    page, group = batch.layout.page, batch.layout.group
    out = torch.empty(batch.q.shape, dtype=torch.float64)
    row = 0
    for table, (cached, fed) in zip(batch.tables, batch.shapes, strict=True):
        kv_len = cached + fed
        slots = torch.tensor([table[j // page] * page + j % page for j in range(kv_len)], dtype=torch.long)
        keys = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [kv_len, H, D]
        values = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        for pos in range(cached, kv_len):
            span = visible_span(pos, kv_len, mode, block, window)
            scores = torch.einsum("hd,khd->hk", batch.q[row].double(), keys[span.start:span.stop]) * batch.layout.scale
            out[row] = torch.einsum("hk,khd->hd", scores.softmax(-1), values[span.start:span.stop])
            row += 1
    return out


DENSE_CASES = {  # name: (shapes, layout, mode, dllm block, window)
    "bidirectional_d256": ([(24, 16), (0, 5), (40, 1)], Layout(heads=4, kv_heads=2, dim=256), BIDIRECTIONAL, 1, 0),
    "bidirectional_d512": ([(24, 16), (0, 5)], Layout(heads=2, kv_heads=1, dim=512), BIDIRECTIONAL, 1, 0),
    "causal_window24": ([(60, 40), (100, 1), (0, 30), (23, 2)], Layout(heads=8, kv_heads=2), CAUSAL, 1, 24),
    "causal_window5": ([(70, 20), (100, 1), (0, 9)], Layout(heads=4, kv_heads=4), CAUSAL, 1, 5),
    "causal_window1": ([(10, 6), (3, 1)], Layout(heads=4, kv_heads=2), CAUSAL, 1, 1),
    "causal_window_wide_p256": ([(250, 12), (300, 1)], Layout(heads=4, kv_heads=2, dim=128, page=256), CAUSAL, 1,
                                100),
    "block_causal": ([(16, 16), (28, 8), (40, 4), (0, 4)], Layout(heads=8, kv_heads=1), BLOCK_CAUSAL, 4, 0),
    "block_causal_window": ([(60, 12), (33, 3)], Layout(heads=4, kv_heads=2), BLOCK_CAUSAL, 4, 20),
    "causal_d80": ([(20, 13), (41, 1)], Layout(heads=4, kv_heads=2, dim=80), CAUSAL, 1, 0),  # head not a power of 2
}


@pytest.mark.parametrize("case", list(DENSE_CASES))
def test_run_paged_attention_equals_a_dense_reference(case: str) -> None:
    shapes, layout, mode, block, window = DENSE_CASES[case]
    batch = make_batch(shapes, block if mode == BLOCK_CAUSAL else None, layout, seed=len(case))
    k_cache, v_cache = batch.written_caches()
    got = run_paged_attention(batch.q, k_cache, v_cache, batch.page_tables(), batch.positions, tile_arrays(batch),
                              layout.scale, mode, dllm_block=block, window=window)
    want = dense_reference(batch, k_cache, v_cache, mode, block, window)
    assert max_abs(got, want) <= F32_TOL


def test_a_window_changes_what_a_row_sees() -> None:
    """The window is applied at all: with it, rows far into a sequence differ from full causal rows."""
    batch = make_batch([(60, 40)], None, Layout(heads=4, kv_heads=2))
    k_cache, v_cache = batch.written_caches()
    args = (batch.q, k_cache, v_cache, batch.page_tables(), batch.positions, tile_arrays(batch), batch.layout.scale,
            CAUSAL)
    windowed, full = run_paged_attention(*args, window=24), run_paged_attention(*args)
    assert max_abs(windowed, full) > 1e-2
    assert max_abs(full, dense_reference(batch, k_cache, v_cache, CAUSAL)) <= F32_TOL


@pytest.mark.parametrize("junk", ["nan_page", "huge"])
def test_keys_before_a_sliding_window_are_never_read(junk: str) -> None:
    """A sliding window's pages wholly before it may have been freed (and reused): junk page ids in those
    columns, and NaN in every slot of the partly covered page below the lowest key the sequence's rows
    see, change nothing."""
    window = 24
    batch = make_batch([(70, 20), (100, 1), (40, 9)], None, Layout(heads=4, kv_heads=2))
    page = batch.layout.page
    k_cache, v_cache = batch.written_caches()
    want = dense_reference(batch, k_cache, v_cache, CAUSAL, window=window)
    tables = batch.page_tables()
    poisoned = 0
    for s, (table, (cached, _)) in enumerate(zip(batch.tables, batch.shapes, strict=True)):
        first_lo = max(cached - window + 1, 0)  # the lowest key any row of the sequence sees
        tables[s, : first_lo // page] = batch.spare[0] if junk == "nan_page" else 10**9
        for j in range(first_lo // page * page, first_lo):
            for cache in (k_cache, v_cache):
                cache[table[j // page], j % page] = float("nan")
            poisoned += 1
        poisoned += first_lo // page * page
    assert poisoned == 47 + 77 + 17  # keys below each sequence's first window
    got = run_paged_attention(batch.q, k_cache, v_cache, tables, batch.positions, tile_arrays(batch),
                              batch.layout.scale, CAUSAL, window=window)
    assert max_abs(got, want) <= F32_TOL


def test_a_strided_query_view() -> None:
    """q as the engine may pass it: a view into a wider projection output (row stride past H * D)."""
    batch = make_batch(AR_BATCHES["prefill_chunk_and_decode"], None, Layout(heads=4, kv_heads=2))
    wide = torch.randn(batch.q.shape[0], 8, batch.layout.dim)
    wide[:, :4] = batch.q
    q = wide[:, :4]
    assert not q.is_contiguous()
    k_cache, v_cache = batch.written_caches()
    got = run_paged_attention(q, k_cache, v_cache, batch.page_tables(), batch.positions, tile_arrays(batch),
                              batch.layout.scale, CAUSAL)
    assert max_abs(got, dense_reference(batch, k_cache, v_cache, CAUSAL)) <= F32_TOL


# ---- bfloat16 storage ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shapes, block_length, layout", [
    (DLLM_BATCHES["mixed"], 4, Layout(heads=4, kv_heads=2, dim=128)),
    (LONG_BATCHES[0][1], None, Layout(heads=8, kv_heads=2, dim=256, page=256)),
], ids=["dllm_mixed-g2-d128", "ar_long-g4-d256-p256"])
def test_bfloat16_storage_is_close_to_the_float32_reference(shapes: list[tuple[int, int]], block_length: int | None,
                                                            layout: Layout) -> None:
    """q and the caches in bfloat16; the reference is float32 on the same (bfloat16-rounded) values."""
    bf16 = make_batch(shapes, block_length, layout).to(torch.bfloat16)
    got = triton(bf16)
    assert got.dtype == torch.bfloat16
    want = reference(bf16.to(torch.float32))
    assert max_abs(got, want) <= BF16_TOL
    # tighter: the float32 result cut to bfloat16 once, within a unit in the last place (2**-7 relative; the
    # interpreter casts float32 to bfloat16 by truncation, where a GPU rounds to nearest)
    assert ((got.double() - want.double()).abs() <= want.double().abs() * 2**-7 + 1e-5).all()


# ---- plan_tiles ----------------------------------------------------------------------------------------------------
def check_plan(plan: dict[str, list[int]], q_lens: list[int], kv_lens: list[int], rows_per_tile: int) -> None:
    """Each tile lies within one sequence and holds 1..rows_per_tile rows; together they cover every
    row once, in order."""
    starts = [sum(q_lens[:s]) for s in range(len(q_lens) + 1)]
    covered: list[int] = []
    for seq, row0, rows, kv in zip(plan["tile_seq"], plan["tile_row0"], plan["tile_rows"], plan["tile_kv_len"],
                                   strict=True):
        assert 1 <= rows <= rows_per_tile
        assert starts[seq] <= row0 and row0 + rows <= starts[seq + 1]
        assert kv == kv_lens[seq]
        covered += range(row0, row0 + rows)
    assert covered == list(range(starts[-1]))


def test_plan_tiles_stay_within_a_sequence_and_fit_max_tiles() -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        group = [1, 2, 4, 8, 16, 32][trial % 6]
        rows_per_tile = block_q(group)
        assert rows_per_tile * group >= 16 or rows_per_tile == 1
        seqs = int(torch.randint(1, 9, (1,), generator=g))
        q_lens = torch.randint(0, 40, (seqs,), generator=g).tolist()
        q_lens[0] = max(q_lens[0], 1)
        if trial % 3 == 0:  # decode-heavy: many one-row sequences
            q_lens = [1 if n % 2 else n for n in q_lens]
        kv_lens = [n + int(torch.randint(0, 300, (1,), generator=g)) for n in q_lens]
        plan = {name: values.tolist() for name, values in plan_tiles(q_lens, kv_lens, rows_per_tile).items()}
        check_plan(plan, q_lens, kv_lens, rows_per_tile)
        bound = max_tiles(sum(q_lens), seqs, rows_per_tile)
        assert len(plan["tile_seq"]) <= bound
        padded = {name: values.tolist() for name, values in plan_tiles(q_lens, kv_lens, rows_per_tile,
                                                                       pad_to=bound).items()}
        assert len(padded["tile_rows"]) == bound
        assert {name: values[: len(plan["tile_seq"])] for name, values in padded.items()} == plan
        assert not any(padded["tile_rows"][len(plan["tile_seq"]):])


def test_plan_tiles_refuses_a_pad_smaller_than_the_plan() -> None:
    q_lens, kv_lens = [20, 1, 9], [40, 30, 9]
    tiles = len(plan_tiles(q_lens, kv_lens, 8)["tile_seq"])
    assert tiles == 3 + 1 + 2
    assert len(plan_tiles(q_lens, kv_lens, 8, pad_to=tiles)["tile_seq"]) == tiles
    with pytest.raises(ValueError, match="do not fit"):
        plan_tiles(q_lens, kv_lens, 8, pad_to=tiles - 1)


def test_the_backend_runs_here_under_the_interpreter() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert triton_unmet(torch.device("cpu")) == []
    assert TritonAttention(4).rows_per_tile == block_q(4) == 4
