"""CPU linear layers (ops/cpu_linear.py): the packed weight gives `F.linear`'s values at every row
count, bit-identical rows whatever the batch size, an exact `state_dict()`, tying kept, and a clean
fallback where no packed weight is made."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ops.cpu_linear import PackedLinear, convert_for_cpu, pack_weight


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
    dense = lin.weight.detach().clone()
    PackedLinear.convert(lin)
    assert isinstance(lin, PackedLinear)
    assert lin.packed is not None  # this CPU build has oneDNN: the packed kernel is what runs
    assert lin.weight is None  # the packed copy replaced the dense weight ...
    assert torch.equal(lin.state_dict()["weight"], dense)  # ... and state_dict() unpacks it exactly
    assert _close(lin(x), want)
    assert _close(lin(x.view(1, rows, 96)), want.view(1, rows, 80))  # leading dims kept
    assert lin(x[:0]).shape == (0, 80)


@pytest.mark.parametrize("shape", [(80, 96), (1536, 512), (151_936, 64)])
def test_packed_rows_do_not_depend_on_the_batch(shape):
    """A row's output bits are the same at every batch size (F.linear changes kernel below 4 rows)."""
    torch.manual_seed(1)
    lin = nn.Linear(shape[1], shape[0], bias=False)
    PackedLinear.convert(lin)
    x = torch.randn(40, shape[1])
    with torch.no_grad():
        full = lin(x)
        for rows in (1, 2, 3, 4, 5, 17, 39):
            assert torch.equal(lin(x[:rows]), full[:rows]), rows
            assert torch.equal(lin(x[rows - 1 : rows + 1]), full[rows - 1 : rows + 1]), rows


def test_tied_weight_keeps_its_dense_copy():
    embed = nn.Embedding(1000, 64)
    model = nn.ModuleDict({"embed": embed, "head": nn.Linear(64, 1000, bias=False)})
    model["head"].weight = embed.weight
    x = torch.randn(6, 64)
    want = x @ embed.weight.detach().t()
    convert_for_cpu(model, shared=(embed.weight,))
    head = model["head"]
    assert type(head) is PackedLinear and head.packed is not None
    assert head.weight is embed.weight  # still tied: the embedding reads the dense rows
    assert _close(head(x), want)


def test_no_packed_weight_falls_back_to_f_linear():
    lin = nn.Linear(32, 16).double()  # only float32 weights are packed
    assert pack_weight(lin.weight.data) is None
    x = torch.randn(6, 32, dtype=torch.float64)
    want = lin(x)
    PackedLinear.convert(lin)
    assert lin.packed is None and lin.weight is not None and torch.equal(lin(x), want)
