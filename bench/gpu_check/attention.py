"""Part 1, `flash`: each fast attention backend against the torch backend on random page tables."""

from __future__ import annotations

import torch

from bench.gpu_check.settings import BLOCK, PAGE, SDAR_4B
from ops.attention import AttentionBackend, AttentionMetadata, FlashAttention, FlexAttention, TorchAttention, flex_unmet
from ops.attention.triton_backend import TritonAttention, triton_unmet
from ops.flash_kernel import INSTALLED, TORCH_KERNEL

# The query and K/V heads of the AR and DLLM batches (SDAR-1.7B's)
HEADS, KV_HEADS = 16, 8
# (tokens already cached, tokens fed now) per sequence, and the DLLM block length (None: causal)
ATTENTION_BATCHES = {
    "ar": ([(0, 300), (128, 64), (517, 1), (33, 1), (1000, 1)], None),
    "dllm": ([(0, 256), (96, 32), (508, 8), (300, 4), (64, 4)], BLOCK),
}
# The triton backend packs the query heads of a K/V head into one tile, so its tiles change with the GQA
# mix: a batch at SDAR-4B's (32 query heads over 8 K/V heads, head 128), mostly denoising steps as at
# its 128 concurrent requests, with a prefill chunk and a fused commit + next block.
SDAR_4B_BATCHES = {
    "dllm_sdar_4b": ([(0, 192), (250, 8), (97, 4), (300, 4), (1020, 4), (12, 4), (640, 4)], BLOCK),
}
SDAR_4B_HEADS = (SDAR_4B.num_attention_heads, SDAR_4B.num_key_value_heads)


def backends_to_compare(device: torch.device | None = None, heads: int = HEADS,
                        kv_heads: int = KV_HEADS) -> dict[str, AttentionBackend]:
    """Every fast backend this machine can run on `device` (default CUDA): the flash kernels found,
    compiled FlexAttention, and the triton kernel, built for `heads` query heads over `kv_heads`."""
    device = device or torch.device("cuda")
    out: dict[str, AttentionBackend] = {}
    for kernel in (INSTALLED, TORCH_KERNEL):
        if kernel is not None:
            out[f"flash:{kernel.source}"] = FlashAttention(kernel)
    if not flex_unmet(device):
        out["flex"] = FlexAttention(compiled=True, dynamic=True)
    if not triton_unmet(device):
        out["triton"] = TritonAttention(query_group=heads // kv_heads)
    return out


def flash_part(device: torch.device, dtype: torch.dtype, head_dim: int = 128,
               heads: tuple[int, int] = (HEADS, KV_HEADS), sdar_4b_heads: tuple[int, int] = SDAR_4B_HEADS) -> dict:
    """Part 1: every backend of `backends_to_compare` on the AR and DLLM batches at `heads` (query, K/V),
    and the triton backend also on the SDAR-4B batch at `sdar_4b_heads`, built for that batch's group."""
    out = {}
    for name, backend in backends_to_compare(device, *heads).items():
        page = 256 if name.startswith("flash:torch") else PAGE  # torch's own flash kernel wants 256
        out[name] = compare_attention(backend, device, dtype, *heads, head_dim=head_dim, page=page)
    if "triton" in out:
        q_heads, kv_heads = sdar_4b_heads
        out["triton"].update(compare_attention(TritonAttention(query_group=q_heads // kv_heads), device, dtype,
                                               q_heads, kv_heads, head_dim=head_dim, batches=SDAR_4B_BATCHES))
    return out or {"skipped": "no fast attention backend on this machine"}


def compare_attention(backend: AttentionBackend, device: torch.device, dtype: torch.dtype, heads: int = HEADS,
                      kv_heads: int = KV_HEADS, head_dim: int = 128, seed: int = 0, page: int = PAGE,
                      batches: dict[str, tuple[list[tuple[int, int]], int | None]] | None = None) -> dict:
    """Max |backend - torch| per batch (default ATTENTION_BATCHES): both backends on the same `dtype`
    inputs, the torch one in float32. Pages of `page` tokens (torch's own flash kernel wants 256). A
    triton backend must be built for `heads // kv_heads` query heads per K/V head."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shapes, block_length) in (batches or ATTENTION_BATCHES).items():
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
