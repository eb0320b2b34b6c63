"""`python -m bench.fused_elementwise [--toy] [--threads N]`: one decoder layer's elementwise work, eager
against compiled (`EngineConfig.enable_torch_compile`, ops.fused), in one run.

The work is what a Qwen3 / SDAR layer does besides its matmuls and attention: two residual adds with
their RMSNorm, the per-head q/k RMSNorm with the rotary embedding, and SiLU times the up projection,
at the SDAR-1.7B shape (hidden 2048, 16 / 8 heads x 128, MLP 6144; `--toy`: the tiny test shape) for
1 to 256 tokens. Prints one JSON object: per token count the best-of-7 microseconds of each and their
ratio, and the largest difference between the two (compiled keeps eager's roundings, so it is ~0).
On a CPU inductor compiles C++ (a C compiler is needed); on CUDA, Triton kernels.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from ops.fused import EAGER, Elementwise, compiled_elementwise

SDAR_1_7B = {"hidden": 2048, "heads": 16, "kv_heads": 8, "head_dim": 128, "mlp": 6144}
TOY = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "mlp": 128}
EPS = 1e-6


def layer_inputs(shape: dict[str, int], tokens: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    h, d = shape["hidden"], shape["head_dim"]
    angle = torch.arange(tokens)[:, None] * 0.01 * torch.arange(d)[None, :]
    tensors = {"x": (tokens, h), "residual": (tokens, h), "weight": (h,), "q": (tokens, shape["heads"], d),
               "k": (tokens, shape["kv_heads"], d), "q_weight": (d,), "k_weight": (d,),
               "gate": (tokens, shape["mlp"]), "up": (tokens, shape["mlp"])}
    out = {name: torch.randn(*size, generator=g) for name, size in tensors.items()}
    out |= {"cos": angle.cos(), "sin": angle.sin()}
    return {name: t.to(device) for name, t in out.items()}


def layer(ops: Elementwise, a: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The elementwise work of one layer, in the order the layer runs it."""
    h, residual = ops.add_rms_norm(a["x"], a["residual"], a["weight"], EPS)
    q, k = ops.qk_norm_rope(a["q"], a["k"], a["cos"], a["sin"], a["q_weight"], a["k_weight"], EPS)
    h2, residual = ops.add_rms_norm(h, residual, a["weight"], EPS)
    return [h, q, k, h2, residual, ops.silu_and_mul(a["gate"], a["up"])]


def best_us(fn: Callable[[], object], reps: int, device: str) -> float:
    times = []
    for _ in range(7):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / reps)
    return min(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--toy", action="store_true", help="the tiny test shape and 1 / 16 tokens (seconds)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0 = torch's default)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    shape, counts = (TOY, (1, 16)) if args.toy else (SDAR_1_7B, (1, 16, 64, 256))
    compiled = compiled_elementwise()
    rows = {}
    with torch.inference_mode():
        for t in counts:
            a = layer_inputs(shape, t, args.device)
            diff = max((e - c).abs().max().item() for e, c in zip(layer(EAGER, a), layer(compiled, a)))
            reps = max(5, 2000 // t) if not args.toy else 3
            eager, fused = (best_us(lambda ops=ops, a=a: layer(ops, a), reps, args.device) for ops in (EAGER, compiled))
            rows[str(t)] = {"eager_us": round(eager, 1), "compiled_us": round(fused, 1),
                            "speedup": round(eager / fused, 2), "max_abs_diff": diff}
    print(json.dumps({"torch": torch.__version__, "device": args.device, "threads": torch.get_num_threads(),
                      "shape": shape, "fell_back_to_eager": compiled.rms_norm.fallback.eager, "tokens": rows}))


if __name__ == "__main__":
    main()
