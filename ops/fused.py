"""A decoder layer's elementwise work as one set of functions, eager or compiled into fused kernels.

Eagerly a decoder layer runs some 60 small kernels besides its matmuls and attention on CUDA: an
RMSNorm alone is 5-6 (four per layer with the per-head q/k norms), the rotary embedding about 6, and
the residual adds. `compiled_elementwise()` gives the same functions through
`torch.compile(fullgraph=True)`, so that each group becomes one kernel: the residual add with the
norm after it, the q/k norms with the rotary embedding, SiLU times the up projection. Matmuls,
attention and tensor-parallel collectives stay outside the compiled functions, and the default mode
brings no CUDA graphs of its own, so the engine's graph capture records the compiled kernels like
any others. Inductor would compute a bfloat16 chain in float32 and round once at the end;
`emulate_precision_casts` keeps every rounding the eager code does, so that compiled bfloat16 outputs
are the eager ones, not merely close to them (on CPU bit for bit: an RMSNorm's last bit differed in
a quarter of its outputs without it, and SiLU times up in four fifths).

The token dim of every activation (dim 0 of each argument with more than one dim; the norm weights
are 1-D) is marked dynamic, so a new token count reuses the compiled kernel: dynamo specialises a
size of 1, so each function compiles once for single rows and once for every other count (per
dtype and layout). Inductor keeps what it compiled in its FX graph cache (on by default, under
/tmp/torchinductor_$USER; TORCHINDUCTOR_CACHE_DIR moves it somewhere persistent), so a later run
loads the kernels instead of compiling them again.

Compiling happens at a function's first call. Where it fails (no C++ compiler for inductor's CPU
code, no Triton on CUDA) the whole set runs eagerly from then on, after one warning; so does it
after any later failure of a compiled function (a recompile for a new dtype), the failed call
included: an error of the inputs' own is raised again by the eager function.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import torch

from ops.layers import add_rms_norm, qk_norm_rope, qk_rope, rms_norm, silu_and_mul

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Elementwise:
    """The elementwise functions a decoder layer calls (see ops.layers for what each computes)."""

    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    qk_norm_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    qk_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[..., torch.Tensor]


EAGER = Elementwise(rms_norm=rms_norm, add_rms_norm=add_rms_norm, qk_norm_rope=qk_norm_rope, qk_rope=qk_rope,
                    silu_and_mul=silu_and_mul)


@dataclasses.dataclass
class _Fallback:
    """Shared by one compiled set: once one function fails to compile, every one of them runs eagerly
    (the cause, a missing compiler, would fail the others too)."""

    eager: bool = False


class _CompiledOrEager:
    """`fn` compiled at its first call, or `fn` itself once the set has fallen back."""

    def __init__(self, fn: Callable, fallback: _Fallback):
        self.fn, self.fallback = fn, fallback
        self.compiled = torch.compile(fn, fullgraph=True, options={"emulate_precision_casts": True})

    def __call__(self, *args: torch.Tensor | float) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if not self.fallback.eager:
            for a in args:
                if isinstance(a, torch.Tensor) and a.dim() > 1:
                    torch._dynamo.mark_dynamic(a, 0)
            try:
                return self.compiled(*args)
            except torch.OutOfMemoryError:  # the device's state, not the compiler's: eager would not help
                raise
            except Exception as e:  # whatever compiling raised; an error of the inputs' own recurs eagerly
                self.fallback.eager = True
                log.warning("the compiled elementwise function %s failed (%s: %s); the model's elementwise "
                            "work runs eagerly from now on", self.fn.__name__, type(e).__name__, e)
        return self.fn(*args)


@functools.cache
def compiled_elementwise() -> Elementwise:
    """The compiled set, one per process: every model shares its compiled kernels."""
    fallback = _Fallback()
    return Elementwise(**{f.name: _CompiledOrEager(getattr(EAGER, f.name), fallback)
                          for f in dataclasses.fields(Elementwise)})
