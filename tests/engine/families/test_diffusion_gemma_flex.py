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

from engine.model.families.diffusion_gemma.attention import CANVAS, GemmaTorchAttention
from engine.model.families.diffusion_gemma.config import FULL, SLIDING
from engine.model.families.diffusion_gemma.flex_attention import KEY_BLOCK, GemmaFlexAttention, plan_flex
from ops.attention import FLEX_TILE
from tests.support.gemma_attention import BATCHES, CASES, IDS, WINDOW, attend, make_forward

TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(autouse=True)
def _quiet_eager_flex():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


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
