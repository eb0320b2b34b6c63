"""The FlexAttention backend against the torch reference, in float32 on the CPU.

`FlexAttention` reads the whole paged cache in place through a `BlockMask` built from the page tables.
Eager FlexAttention (what runs here) computes the mask at every (query, key slot) of the cache and
ignores the BlockMask's page lists, so the page lists are checked on their own: every key a query
sees lies in a page its tile lists. The compiled kernel honours the lists; one batch runs compiled
on the CPU (inductor's C++ FlexAttention) to show the whole path. Then every forward of real engine
runs: outputs identical to the torch backend's (greedy tokens, step maps, logprobs within 1e-5).
"""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from engine import EngineConfig, GenerationConfig, pipeline
from ops.attention import FLEX_TILE, AttentionBackend, AttentionMetadata, FlexAttention, TorchAttention
from ops.attention.flex import triton_tiles
from tests.support.attention_batches import AR_BATCHES, DLLM_BATCHES
from tests.support.outputs import assert_same_outputs

PAGE, HEADS, KV_HEADS, DIM = 16, 4, 2, 8
NUM_PAGES = 40
TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(autouse=True)
def _quiet_eager_flex():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


def make_batch(shapes: list[tuple[int, int]], block_length: int | None, seed: int = 0):
    """A forward over `shapes` with shuffled pages, every slot no sequence has written holding large
    garbage (a key read from the wrong page or slot changes the result). Returns (meta factory, q, k,
    v, cache)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_PAGES, generator=g).tolist()
    tables, slots, positions = [], [], []
    width = max(-(-(cached + fed) // PAGE) for cached, fed in shapes) + 1  # a spare padding column
    for cached, fed in shapes:
        table = [perm.pop() for _ in range(-(-(cached + fed) // PAGE))]
        tables.append(table)
        positions += range(cached, cached + fed)
        slots += [table[p // PAGE] * PAGE + p % PAGE for p in range(cached, cached + fed)]
    total = len(positions)

    def meta() -> AttentionMetadata:
        return AttentionMetadata(q_lens=[f for _, f in shapes], kv_lens=[c + f for c, f in shapes],
                                 positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
                                 page_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                                 page_size=PAGE, dllm_block_length=block_length, page_table_lists=tables)

    q = torch.randn(total, HEADS, DIM, generator=g)
    k = torch.randn(total, KV_HEADS, DIM, generator=g)
    v = torch.randn(total, KV_HEADS, DIM, generator=g)
    cache = torch.randn(2, NUM_PAGES, PAGE, KV_HEADS, DIM, generator=g) * 30
    for (cached, _), table in zip(shapes, tables, strict=True):  # earlier forwards' keys: ordinary values
        for p in range(cached):
            cache[:, table[p // PAGE], p % PAGE] = torch.randn(2, KV_HEADS, DIM, generator=g)
    return meta, q, k, v, cache


def attend(backend: AttentionBackend, batch) -> tuple[torch.Tensor, AttentionMetadata]:
    meta_of, q, k, v, cache = batch
    meta = meta_of()
    k_cache, v_cache = cache[0].clone(), cache[1].clone()
    backend.prepare(meta)
    return backend.forward(q, k, v, k_cache, v_cache, meta, DIM**-0.5), meta


ALL = [(name, shapes, None) for name, shapes in AR_BATCHES.items()] + \
      [(name, shapes, 4) for name, shapes in DLLM_BATCHES.items()]


@pytest.mark.parametrize("name, shapes, block_length", ALL, ids=[a[0] for a in ALL])
def test_eager_flex_equals_the_reference(name, shapes, block_length):
    batch = make_batch(shapes, block_length)
    want, _ = attend(TorchAttention(), batch)
    got, _ = attend(FlexAttention(compiled=False), batch)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("name, shapes, block_length", ALL, ids=[a[0] for a in ALL])
def test_every_visible_key_lies_in_a_page_its_tile_lists(name, shapes, block_length):
    """The BlockMask's page lists cover the mask (what the compiled kernel relies on), and a tile lists
    no page twice."""
    backend = FlexAttention(compiled=False)
    batch = make_batch(shapes, block_length)
    _, meta = attend(backend, batch)
    mask = meta.extra["block_mask"]
    total, keys = meta.extra["num_tokens"], NUM_PAGES * PAGE
    dense = mask.mask_mod(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long),
                          torch.arange(total)[:, None], torch.arange(keys)[None, :])
    counts = mask.kv_num_blocks[0, 0].tolist()
    listed = torch.zeros(len(counts), NUM_PAGES, dtype=torch.bool)
    for tile, n in enumerate(counts):
        pages = mask.kv_indices[0, 0, tile, :n]
        assert len(set(pages.tolist())) == n
        listed[tile, pages] = True
    needed = dense.view(total, NUM_PAGES, PAGE).any(-1)  # [row, page]: the row sees a key of the page
    rows_listed = listed.repeat_interleave(FLEX_TILE, 0)[:total]
    assert not (needed & ~rows_listed).any()
    # the mask itself: row sees exactly the keys of its sequence below its limit
    q_lens, kv_lens = meta.q_lens, meta.kv_lens
    assert int(dense.sum()) == sum(min(kv, (p // block_length + 1) * block_length) if block_length else p + 1
                                   for q_len, kv in zip(q_lens, kv_lens, strict=True)
                                   for p in range(kv - q_len, kv))


def test_a_missing_page_changes_the_compiled_result():
    """The compiled kernel reads only the listed pages: drop one and the result changes (so the
    coverage test above checks what matters)."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("compiled FlexAttention on the CPU needs a C++ compiler")

    class DropsLastPage(FlexAttention):
        def plan(self, *args):
            plan = super().plan(*args)
            plan.arrays["kv_num_blocks"] = [n - 1 for n in plan.arrays["kv_num_blocks"]]
            return plan

    batch = make_batch(DLLM_BATCHES["mixed"], 4)
    want, _ = attend(TorchAttention(), batch)
    got, _ = attend(FlexAttention(compiled=True), batch)
    # inductor's CPU kernel: float32 with its own exp and summation order
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    broken, _ = attend(DropsLastPage(compiled=True), batch)
    assert not torch.allclose(broken, want, atol=1e-2)


