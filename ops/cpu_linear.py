"""Linear layers on CPU: every projection and the LM head on a oneDNN pre-packed weight.

On CPU a decode step is a handful of rows through every weight, and how a weight is laid out decides
its speed more than its FLOPs. Measured on one core (AVX-512, torch 2.13, float32, best of 5-21):

| GEMM | rows | `F.linear` | oneDNN pre-packed |
|---|---|---|---|
| LM head 512 x 151,936 | 1 | 33.6 ms | 22-27 ms |
| | 20 | 83.2 ms | 39-61 ms |
| | 32 | 110 ms | 54-82 ms |
| | 85 | 291 ms (96 rows) | 130-165 ms |
| MLP down 1536 -> 512 | 2 | 160 us | 75 us |
| | 20 | 471 us | 326 us |
| | 512 | 8.55 ms | 7.80 ms |

`torch.ops.mkldnn._reorder_linear_weight` packs a weight once (what torch.compile's CPU freezing
uses) and `_linear_pointwise` multiplies with it. The packed kernels are also batch-invariant: a row's
output is bit-identical whatever else is in the batch (checked at 1-64 rows in tests/ops/test_cpu_linear.py),
while `F.linear` switches kernels below 4 rows, so the same request could get other logits bits
next to other requests. The packed copy replaces the dense weight (`weight` becomes None;
`state_dict()` unpacks it exactly), except where another module reads the dense one (a tied
embedding). Values agree with `F.linear` to float32 rounding (relative 1e-6: the summation order
differs); each packed weight is checked against `torch.mm` once and left out if it disagrees or the
op is missing (then `F.linear` runs, as on CUDA).
"""

from __future__ import annotations

import torch
from torch import nn

PACKED_BATCH_HINT = 32  # oneDNN chooses its blocking for about this many rows (8-85 rows measured)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's pre-packed copy of a [out, in] float32 CPU weight, or None where that is unavailable."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_BATCH_HINT)
        probe = torch.randn(4, weight.shape[1], generator=torch.Generator().manual_seed(0))
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return None
    want = torch.mm(probe, weight.t())
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
        return None
    return packed


class PackedLinear(nn.Linear):
    """`nn.Linear` that multiplies with a oneDNN pre-packed copy of its weight when it has one."""

    packed: torch.Tensor | None = None

    @classmethod
    def convert(cls, linear: nn.Linear, keep_dense: bool = False) -> None:
        """Turn a loaded CPU `nn.Linear` into this class in place; drop the dense weight once packed
        unless `keep_dense` (another module shares it)."""
        linear.__class__ = cls
        with torch.no_grad():
            linear.packed = pack_weight(linear.weight.data)
        if linear.packed is not None and not keep_dense:
            linear.weight = None

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """`state_dict()` still shows the weight, unpacked (`to_dense` restores it bit for bit)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight is None and self.packed is not None:
            destination[prefix + "weight"] = self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return super().forward(x)
        if x.numel() == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])


def convert_for_cpu(model: nn.Module, shared: tuple[torch.Tensor, ...] = ()) -> None:
    """Pack every plain `nn.Linear` of a loaded CPU model; weights in `shared` (read by other modules,
    e.g. a tied embedding) keep their dense copy too."""
    for module in model.modules():
        if type(module) is nn.Linear:
            PackedLinear.convert(module, keep_dense=any(module.weight is w for w in shared))
