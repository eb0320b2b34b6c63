"""Part 0, `machine`: what the machine offers."""

from __future__ import annotations

import importlib
import importlib.util
import platform
import shutil

import torch

from ops.attention import flex_unmet
from ops.attention.triton_backend import triton_unmet
from ops.flash_kernel import INSTALLED, TORCH_KERNEL


def machine_report() -> dict:
    """Versions and what exists: the figures of every other part depend on these."""
    cuda = torch.cuda.is_available()
    triton = importlib.util.find_spec("triton")
    flash_op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "gpu_capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "triton": importlib.import_module("triton").__version__ if triton is not None else None,
        "c_compiler": next((c for c in (shutil.which(n) for n in ("cc", "gcc", "clang")) if c), None),
        "attention": {
            "vllm_flash_kernel": None if INSTALLED is None else f"{INSTALLED.source} ({INSTALLED.key_lengths})",
            "torch_flash_paged": TORCH_KERNEL is not None,  # a CUDA build whose operator takes block_table
            "torch_flash_operator": flash_op is not None,
            "torch_varlen_module": importlib.util.find_spec("torch.nn.attention.varlen") is not None,
            "flex_attention": True,
            "flex_compiled_unmet": flex_unmet(torch.device("cuda" if cuda else "cpu")),
            "triton_unmet": triton_unmet(torch.device("cuda" if cuda else "cpu")),
        },
    }
