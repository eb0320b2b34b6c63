"""DiffusionGemma's FlexAttention backend against its torch reference, attention alone, in float32 on
the CPU: encoder and canvas passes of several sequences in one forward, on a sliding group (window,
freed pages before it) and a full group, at both of the tiny model's head sizes.

Eager FlexAttention (what serves on the CPU) evaluates the mask at every (query, key) and ignores the
BlockMask's block lists, so the lists are checked on their own: every key a query sees lies in a
block its tile lists. One forward runs compiled (inductor's C++ FlexAttention) to show the kernel
honours the lists: drop a block and the result changes. The networks' logits on this backend are
checked against transformers in test_diffusion_gemma_runner.py, its engine outputs in
test_diffusion_gemma_decoding.py.
"""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch

from engine.model.families.diffusion_gemma.attention import (
    CANVAS,
    ENCODE,
    FREED,
    GemmaAttentionMeta,
    GemmaPass,
    GemmaTorchAttention,
    gemma_attention,
)
from engine.model.families.diffusion_gemma.config import FULL, SLIDING
from engine.model.families.diffusion_gemma.flex_attention import KEY_BLOCK, GemmaFlexAttention, plan_flex
from ops.attention import FLEX_TILE

PAGE, WINDOW, HEADS, NUM_PAGES = 4, 8, 4, 64
TOL = {"atol": 1e-5, "rtol": 1e-5}

# (kind, committed tokens, tokens fed) per sequence
BATCHES = {
    "prefills": [(ENCODE, 0, 1), (ENCODE, 0, 9), (ENCODE, 0, 40)],
    "canvases_inside_and_beyond_the_window": [(CANVAS, 3, 16), (CANVAS, 7, 16), (CANVAS, 30, 16)],
    "commit_beside_canvases": [(CANVAS, 12, 16), (ENCODE, 21, 16), (CANVAS, 0, 16)],
    "chunk_after_a_long_context": [(ENCODE, 50, 24), (CANVAS, 1, 16)],
    "one_row_passes": [(ENCODE, 9, 1), (CANVAS, 2, 1), (ENCODE, 0, 2)],
    "canvas_over_three_tiles": [(ENCODE, 0, 5), (CANVAS, 3, 40)],
}


@pytest.fixture(autouse=True)
def _quiet_eager_flex():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


