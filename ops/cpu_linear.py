"""Linear layers on CPU, laid out for the GEMM that reads them fastest.

On CPU a decode step is a handful of rows through every weight, and how a weight is laid out decides
its speed far more than its FLOPs. Measured on one core (AVX-512, torch 2.13, float32, best of 5-21):

| GEMM | rows | `F.linear` | oneDNN pre-packed | `torch.mm`, weight in [in, out] order |
|---|---|---|---|---|
| LM head 512 x 151,936 | 1 | 33.6 ms | 22-27 ms | 15.4 ms |
| | 20 | 83.2 ms | 39-61 ms | 71.4 ms |
| | 32 | 110 ms | 54-82 ms | 95 ms |
| | 85 | 291 ms (96 rows) | 130-165 ms | 195-222 ms |
| MLP down 1536 -> 512 | 2 | 160 us | 75 us | |
| | 20 | 471 us | 326 us | |
| | 512 | 8.55 ms | 7.80 ms | |

So every projection runs on a oneDNN pre-packed copy of its weight (`torch.ops.mkldnn.
_reorder_linear_weight`, what torch.compile's CPU freezing uses), and the LM head, below
`PACKED_MIN_ROWS` rows, on its weight stored in [hidden, vocab] memory order (the parameter stays a
[vocab, hidden] view: same shape, values and tying; a tied embedding's row gather becomes strided,
~15 ms per 2,048 prompt tokens against ~1 s of layer compute for them). A projection's packed copy
replaces its dense weight; the LM head keeps both (one more copy of it in memory). Values agree with
`F.linear` to float32 rounding (relative 1e-6: the summation order differs); each packed weight is
checked against `torch.mm` once and left out if it disagrees or the op is missing (then `F.linear`
runs, as on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

PACKED_MIN_ROWS = 4  # LM head: fewer rows run on the [hidden, vocab] layout
PACKED_BATCH_HINT = 32  # oneDNN chooses its blocking for about this many rows (8-85 rows measured)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's pre-packed copy of a [out, in] float32 CPU weight, or None where that is unavailable."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_BATCH_HINT)
        probe = torch.randn(PACKED_MIN_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0))
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return None
    want = torch.mm(probe, weight.t())
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
        return None
    return packed


class PackedLinear(nn.Linear):
    """`nn.Linear` that multiplies with a oneDNN pre-packed copy of its weight when it has one; the
    packed copy then replaces the dense weight (`weight` becomes None), so the layer stack is held once."""

    packed: torch.Tensor | None = None
    keeps_dense_weight = False

    @classmethod
    def convert(cls, linear: nn.Linear) -> None:
        """Turn a loaded CPU `nn.Linear` into this class in place."""
        linear.__class__ = cls
        with torch.no_grad():
            linear.packed = pack_weight(linear.weight.data)
        if linear.packed is not None and not cls.keeps_dense_weight:
            linear.weight = None

    def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return super().forward(x)
        if x.numel() == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        return self._packed_forward(x)


class CpuLMHead(PackedLinear):
    """The LM head: packed from `PACKED_MIN_ROWS` rows, else `torch.mm` on the [hidden, vocab] layout.
    While `out_buffer` is set, that path writes its [rows, vocab] output into the tensor
    `out_buffer(rows, weight)` returns instead of a fresh one (a fresh rows x 151,936 tensor is mapped
    anew each time, and faulting its pages in costs about as much as the softmax that reads it)."""

    out_buffer: Callable[[int, torch.Tensor], torch.Tensor] | None = None
    keeps_dense_weight = True  # the few-rows path and a tied embedding read it

    @classmethod
    def convert(cls, linear: nn.Linear) -> None:
        with torch.no_grad():
            linear.weight.data = linear.weight.data.t().contiguous().t()
        super().convert(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] == 0 or self.bias is not None:
            return nn.Linear.forward(self, x)
        if self.packed is not None and x.shape[0] >= PACKED_MIN_ROWS:
            return self._packed_forward(x)
        out = None if self.out_buffer is None else self.out_buffer(x.shape[0], self.weight)
        return torch.mm(x, self.weight.t(), out=out)


def convert_for_cpu(model: nn.Module, lm_head: nn.Linear) -> None:
    """Give every plain `nn.Linear` of a loaded CPU model its packed weight, and `lm_head` the LM-head
    layouts above."""
    for module in model.modules():
        if type(module) is nn.Linear:
            (CpuLMHead if module is lm_head else PackedLinear).convert(module)
