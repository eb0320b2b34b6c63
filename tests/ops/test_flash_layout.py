"""The flash backend against the torch reference, through both kernel API shapes.

`FlashAttention` turns a batch into varlen entries (one causal entry per AR sequence; one non-causal
entry per DLLM block of queries, seeing keys up to that block's end), page tables and key counts
(`seqused_k` for vllm's bundled kernel, `cu_seqlens_k` for the 2.6 wheel). It runs here through the
substitutes of tests/ops/test_flash_kernels.py, which refuse what the real kernels refuse, on bfloat16
inputs; the reference runs in float32 on the same bfloat16 values, so the two differ by the output's
bfloat16 rounding only. First hand-made batches, then every forward of real engine runs (chunked
prefill, DLLM denoising steps, fused commit + next block, AR decode, scoring).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import EngineConfig, GenerationConfig, pipeline
from ops.attention import AttentionBackend, AttentionMetadata, FlashAttention, TorchAttention
from ops.flash_kernel import FlashKernel
from tests.support.flash_kernels import KERNELS

PAGE, HEADS, KV_HEADS, DIM = 16, 4, 2, 8
BF16 = torch.bfloat16

# (tokens already cached, tokens fed now) per sequence
AR_BATCHES = {
    "prefill": [(0, 40), (0, 7)],
    "prefill_chunk_and_decode": [(16, 24), (37, 1), (5, 1), (0, 3)],
    "decode": [(37, 1), (5, 1), (16, 1), (63, 1)],
}
DLLM_BATCHES = {  # block length 4
    "prefill_chunks": [(0, 32), (16, 16)],
    "denoising_steps": [(32, 4), (20, 4), (0, 4)],
    "commit_and_next_block": [(28, 8), (4, 8)],
    "mixed": [(16, 16), (28, 8), (40, 4), (0, 4)],
}


def run_backends(kernel: FlashKernel, shapes: list[tuple[int, int]], block_length: int | None, seed: int = 0):
    """One forward of `shapes` through FlashAttention (bf16) and TorchAttention (float32 of the same values)."""
    g = torch.Generator().manual_seed(seed)
    num_pages = 40
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables, slots, positions = [], [], []
    width = max(-(-(cached + fed) // PAGE) for cached, fed in shapes) + 1  # one spare column of padding
    for cached, fed in shapes:
        table = [perm.pop() for _ in range(-(-(cached + fed) // PAGE))]
        tables.append(table + [0] * (width - len(table)))
        positions += range(cached, cached + fed)
        slots += [table[p // PAGE] * PAGE + p % PAGE for p in range(cached, cached + fed)]
    total = len(positions)
    q = torch.randn(total, HEADS, DIM, generator=g).to(BF16)
    k = torch.randn(total, KV_HEADS, DIM, generator=g).to(BF16)
    v = torch.randn(total, KV_HEADS, DIM, generator=g).to(BF16)
    # every page starts as large garbage: a key read from the wrong page changes the result
    cache = (torch.randn(2, num_pages, PAGE, KV_HEADS, DIM, generator=g) * 30).to(BF16)

    def run(backend: AttentionBackend, dtype: torch.dtype) -> torch.Tensor:
        meta = AttentionMetadata(q_lens=[fed for _, fed in shapes], kv_lens=[c + f for c, f in shapes],
                                 positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
                                 page_tables=torch.tensor(tables), page_size=PAGE, dllm_block_length=block_length)
        k_cache, v_cache = cache[0].to(dtype), cache[1].to(dtype)
        backend.prepare(meta)
        return backend.forward(q.to(dtype), k.to(dtype), v.to(dtype), k_cache, v_cache, meta, DIM**-0.5)

    return run(FlashAttention(kernel), BF16), run(TorchAttention(), torch.float32)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("batch", AR_BATCHES)
def test_ar_batches_match_reference(kernel, batch):
    flash, reference = run_backends(KERNELS[kernel], AR_BATCHES[batch], None)
    assert flash.dtype == BF16
    torch.testing.assert_close(flash, reference.to(BF16))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("batch", DLLM_BATCHES)
def test_dllm_batches_match_reference(kernel, batch):
    flash, reference = run_backends(KERNELS[kernel], DLLM_BATCHES[batch], 4)
    torch.testing.assert_close(flash, reference.to(BF16))


def test_causal_layout_on_a_dllm_batch_would_not_match():
    """The comparison sees the mask: the same DLLM batch attended causally differs from block-causal."""
    flash, _ = run_backends(KERNELS["bundled"], DLLM_BATCHES["denoising_steps"], None)
    _, reference = run_backends(KERNELS["bundled"], DLLM_BATCHES["denoising_steps"], 4)
    assert not torch.allclose(flash.float(), reference, atol=0.05)


# ---- every forward of real engine runs -------------------------------------------------------------------------
class Compared(AttentionBackend):
    """The engine runs on the torch reference; in every layer of every forward the flash backend also
    attends over the same query and caches in bfloat16 and must agree with the reference run on those
    bfloat16 values. Records each forward's (q_lens, kv_lens)."""

    name = "compared"

    def __init__(self, kernel: FlashKernel):
        self.reference, self.flash = TorchAttention(), FlashAttention(kernel)
        self.forwards: list[list[tuple[int, int]]] = []
        self.layers = 0

    def prepare(self, meta: AttentionMetadata) -> None:
        self.forwards.append(list(zip(meta.q_lens, meta.kv_lens)))
        self.flash_meta = dataclasses.replace(meta, extra=None, plan=None, planned=None)  # flash plans its own
        self.flash.prepare(self.flash_meta)
        self.reference.prepare(meta)

    def attend(self, q, k_cache, v_cache, meta, scale):
        q16, k16, v16 = q.to(BF16), k_cache.to(BF16), v_cache.to(BF16)
        got = self.flash.attend(q16, k16, v16, self.flash_meta, scale)
        want = self.reference.attend(q16.float(), k16.float(), v16.float(), meta, scale)
        torch.testing.assert_close(got, want.to(BF16), msg=lambda m: f"forward {len(self.forwards)}: {m}")
        self.layers += 1
        return self.reference.attend(q, k_cache, v_cache, meta, scale)


