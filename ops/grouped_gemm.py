"""Rows in groups, each group through its own weight matrix in one call: a MoE layer's routed experts.

Run as a Python loop, an expert costs a handful of kernel launches; on a GPU the launches of 128
experts x 30 layers set a forward's time (608 ms per DiffusionGemma canvas forward on an H200, where
reading the weights takes ~10 ms). `torch._grouped_mm` does every group in one kernel and takes the
group boundaries as a device tensor, so nothing waits on the host. Its CPU implementation runs a
GEMM per group, bit for bit what `F.linear` gives per group (the reference tests rely on that).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_failed_on: set[str] = set()  # device types whose grouped kernel raised once: the loop serves from then on


def group_ends(groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """The cumulative row count per group (int32 [num_groups], what `grouped_linear` takes) of rows whose
    group ids are `groups`: `bincount(...).cumsum(0)` without its host sync (CUDA's bincount reads the
    largest id back to size its output, which a CUDA graph capture refuses). Integer counts: identical."""
    counts = torch.zeros(num_groups, dtype=torch.int64, device=groups.device)
    counts.scatter_add_(0, groups.reshape(-1).long(), torch.ones_like(groups.reshape(-1), dtype=torch.int64))
    return counts.cumsum(0).to(torch.int32)


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """`rows` [N, in] sorted by group, group g being `rows[ends[g-1]:ends[g]]`, each through its own
    `weight[g]` ([G, out, in], as `F.linear` takes it) -> [N, out]. `ends` is int32 [G], cumulative.

    One grouped GEMM where torch has one for this device and dtype (the CPU; CUDA in bfloat16 on
    Hopper or newer), else one `F.linear` per non-empty group (which reads `ends` on the host)."""
    if _grouped_kernel_serves(rows):
        try:
            return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=ends)
        except RuntimeError as error:  # a build without this kernel for the device: the loop is exact too
            log.error("torch._grouped_mm failed on %s (%s); routed experts run one GEMM each from now on",
                      rows.device.type, error)
            _failed_on.add(rows.device.type)
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    start = 0
    for group, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = F.linear(rows[start:end], weight[group])
        start = end
    return out


def _grouped_kernel_serves(rows: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or rows.device.type in _failed_on:
        return False
    if rows.device.type == "cpu":
        return True
    return (rows.device.type == "cuda" and rows.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(rows.device) >= (9, 0))
