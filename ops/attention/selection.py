"""`attention_backend` resolved to a backend: the fastest that can run here, and why the others cannot."""

from __future__ import annotations

import logging

import torch

from ops.attention.base import AttentionBackend
from ops.attention.flash import FlashAttention, usable_flash_kernel
from ops.attention.flex import FlexAttention, flex_unmet
from ops.attention.torch_reference import TorchAttention
from ops.attention.triton_backend import TritonAttention, require_triton

log = logging.getLogger(__name__)


def make_attention_backend(name: str, device: torch.device, dtype: torch.dtype, page_size: int,
                           head_dim: int, query_group: int = 1) -> AttentionBackend:
    """The backend for `EngineConfig.attention_backend`: `torch` always; `flash` when an installed
    kernel can run these settings, `flex` on any device (compiled where it can serve, eager
    elsewhere), `triton` on CUDA where Triton imports (`query_group`: query heads per K/V head), else a
    ValueError naming every unmet condition; `auto` flash where it can run, else torch, logging which
    and why.

    `auto` does not pick triton yet: it has matched the torch backend on the CPU (under Triton's
    interpreter) but not yet been run on a GPU; it is asked for by name until a device run agrees.

    `auto` never picks flex: on an H200 (torch 2.11, bfloat16) compiled flex gave seeded sampled
    requests other tokens in a batch than alone, where the torch backend gave the same, and it was
    slower than torch at 1 and 32 concurrent (faster at 128); docs/gpu.md has the figures."""
    if name == "torch":
        return TorchAttention()
    if name == "flex":
        return FlexAttention(compiled=not flex_unmet(device), dynamic=True)
    if name == "triton":
        require_triton(device)
        return TritonAttention(query_group)
    kernel, unmet = usable_flash_kernel(device, dtype, page_size, head_dim)
    if name == "flash" and kernel is None:
        raise ValueError("attention_backend='flash' cannot run: " + "; ".join(unmet)
                         + ". Use attention_backend='torch' or 'auto'")
    if kernel is not None:
        log.info("attention backend: flash (%s, key lengths by %s)", kernel.source, kernel.key_lengths)
        return FlashAttention(kernel)
    log.info("attention backend: torch (flash not used: %s; flex only when asked for: "
             "attention_backend='flex')", "; ".join(unmet))
    return TorchAttention()