def run_compared(path: str, kernel: FlashKernel, prompts, gen: GenerationConfig, **engine) -> list[list[tuple]]:
    config = EngineConfig(kv_block_size=16, num_kv_blocks=64, max_model_len=256, max_prefill_token_num=24,
                          **engine)
    with pipeline(path, engine_config=config) as pipe:
        compared = Compared(kernel)
        pipe.engine.executor.runner.backend = compared
        outs = pipe(prompts, gen_config=gen)
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert compared.layers == len(compared.forwards) * pipe.engine.spec.num_hidden_layers
    return compared.forwards


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kernel", KERNELS)
def test_engine_dllm_forwards_match_reference(dllm_ckpt, kernel):
    forwards = run_compared(dllm_ckpt, KERNELS[kernel], prompts([30, 9, 17], seed=1),
                            GenerationConfig(max_new_tokens=12, ignore_eos=True), dllm_block_length=4)
    rows = [row for f in forwards for row in f]
    assert any(q > 4 and q % 4 == 0 and kv > q for q, kv in rows), "a prefill chunk after an earlier one"
    assert any(q == 4 and kv > 4 for q, kv in rows), "a denoising step over a cached prefix"
    assert any(q == 8 and kv > 8 for q, kv in rows), "a fused commit + next block"
    assert any(len(f) > 1 for f in forwards), "several sequences in one forward"


@pytest.mark.parametrize("kernel", KERNELS)
def test_engine_ar_forwards_match_reference(ar_ckpt, kernel):
    forwards = run_compared(ar_ckpt, KERNELS[kernel], prompts([40, 5, 21], seed=2),
                            GenerationConfig(max_new_tokens=6, ignore_eos=True))
    rows = [row for f in forwards for row in f]
    assert any(1 < q < kv for q, kv in rows), "a prefill chunk after an earlier one"
    assert any(q == 1 for q, _ in rows), "a decode row"
    assert any(len({q == 1 for q, _ in f}) == 2 for f in forwards), "decode rows next to a prefill chunk"


@pytest.mark.parametrize("kernel", KERNELS)
def test_engine_scoring_forwards_match_reference(ar_ckpt, kernel):
    forwards = run_compared(ar_ckpt, KERNELS[kernel], prompts([50, 33], seed=3),
                            GenerationConfig(max_new_tokens=0, logprob_start_len=10, logprobs=0),
                            logprobs_mode="raw_logprobs", enable_prefix_caching=False)
    assert sum(q for f in forwards for q, _ in f) == 83, "every input token went through attention"
