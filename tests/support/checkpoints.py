"""The session's tiny checkpoints (fixtures, loaded by tests/conftest.py through `pytest_plugins`):
written once per worker process, read-only, shared by every module that asks for one."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def gemma_ckpt(tmp_path_factory) -> Path:
    """A tiny DiffusionGemma checkpoint written by transformers' own classes (both layer types, a
    sliding window of 8), read-only, shared by the network and runner tests."""
    pytest.importorskip("transformers.models.diffusion_gemma")
    from testing.tiny.diffusion_gemma import write_tiny_diffusion_gemma

    return write_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg") / "tiny")


@pytest.fixture(scope="session")
def gemma_reference(gemma_ckpt):
    """transformers' DiffusionGemmaForBlockDiffusion on `gemma_ckpt`, driven as its generate() runs it."""
    from testing.references.diffusion_gemma import load_reference

    return load_reference(gemma_ckpt)


@pytest.fixture(scope="session")
def ar_ckpt(tmp_path_factory) -> str:
    """A tiny Qwen3 (AR) checkpoint with mildly peaked logits, shared by the engine-level tests."""
    from testing.tiny_checkpoint import write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("ar"), model_type="qwen3", seed=4, logit_scale=2.0))


@pytest.fixture(scope="session")
def dllm_ckpt(tmp_path_factory) -> str:
    """A tiny SDAR (DLLM) checkpoint whose confidences give dynamic unmasking something to do."""
    from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("sdar"), model_type="sdar", seed=5,
                                     logit_scale=DLLM_TEST_LOGIT_SCALE))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One tiny SDAR (DLLM) and one tiny Qwen3 (AR) checkpoint on disk."""
    from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {"sdar": write_tiny_checkpoint(root / "sdar", model_type="sdar", logit_scale=DLLM_TEST_LOGIT_SCALE),
            "qwen3": write_tiny_checkpoint(root / "qwen3", model_type="qwen3")}
