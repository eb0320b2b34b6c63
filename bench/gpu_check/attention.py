"""Part 1, `flash`: each fast attention backend against the torch backend on random page tables."""

from __future__ import annotations

import torch

from bench.gpu_check.settings import BLOCK, PAGE
from ops.attention import AttentionBackend, AttentionMetadata, FlashAttention, FlexAttention, TorchAttention, flex_unmet
from ops.flash_kernel import INSTALLED, TORCH_KERNEL

# (tokens already cached, tokens fed now) per sequence
ATTENTION_BATCHES = {
    "ar": ([(0, 300), (128, 64), (517, 1), (33, 1), (1000, 1)], None),
    "dllm": ([(0, 256), (96, 32), (508, 8), (300, 4), (64, 4)], BLOCK),
}


def backends_to_compare() -> dict[str, AttentionBackend]:
    """Every fast backend this machine can run on CUDA: the flash kernels found and compiled FlexAttention."""
    out: dict[str, AttentionBackend] = {}
    for kernel in (INSTALLED, TORCH_KERNEL):
        if kernel is not None:
            out[f"flash:{kernel.source}"] = FlashAttention(kernel)
    if not flex_unmet(torch.device("cuda")):
        out["flex"] = FlexAttention(compiled=True, dynamic=True)
    return out


def compare_attention(backend: AttentionBackend, device: torch.device, dtype: torch.dtype, heads: int = 16,
                      kv_heads: int = 8, head_dim: int = 128, seed: int = 0, page: int = PAGE) -> dict:
    """Max |backend - torch| per batch: both backends on the same `dtype` inputs, the torch one in float32.
    Pages of `page` tokens (torch's own flash kernel wants 256)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shapes, block_length) in ATTENTION_BATCHES.items():
        pages_needed = [-(-(c + f) // page) for c, f in shapes]
        num_pages = sum(pages_needed) + 8
        perm = torch.randperm(num_pages, generator=g).tolist()
        tables, slots, positions = [], [], []
        for (cached, fed), n in zip(shapes, pages_needed):
            table = [perm.pop() for _ in range(n)]
            tables.append(table + [0] * (max(pages_needed) - n))
            positions += range(cached, cached + fed)
            slots += [table[p // page] * page + p % page for p in range(cached, cached + fed)]
        total = len(positions)
        q, k, v = (torch.randn(total, h, head_dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
        cache = torch.randn(2, num_pages, page, kv_heads, head_dim, generator=g).to(dtype)

        def run(run_backend, run_dtype, shapes=shapes, block_length=block_length, tables=tables, slots=slots,
                positions=positions, q=q, k=k, v=v, cache=cache):
            meta = AttentionMetadata(
                q_lens=[f for _, f in shapes], kv_lens=[c + f for c, f in shapes],
                positions=torch.tensor(positions, device=device), slot_mapping=torch.tensor(slots, device=device),
                page_tables=torch.tensor(tables, device=device), page_size=page, dllm_block_length=block_length)
            k_cache, v_cache = (c.to(device=device, dtype=run_dtype) for c in cache)
            run_backend.prepare(meta)
            x = [t.to(device=device, dtype=run_dtype) for t in (q, k, v)]
            return run_backend.forward(*x, k_cache, v_cache, meta, head_dim**-0.5).float()

        err = (run(backend, dtype) - run(TorchAttention(), torch.float32)).abs().max().item()
        out[name] = {"max_abs_error": err, "ok": err < 2e-2}
    out["ran_as"] = backend.name  # e.g. compiled flex that failed to build and handed over to torch
    return out
