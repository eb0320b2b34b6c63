"""`attention_backend` resolved to a backend: the fastest that can run here, and why the others cannot."""

from __future__ import annotations

import logging

import torch

from ops.attention.base import AttentionBackend
from ops.attention.flash import FlashAttention, usable_flash_kernel
from ops.attention.flex import FlexAttention, flex_unmet
from ops.attention.torch_reference import TorchAttention

log = logging.getLogger(__name__)


def make_attention_backend(name: str, device: torch.device, dtype: torch.dtype, page_size: int,
                           head_dim: int) -> AttentionBackend:
    """The backend for `EngineConfig.attention_backend`: `torch` always; `flash` when an installed
    kernel can run these settings, `flex` on any device (compiled where it can serve, eager
    elsewhere), else a ValueError naming every unmet condition; `auto` the fastest that can run --
    flash, then compiled flex, then torch -- logging which and why."""
    if name == "torch":
        return TorchAttention()
    if name == "flex":
        return FlexAttention(compiled=not flex_unmet(device), dynamic=True)
    kernel, unmet = usable_flash_kernel(device, dtype, page_size, head_dim)
    if name == "flash" and kernel is None:
        raise ValueError("attention_backend='flash' cannot run: " + "; ".join(unmet)
                         + ". Use attention_backend='torch' or 'auto'")
    if kernel is not None:
        log.info("attention backend: flash (%s, key lengths by %s)", kernel.source, kernel.key_lengths)
        return FlashAttention(kernel)
    flex_reasons = flex_unmet(device)
    if not flex_reasons:
        log.info("attention backend: flex, compiled (flash not used: %s)", "; ".join(unmet))
        return FlexAttention(compiled=True, dynamic=True)
    log.info("attention backend: torch (flash not used: %s; flex not used: %s)", "; ".join(unmet),
             "; ".join(flex_reasons))
    return TorchAttention()