def make_forward(shapes: list[tuple[str, int, int]], kv_heads: int, dim: int, seed: int = 0):
    """Passes over shuffled pages of both groups, the sliding group's pages before the window freed;
    every cache slot no pass has committed holds large garbage (a key read from the wrong slot changes
    the result). Returns (meta factory, q, k, v, caches per group)."""
    g = torch.Generator().manual_seed(seed)
    perms = {kind: torch.randperm(NUM_PAGES, generator=g).tolist() for kind in (SLIDING, FULL)}
    caches = {kind: torch.randn(2, NUM_PAGES, PAGE, kv_heads, dim, generator=g) * 30 for kind in (SLIDING, FULL)}
    passes = []
    for kind, start, fed in shapes:
        tables = {}
        for group, perm in perms.items():
            table = [perm.pop() for _ in range(-(-(start + fed) // PAGE))]
            for pos in range(start):
                caches[group][:, table[pos // PAGE], pos % PAGE] = torch.randn(2, kv_heads, dim, generator=g)
            if group == SLIDING:  # pages wholly before the window, as the page manager releases them
                keep_from = max(0, start - (WINDOW - 1)) // PAGE
                table = [FREED] * keep_from + table[keep_from:]
            tables[group] = table
        passes.append((kind, start, fed, tables))
    total = sum(fed for _, _, fed in shapes)
    q = torch.randn(total, HEADS, dim, generator=g)
    k = torch.randn(total, kv_heads, dim, generator=g)
    v = torch.randn(total, kv_heads, dim, generator=g)

    def meta(backend) -> GemmaAttentionMeta:
        return GemmaAttentionMeta([GemmaPass(kind, start, fed, tables) for kind, start, fed, tables in passes],
                                  PAGE, WINDOW, torch.device("cpu"), backend)

    return meta, q, k, v, caches


def attend(backend, forward, group: str) -> tuple[torch.Tensor, GemmaAttentionMeta]:
    meta_of, q, k, v, caches = forward
    meta = meta_of(backend)
    meta.prepare()
    k_cache, v_cache = caches[group][0].clone(), caches[group][1].clone()
    return gemma_attention(q, k, v, k_cache, v_cache, meta, group), meta


CASES = [(name, group, kv_heads, dim) for name in BATCHES for group, kv_heads, dim in ((SLIDING, 2, 16), (FULL, 1, 32))]
IDS = [f"{name}-{group}" for name, group, _, _ in CASES]


@pytest.mark.parametrize("name, group, kv_heads, dim", CASES, ids=IDS)
def test_eager_flex_equals_the_reference(name, group, kv_heads, dim):
    forward = make_forward(BATCHES[name], kv_heads, dim)
    want, _ = attend(GemmaTorchAttention(), forward, group)
    got, _ = attend(GemmaFlexAttention(compiled=False), forward, group)
    torch.testing.assert_close(got, want, **TOL)


def _expected_visible(shapes: list[tuple[str, int, int]], group: str) -> int:
    """Keys each query sees by the rules: a canvas row its committed keys (the window's last − 1 on a
    sliding layer) and its whole canvas; an encoder row the keys at or before it (inside the window)."""
    total = 0
    for kind, start, fed in shapes:
        committed = start if group == FULL else min(start, WINDOW - 1)
        for i in range(fed):
            if kind == CANVAS:
                total += committed + fed
            else:
                total += start + i + 1 if group == FULL else min(start + i + 1, WINDOW)
    return total


@pytest.mark.parametrize("name, group, kv_heads, dim", CASES, ids=IDS)
def test_every_visible_key_lies_in_a_block_its_tile_lists(name, group, kv_heads, dim):
    forward = make_forward(BATCHES[name], kv_heads, dim)
    _, meta = attend(GemmaFlexAttention(compiled=False), forward, group)
    plan = meta.groups[group]
    host, mask = plan_flex(meta, plan), plan.backend["flex"]["block_mask"]
    rows, keys = host["num_rows"], host["num_keys"]
    dense = mask.mask_mod(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long),
                          torch.arange(rows)[:, None], torch.arange(keys)[None, :])
    assert int(dense.sum()) == _expected_visible(BATCHES[name], group)
    listed = torch.zeros(host["tiles"], keys // KEY_BLOCK, dtype=torch.bool)
    for tile, n in enumerate(host["kv_num_blocks"]):
        blocks = host["kv_indices"][tile * host["width"]: tile * host["width"] + n]
        assert len(set(blocks)) == n
        listed[tile, blocks] = True
    needed = dense.view(rows, keys // KEY_BLOCK, KEY_BLOCK).any(-1)  # [row, block]: the row sees a key of it
    assert not (needed & ~listed.repeat_interleave(FLEX_TILE, 0)[:rows]).any()


def test_a_missing_block_changes_the_compiled_result(monkeypatch):
    """The compiled kernel reads only the listed blocks: drop the last of each tile and the result
    changes (so the coverage test above checks what matters)."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("compiled FlexAttention on the CPU needs a C++ compiler")
    forward = make_forward(BATCHES["commit_beside_canvases"], 1, 32)
    want, _ = attend(GemmaTorchAttention(), forward, FULL)
    got, _ = attend(GemmaFlexAttention(compiled=True), forward, FULL)
    # inductor's CPU kernel: float32 with its own exp and summation order
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    import engine.model.families.diffusion_gemma.flex_attention as flex

    def drops_last_block(meta, plan):
        host = plan_flex(meta, plan)
        host["kv_num_blocks"] = [n - 1 for n in host["kv_num_blocks"]]
        return host

    monkeypatch.setattr(flex, "plan_flex", drops_last_block)
    broken, _ = attend(GemmaFlexAttention(compiled=True), forward, FULL)
    assert not torch.allclose(broken, want, atol=1e-2)


def test_a_compiled_kernel_that_fails_hands_over_to_the_torch_reference(caplog):
    """Where the compiled kernel cannot be built, the torch reference serves from the failing call on
    (logged); an eager failure is a bug and propagates."""
    def broken(*args, **kwargs):
        raise RuntimeError("no C compiler")

    forward = make_forward(BATCHES["commit_beside_canvases"], 2, 16)
    want, _ = attend(GemmaTorchAttention(), forward, SLIDING)
    backend = GemmaFlexAttention(compiled=True)
    backend.fn = broken
    with caplog.at_level("ERROR", logger="engine.model.families.diffusion_gemma.flex_attention"):
        got, _ = attend(backend, forward, SLIDING)
    torch.testing.assert_close(got, want, **TOL)
    assert "compiled FlexAttention failed on a diffusion_gemma model (RuntimeError: no C compiler)" in caplog.text
    assert backend.name == "torch (compiled flex failed)"
    again, _ = attend(backend, forward, SLIDING)  # prepared and attended by the torch reference from now on
    torch.testing.assert_close(again, want, **TOL)
    eager = GemmaFlexAttention(compiled=False)
    eager.fn = broken
    with pytest.raises(RuntimeError, match="no C compiler"):
        attend(eager, forward, SLIDING)
