"""DiffusionGemma's passes on the project's Triton kernel (its PASSES mode, under Triton's interpreter)
against the torch reference, attention alone, in float32 on the CPU: the forwards the FlexAttention
tests use -- prefills, canvases inside and beyond the sliding window, a commit beside canvases, a
chunk after a long context, one-row passes, a canvas over three tiles -- on a sliding group (its pages
before the window freed: the kernel must never read them) and a full group, at the tiny model's head
sizes and the release's (256 sliding, 512 full). The engine's outputs on this backend are checked
against transformers in test_diffusion_gemma_decoding.py."""

from __future__ import annotations

import pytest
import torch

from engine.model.families.diffusion_gemma.attention import GemmaTorchAttention
from engine.model.families.diffusion_gemma.config import FULL, SLIDING, GemmaSpec, LayerGeometry
from engine.model.families.diffusion_gemma.triton_attention import GemmaTritonAttention
from tests.support.gemma_attention import BATCHES, CASES, IDS, attend, make_forward

HEADS = 4  # tests/support/gemma_attention.py's query heads
TOL = {"atol": 2e-6, "rtol": 0}


def scaled(forward, dim: int):
    """The forward with q scaled by 1/sqrt(dim). The network attends unscaled (scale 1.0), its q and k
    RMS-normed to keep the scores in range; unit-normal q and k would give scores of std sqrt(dim) --
    at 512 a softmax of scores in the hundreds, where float32's rounding of one score is ~1e-5."""
    meta, q, k, v, caches = forward
    return meta, q / dim**0.5, k, v, caches


def backend(kv_heads: dict[str, int]) -> GemmaTritonAttention:
    """The Triton backend for a model of HEADS query heads and these K/V heads per layer kind."""
    layers = tuple(LayerGeometry(kind, 16, n, kind == SLIDING, 1e4, 4, 16, 1.0) for kind, n in kv_heads.items())
    spec = GemmaSpec.__new__(GemmaSpec)
    object.__setattr__(spec, "num_attention_heads", HEADS)
    object.__setattr__(spec, "layers", layers)
    return GemmaTritonAttention(spec)


@pytest.mark.parametrize("name, group, kv_heads, dim", CASES, ids=IDS)
def test_the_kernel_equals_the_reference(name, group, kv_heads, dim):
    forward = scaled(make_forward(BATCHES[name], kv_heads, dim), dim)
    want, _ = attend(GemmaTorchAttention(), forward, group)
    got, _ = attend(backend({group: kv_heads}), forward, group)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("group, kv_heads, dim", [(SLIDING, 2, 256), (FULL, 1, 512)])
@pytest.mark.parametrize("name", ["commit_beside_canvases", "canvas_over_three_tiles"])
def test_the_release_head_sizes(name, group, kv_heads, dim):
    forward = scaled(make_forward(BATCHES[name], kv_heads, dim, seed=1), dim)
    want, _ = attend(GemmaTorchAttention(), forward, group)
    got, _ = attend(backend({group: kv_heads}), forward, group)
    # a 512-term dot in another order: 2.3e-6 seen on an output of magnitude ~2, hence a relative term
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-6)


def test_freed_pages_are_never_read():
    """The sliding group's freed pages (-1 in its tables) point nowhere: a read would fault on a GPU and
    raise here; pointed at a page of NaNs instead, they leave the result exactly as it was."""
    forward = scaled(make_forward(BATCHES["chunk_after_a_long_context"], 2, 16), 16)
    meta_of, q, k, v, caches = forward
    want, _ = attend(backend({SLIDING: 2}), forward, SLIDING)
    used = {page for p in meta_of(None).passes for page in p.page_tables[SLIDING]}
    assert -1 in used, "the case has freed pages"
    nobodys = min(set(range(caches[SLIDING].shape[1])) - used)
    poisoned = caches[SLIDING].clone()
    poisoned[:, nobodys] = float("nan")  # a value read, even one masked out of the softmax, spreads

    def meta_with_poisoned_freed_pages(b):
        meta = meta_of(b)
        for p in meta.passes:
            p.page_tables[SLIDING] = [nobodys if page == -1 else page for page in p.page_tables[SLIDING]]
        return meta

    got, _ = attend(backend({SLIDING: 2}), (meta_with_poisoned_freed_pages, q, k, v, {SLIDING: poisoned}), SLIDING)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