def test_the_triton_tiles_divide_the_masks_blocks():
    """Inductor refuses a BlockMask whose blocks its Triton tiles do not divide (seen on an H200 with
    torch 2.11: 'Q and KV block size must be divisible by BLOCK_M and BLOCK_N'), and its decoding kernel
    found no configuration for these masks: the compiled call names tiles that divide both the paged
    backend's mask and DiffusionGemma's, and the main kernel."""
    batch = make_batch(DLLM_BATCHES["mixed"], 4)
    _, meta = attend(FlexAttention(compiled=False), batch)
    for mask in (meta.extra["block_mask"], BlockMask.from_kv_blocks(torch.ones(1, 1, 1, dtype=torch.int32),
                                                                    torch.zeros(1, 1, 1, 1, dtype=torch.int32),
                                                                    BLOCK_SIZE=(128, 256))):
        q_block, kv_block = mask.BLOCK_SIZE
        tiles = triton_tiles(mask)
        assert q_block % tiles["BLOCK_M"] == 0 and kv_block % tiles["BLOCK_N"] == 0
        assert 16 <= tiles["BLOCK_M"] <= 64 and 16 <= tiles["BLOCK_N"] <= 64  # Triton's dot needs 16
        assert tiles["FORCE_USE_FLEX_ATTENTION"] is True


def test_a_compiled_kernel_that_fails_hands_over_to_the_torch_backend(caplog):
    """Where the compiled kernel cannot be built, attention goes on through the torch backend (logged),
    from the failing call on; an eager failure is a bug and propagates."""
    def broken(*args, **kwargs):
        raise RuntimeError("no C compiler")

    backend = FlexAttention(compiled=True)
    backend.fn = broken
    batch = make_batch(DLLM_BATCHES["mixed"], 4)
    want, _ = attend(TorchAttention(), batch)
    with caplog.at_level("ERROR", logger="ops.attention"):
        got, _ = attend(backend, batch)
    torch.testing.assert_close(got, want, **TOL)
    assert "compiled FlexAttention failed (RuntimeError: no C compiler)" in caplog.text
    assert backend.name == "torch (compiled flex failed)"
    again, _ = attend(backend, batch)  # prepared and attended by the torch backend from now on
    torch.testing.assert_close(again, want, **TOL)
    eager = FlexAttention(compiled=False)
    eager.fn = broken
    with pytest.raises(RuntimeError, match="no C compiler"):
        attend(eager, batch)


# ---- every forward of real engine runs -------------------------------------------------------------------------
def run_engine(path: str, backend: str, prompts: list[list[int]], gen: GenerationConfig, **engine):
    config = EngineConfig(kv_block_size=16, num_kv_blocks=64, max_model_len=256, max_prefill_token_num=24,
                          attention_backend=backend, **engine)
    with pipeline(path, engine_config=config) as pipe:
        assert pipe.engine.executor.runner.backend.name == backend
        return pipe(prompts, gen_config=gen)


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in lengths]


def test_engine_dllm_outputs_equal_the_torch_backend(dllm_ckpt):
    ps, gen = prompts([30, 9, 17], seed=1), GenerationConfig(max_new_tokens=12, ignore_eos=True)
    assert_same_outputs(run_engine(dllm_ckpt, "flex", ps, gen, dllm_block_length=4),
                        run_engine(dllm_ckpt, "torch", ps, gen, dllm_block_length=4))


def test_engine_ar_outputs_and_scores_equal_the_torch_backend(ar_ckpt):
    ps = prompts([40, 5, 21], seed=2)
    gen = GenerationConfig(max_new_tokens=6, ignore_eos=True, logprob_start_len=3, logprobs=2)
    assert_same_outputs(run_engine(ar_ckpt, "flex", ps, gen, logprobs_mode="raw_logprobs"),
                        run_engine(ar_ckpt, "torch", ps, gen, logprobs_mode="raw_logprobs"))
