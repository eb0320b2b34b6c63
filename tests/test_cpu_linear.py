"""CPU linear layouts (ops/cpu_linear.py): same values as `F.linear` at every row count, tying kept,
the kept-output buffer honoured, and a clean fallback where no packed weight is made."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ops.cpu_linear import PACKED_MIN_ROWS, CpuLMHead, PackedLinear, convert_for_cpu, pack_weight


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach(), b.detach()
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 33, 130])
def test_packed_linear_matches_f_linear(bias, rows):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 80, bias=bias)
    x = torch.randn(rows, 96)
    want = lin(x)
    PackedLinear.convert(lin)
    assert isinstance(lin, PackedLinear)
    assert lin.packed is not None  # this CPU build has oneDNN; the layout under test is really used
    assert lin.weight is None  # the packed copy replaced the dense weight
    assert _close(lin(x), want)
    assert _close(lin(x.view(1, rows, 96)), want.view(1, rows, 80))  # leading dims kept


@pytest.mark.parametrize("rows", [1, PACKED_MIN_ROWS - 1, PACKED_MIN_ROWS, 50])
def test_lm_head_matches_and_keeps_tying(rows):
    torch.manual_seed(0)
    embed = nn.Embedding(1000, 64)
    head = nn.Linear(64, 1000, bias=False)
    head.weight = embed.weight  # tied, as in the model
    ids = torch.tensor([3, 999, 0, 512])
    emb_before = embed(ids).clone()
    x = torch.randn(rows, 64)
    want = x @ embed.weight.detach().t()
    CpuLMHead.convert(head)
    assert head.weight is embed.weight and head.weight.shape == (1000, 64)
    assert torch.equal(embed(ids), emb_before)  # the transposed storage serves the row gather too
    assert head.weight.t().is_contiguous()
    with torch.no_grad():
        assert _close(head(x), want)
        buf = torch.empty(rows, 1000)
        head.out_buffer = lambda n, like: buf[:n]
        out = head(x)
        head.out_buffer = None
    assert _close(out, want)
    if rows < PACKED_MIN_ROWS:
        assert out.data_ptr() == buf.data_ptr()  # few rows: written into the kept buffer


def test_convert_for_cpu_converts_every_linear():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 40, bias=False))
    x = torch.randn(5, 8)
    want = model(x)
    convert_for_cpu(model, model[2])
    assert type(model[0]) is PackedLinear and type(model[2]) is CpuLMHead
    assert _close(model(x), want)
    assert model(x[:0]).shape == (0, 40) and model[0](x[:0]).shape == (0, 16)


def test_no_packed_weight_falls_back_to_f_linear():
    lin = nn.Linear(32, 16).double()  # only float32 weights are packed
    assert pack_weight(lin.weight.data) is None
    x = torch.randn(6, 32, dtype=torch.float64)
    want = lin(x)
    PackedLinear.convert(lin)
    assert lin.packed is None and torch.equal(lin(x), want)
