"""The Triton attention kernel compiled ahead of time for a Hopper GPU (sm_90: H100, H200) on this CPU
machine: Triton's own front end, LLVM and the `ptxas` its wheel ships turn every mode of the kernel,
in bfloat16 and in float32, at the head sizes the engine serves, into a cubin -- what the interpreter
runs in the other tests cannot show (undefined names in a branch the interpreter never takes, types
that do not unify across branches, shared memory over the device's limit). Runs in a process of its
own, without TRITON_INTERPRET (under which `triton.jit` gives the interpreter instead)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.paths import ROOT

pytest.importorskip("triton")
HOPPER_SHARED_MEMORY = 227 * 1024  # bytes a block may use on sm_90

SCRIPT = r"""
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ops.attention import triton_paged as tp

names = list(inspect.signature(tp._paged_attention).parameters)
out = []
for mode, window, group, head, dtype in json.loads(sys.argv[1]):
    data = {"bf16": "*bf16", "fp32": "*fp32"}[dtype]
    signature = {n: (data if n in ("out_ptr", "q_ptr", "k_ptr", "v_ptr", "own_k_ptr", "own_v_ptr") else
                     "*i64" if n.endswith("_ptr") else "fp32" if n == "scale" else
                     "constexpr" if n.isupper() else "i64") for n in names}
    constants = dict(MODE=mode, DLLM_BLOCK=4, WINDOW=window, G=group, BLOCK_Q=tp.block_q(group), PAGE=16,
                     TILE=tp.key_tile(head), HEAD=head, HEAD_P=triton.next_power_of_2(head),
                     IEEE=dtype == "fp32", UPCAST=False)
    source = ASTSource(fn=tp._KERNEL, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 8 if head >= 256 else 4})
    out.append({"case": [mode, window, group, head, dtype], "cubin_bytes": len(kernel.asm["cubin"]),
                "shared": kernel.metadata.shared})
print(json.dumps(out))
"""

CASES = [  # (mode, window, query heads per K/V head, head size, dtype)
    (0, 0, 2, 128, "bf16"),  # AR prefill and decode, SDAR-1.7B / Qwen3 heads
    (1, 0, 4, 128, "bf16"),  # block diffusion, SDAR-4B heads
    (1, 0, 8, 64, "fp32"),  # the float32 path (IEEE dots)
    (2, 24, 1, 256, "bf16"),  # bidirectional with a sliding window
    (3, 1024, 2, 256, "bf16"),  # DiffusionGemma's passes: sliding layers
    (3, 0, 8, 512, "bf16"),  # DiffusionGemma's passes: full layers
]


def test_every_mode_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert [tuple(r["case"]) for r in results] == CASES
    for r in results:
        assert r["cubin_bytes"] > 0, r
        assert 0 < r["shared"] <= HOPPER_SHARED_MEMORY, r
