"""The paged varlen FlashAttention-2 kernel (vllm's bundled copy, the vllm-flash-attn wheel, or torch's
own), reading the cache through `block_table`."""

from __future__ import annotations

from itertools import accumulate

import torch

from ops import flash_kernel
from ops.attention.base import AttentionBackend, AttentionMetadata, StepPlan, planned
from ops.flash_kernel import FlashKernel, flash_unmet


class FlashAttention(AttentionBackend):
    """The paged varlen FlashAttention kernel (CUDA; fp16/bf16; page size a multiple of 16)."""

    name = "flash"

    def __init__(self, kernel: FlashKernel):
        self.kernel = kernel

    def plan(self, q_lens: list[int], kv_lens: list[int], page_tables: list[list[int]], page_size: int,
             block_length: int | None, pad_tiles: int | None = None, bidirectional: list[bool] | None = None
             ) -> StepPlan:
        """One varlen entry per sequence when every row is causal. Otherwise the kernel runs non-causally
        (one flag for the call), so each entry is a run of query rows that see the same keys: a block of
        a block-causal sequence (keys to its end), a bidirectional sequence whole (keys to its length),
        each row of a causal sequence alone (keys to its own position)."""
        b = block_length
        bidirectional = bidirectional or [False] * len(q_lens)
        entry_q, k_lens, tables, causal = [], [], [], b is None and not any(bidirectional)
        for s, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
            if causal or bidirectional[s]:
                entry_q.append(q_len)
                k_lens.append(kv_len)
                tables.append(s)
                continue
            pos = kv_len - q_len
            while pos < kv_len:
                block_end = pos + 1 if b is None else min((pos // b + 1) * b, kv_len)
                entry_q.append(block_end - pos)
                k_lens.append(block_end)
                tables.append(s)
                pos = block_end
        key_lengths = k_lens if self.kernel.key_lengths == "seqused_k" else [0, *accumulate(k_lens)]
        return StepPlan(arrays={"cu_seqlens_q": [0, *accumulate(entry_q)], "key_lengths": key_lengths,
                                "table_rows": tables},
                        scalars={"max_seqlen_q": max(entry_q), "max_seqlen_k": max(k_lens), "causal": causal})

    def prepare(self, meta: AttentionMetadata) -> None:
        arrays = planned(self, meta)
        meta.extra = {
            "cu_seqlens_q": arrays["cu_seqlens_q"].to(torch.int32),
            self.kernel.key_lengths: arrays["key_lengths"].to(torch.int32),
            "block_table": meta.page_tables[arrays["table_rows"]].to(torch.int32),
            **meta.plan.scalars,
        }

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        return self.kernel.fn(q, k_cache, v_cache, softmax_scale=scale, **meta.extra)


def usable_flash_kernel(device: torch.device, dtype: torch.dtype, page_size: int, head_dim: int
                        ) -> tuple[FlashKernel | None, list[str]]:
    """The first of vllm's flash kernels and torch's own that can run these settings, or None and why
    none can (each reason once, prefixed by its kernel when there are two)."""
    kernels = [k for k in (flash_kernel.INSTALLED, flash_kernel.TORCH_KERNEL) if k is not None]
    if not kernels:
        return None, flash_unmet(None, device, dtype, page_size, head_dim)
    reasons = []
    for kernel in kernels:
        unmet = flash_unmet(kernel, device, dtype, page_size, head_dim)
        if not unmet:
            return kernel, []
        reasons += [f"{kernel.source}: {r}" if len(kernels) > 1 else r for r in unmet]
    return None, reasons
