"""`ops.grouped_gemm.grouped_linear`, the routed experts' GEMMs of every MoE family: bit for bit what a
GEMM per group gives (the HF reference tests of the MoE families rely on it), a number of kernels that
does not grow with the number of experts hit (what sets a MoE forward's time on a GPU), and the loop
taking over where the grouped kernel fails."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from ops import grouped_gemm
from ops.grouped_gemm import grouped_linear


def groups(counts: list[int], width: int = 24, out: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(sum(counts), width, generator=g)
    weight = torch.randn(len(counts), out, width, generator=g)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    return rows, weight, ends


def per_group(rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    starts = [0, *ends.tolist()[:-1]]
    return torch.cat([F.linear(rows[s:e], weight[g]) for g, (s, e) in enumerate(zip(starts, ends.tolist()))])


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 7], [1] * 16, [9, 0, 0, 0]])
def test_equals_a_gemm_per_group_bit_for_bit(counts):
    rows, weight, ends = groups(counts)
    assert torch.equal(grouped_linear(rows, weight, ends), per_group(rows, weight, ends))


def test_the_kernels_do_not_grow_with_the_experts_hit():
    """Four experts hit or sixty-four: the same calls from Python into aten (a loop costs a few per
    expert; on a GPU each is a kernel launch). Calls that aten makes itself are not counted: the CPU
    implementation of the grouped kernel runs a GEMM per group inside one call."""
    def calls(counts: list[int]) -> int:
        rows, weight, ends = groups(counts)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            grouped_linear(rows, weight, ends)
        return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)

    assert calls([2] * 4 + [0] * 60) == calls([2] * 64)


def test_a_failing_grouped_kernel_hands_over_to_the_loop(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no grouped kernel for this device")

    monkeypatch.setattr(torch, "_grouped_mm", broken)
    monkeypatch.setattr(grouped_gemm, "_failed_on", set())
    rows, weight, ends = groups([3, 0, 5, 1])
    with caplog.at_level(logging.ERROR, logger="ops.grouped_gemm"):
        assert torch.equal(grouped_linear(rows, weight, ends), per_group(rows, weight, ends))
    assert "torch._grouped_mm failed on cpu" in caplog.text
    assert grouped_gemm._failed_on == {"cpu"}
    caplog.clear()
    assert torch.equal(grouped_linear(rows, weight, ends), per_group(rows, weight, ends))
    assert not caplog.text  # said once; the loop serves from then on


@pytest.mark.parametrize("num_groups", [1, 7, 64])
def test_group_ends_equal_bincount_without_a_host_sync(num_groups):
    """The routed experts' group boundaries, counted by `scatter_add_` (a CUDA graph can capture it; CUDA's
    `bincount` reads its largest id back to the host first): the same integers as `bincount`, empty
    groups and all."""
    g = torch.Generator().manual_seed(num_groups)
    for shape in [(1, 1), (5, 2), (40, 8)]:
        ids = torch.randint(0, max(1, num_groups // 2), shape, generator=g)  # some groups stay empty
        expected = torch.bincount(ids.flatten(), minlength=num_groups).cumsum(0).to(torch.int32)
        ends = grouped_gemm.group_ends(ids, num_groups)
        assert ends.dtype == torch.int32 and torch.equal(ends, expected)
