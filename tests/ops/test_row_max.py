"""`ops.layers.row_max` equals `x.max(-1)` exactly: values, first index on ties, short last chunk."""

from __future__ import annotations

import pytest
import torch

from ops.layers import row_max


@pytest.mark.parametrize("n", [100, 384, 1000, 1030, 4096, 8193, 20_000, 151_936])
@pytest.mark.parametrize("chunk", [None, 2048])
def test_row_max_equals_torch_max(n, chunk):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(max(7, 70_000 // n), n, generator=g)  # enough rows for the chunked search
    x[1, -1] = 50.0  # maximum in the short last chunk
    x[2, :] = 3.0  # all tied: first index
    x[3, 5000 % n] = x[3, (n - 1)] = 60.0  # tie across chunks: the earlier one
    x[4, 0] = 70.0
    x[5] = x[5].softmax(-1)  # probabilities, as the sampler passes them
    x[6, 40 % n] = x[6, 41 % n] = 80.0  # tie inside a chunk
    want_v, want_i = x.max(-1)
    got_v, got_i = row_max(x, chunk)
    assert torch.equal(got_v, want_v) and torch.equal(got_i, want_i)


def test_row_max_no_rows():
    v, i = row_max(torch.empty(0, 151_936))
    assert v.shape == (0,) and i.shape == (0,)
