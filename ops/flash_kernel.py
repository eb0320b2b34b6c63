"""The installed flash-attention varlen kernel, which of its two API shapes it has, and what it can run.

Two packages ship the same FlashAttention-2 paged varlen kernel under the name
`flash_attn_varlen_func`, with different ways of giving each entry's key count when the keys are read
through `block_table`:

* `vllm.vllm_flash_attn` (bundled with current vllm): keys counted by `seqused_k` [batch] int32; with a
  `block_table` it asserts `seqused_k` is given and refuses `cu_seqlens_k` alongside it.
* `vllm_flash_attn` (the standalone `vllm-flash-attn` 2.6.x wheel): no `seqused_k` parameter; keys
  counted by `cu_seqlens_k` [batch + 1] int32 (entry b has `cu[b + 1] - cu[b]` keys).

The shape is read from the imported function's signature, not from where it was imported, so a
package that changes its API is still called the way it accepts.

A CUDA build of torch carries a third copy of the same kernel, `aten._flash_attention_forward`, with
`seqused_k` and `block_table` (`torch.nn.attention.varlen` calls it). `TORCH_KERNEL` wraps it in the
bundled kernel's calling convention. Its paged path is upstream FlashAttention-2's: pages must hold a
multiple of 256 tokens (vllm's copies relaxed that to 16), and it checks `cu_seqlens_k` for shape
even when `seqused_k` counts the keys, so the wrapper passes both.

What both kernels refuse (their C++ `mha_varlen_fwd` checks), and so what the flash backend needs:
fp16/bf16 q/k/v, a paged cache whose page size is a multiple of 16, head_dim <= 256. The bundled one
also requires head_dim % 8 == 0; the 2.6 wheel would instead pad q, k and v to a multiple of 8 on
every call -- with a paged cache that copies the whole cache per layer per forward -- so both need it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

KeyLengths = Literal["seqused_k", "cu_seqlens_k"]

FLASH_DTYPES = (torch.float16, torch.bfloat16)
PAGE_MULTIPLE = 16
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8


@dataclass(frozen=True)
class FlashKernel:
    """`flash_attn_varlen_func` as imported, with the argument that carries per-entry key counts."""

    fn: Callable[..., torch.Tensor]
    source: str  # the module it was imported from, for logs and errors
    key_lengths: KeyLengths
    page_multiple: int = PAGE_MULTIPLE  # tokens per KV page must be a multiple of this


def key_lengths_argument(fn: Callable[..., torch.Tensor]) -> KeyLengths:
    """`seqused_k` where the function takes it (vllm's bundled kernels), else `cu_seqlens_k`."""
    return "seqused_k" if "seqused_k" in inspect.signature(fn).parameters else "cu_seqlens_k"


def find_flash_kernel() -> FlashKernel | None:
    """The first of vllm's bundled kernels and the standalone wheel that imports, or None."""
    for source in ("vllm.vllm_flash_attn", "vllm_flash_attn"):
        try:
            fn = importlib.import_module(source).flash_attn_varlen_func
        except (ImportError, AttributeError):  # absent, or present without its CUDA extension
            continue
        return FlashKernel(fn, source, key_lengths_argument(fn))
    return None


INSTALLED: FlashKernel | None = find_flash_kernel()

TORCH_PAGE_MULTIPLE = 256


def aten_flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens_q: torch.Tensor,
                      seqused_k: torch.Tensor, block_table: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                      softmax_scale: float, causal: bool) -> torch.Tensor:
    """torch's FlashAttention-2 forward called like `vllm.vllm_flash_attn.flash_attn_varlen_func`."""
    cu_seqlens_k = torch.nn.functional.pad(seqused_k.cumsum(0, dtype=torch.int32), (1, 0))
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, causal, False,
        scale=softmax_scale, seqused_k=seqused_k, block_table=block_table)[0]


def find_torch_kernel() -> FlashKernel | None:
    """torch's own paged varlen entry, on a CUDA build whose operator takes `block_table`."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None or not torch.cuda.is_available():
        return None
    if "block_table" not in {a.name for a in op.default._schema.arguments}:
        return None
    return FlashKernel(aten_flash_varlen, "torch.ops.aten._flash_attention_forward", "seqused_k",
                       TORCH_PAGE_MULTIPLE)


TORCH_KERNEL: FlashKernel | None = find_torch_kernel()


def flash_unmet(kernel: FlashKernel | None, device: torch.device, dtype: torch.dtype, page_size: int,
                head_dim: int) -> list[str]:
    """Why the flash backend cannot run with these settings (empty: it can), one reason per condition."""
    unmet = []
    if kernel is None:
        unmet.append("no flash kernel installed (neither vllm.vllm_flash_attn nor vllm_flash_attn imports, and "
                     "torch is not a CUDA build with a paged _flash_attention_forward; "
                     "pip install 'blockserve[cuda]')")
    if device.type != "cuda":
        unmet.append(f"device is {device.type}, the kernel runs on cuda only")
    if dtype not in FLASH_DTYPES:
        unmet.append(f"dtype is {dtype}, the kernel takes float16 or bfloat16 only (set dtype='bfloat16')")
    multiple = PAGE_MULTIPLE if kernel is None else kernel.page_multiple
    if page_size % multiple:
        unmet.append(f"kv_block_size is {page_size}, the paged kernel needs a multiple of {multiple}")
    if head_dim > MAX_HEAD_DIM or head_dim % HEAD_DIM_MULTIPLE:
        unmet.append(f"head_dim is {head_dim}, the kernel needs a multiple of {HEAD_DIM_MULTIPLE} "
                     f"up to {MAX_HEAD_DIM}")
    return unmet
