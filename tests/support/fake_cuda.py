"""Fake CUDA tensors on a CPU-only torch, for the device-placement tests (fixtures a test module imports).

Under `FakeTensorMode` a tensor made with `device="cuda"` is a fake CUDA tensor (shape, dtype and
device, no data) even on a CPU-only torch, and an op mixing it with a CPU tensor raises
`FakeTensorDeviceMismatchError` (or the op's own same-device check does), as CUDA would.

A CPU-only torch 2.13 has no CUDA device guard, and fake mode only supplies one for CUDA builds
without a device (`ensureCUDADeviceGuardSet`), so indexing, slicing, `copy_` and `.to("cuda")` of a
fake CUDA tensor raise "PyTorch is not linked with support for cuda devices". The `fake_cuda_guard`
fixture compiles a few lines of C++ that register c10's own `FakeGuardImpl<CUDA>` (what fake mode installs
on a CUDA build) for the test session, and removes it afterwards; factory functions and device
checks are untouched.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.cpp_extension import include_paths

_FAKE_CUDA_GUARD = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

static c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> fake_guard;

static std::atomic<const c10::impl::DeviceGuardImplInterface*>& cuda_slot() {
  return c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)];
}

extern "C" int register_fake_cuda_guard() {
  if (cuda_slot().load() != nullptr) return 0;  // a CUDA build: leave its guard alone
  cuda_slot().store(&fake_guard);
  return 1;
}

extern "C" void unregister_fake_cuda_guard() {
  if (cuda_slot().load() == &fake_guard) cuda_slot().store(nullptr);
}
"""


@pytest.fixture(scope="session")
def fake_cuda_guard(tmp_path_factory):
    """c10's FakeGuardImpl registered for CUDA while the session's device tests run (see above)."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("needs a C++ compiler to register a CUDA device guard on a CPU-only torch")
    root = tmp_path_factory.mktemp("fake_cuda_guard")
    (root / "guard.cpp").write_text(_FAKE_CUDA_GUARD)
    lib_dir = Path(torch.__file__).parent / "lib"
    subprocess.run([compiler, "-shared", "-fPIC", "-std=c++17", *(f"-I{p}" for p in include_paths()),
                    str(root / "guard.cpp"), "-o", str(root / "guard.so"), f"-L{lib_dir}", "-lc10",
                    f"-Wl,-rpath,{lib_dir}"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(root / "guard.so"))
    lib.register_fake_cuda_guard()
    yield
    lib.unregister_fake_cuda_guard()


@pytest.fixture
def fake_cuda(fake_cuda_guard, monkeypatch):
    """Fake mode ready for fake CUDA tensors. Fake mode computes for real with one-element tensors it
    keeps as constants (e.g. `torch.tensor([n], device="cuda")`), which on a CPU-only build would
    allocate on CUDA: no constants here."""
    monkeypatch.setattr(fake_tensor, "CONSTANT_NUMEL_LIMIT", 0)

    # non-fake inputs allowed: module constants built on the CPU (e.g. rotary frequencies) may enter;
    # a real CPU tensor meeting a fake CUDA one still raises the device mismatch
    def mode() -> FakeTensorMode:
        return FakeTensorMode(allow_non_fake_inputs=True)

    return mode
