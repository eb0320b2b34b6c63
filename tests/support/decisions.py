"""The three block-diffusion families with typed decisions, each a tiny checkpoint and its reference run
with the settings its engine tests use: the fixtures `sdar`, `llada2`, `fast` and `family` (all three)
that the references' self-checks (tests/testing/test_decisions_reference.py) and the engine's exact
comparison (tests/engine/test_decisions_exact.py) import."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from testing.references.fast_dllm_qwen import reference_fast_dllm_generate
from testing.references.llada2_moe import LLaDA2Reference, reference_generate
from testing.references.sdar import block_causal_logits, reference_dllm_generate
from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, load_hf_reference, write_tiny_checkpoint
from testing.tiny_fast_dllm import FAST_DLLM_TEST_LOGIT_SCALE, MASK_TEXT, load_hf_qwen2, write_tiny_fast_dllm
from testing.tiny_llada2 import MASK_TEXT as LLADA2_MASK_TEXT
from testing.tiny_llada2 import write_tiny_llada2


@dataclass
class Family:
    """A tiny checkpoint and its reference, run with the settings its engine tests use."""

    name: str
    path: Path
    mask_id: int
    eos: set[int]
    block: int  # block length
    model: Any  # what the reference runs
    knobs: dict[str, Any]  # the rule's knobs unless a call says otherwise
    reference: Callable[..., Any]  # reference(model, prompt, **every knob)

    def run(self, prompt: list[int], **kw: Any) -> Any:
        """The reference's decoding of `prompt` (kw: max_new_tokens, stop_ids, and any knob)."""
        return self.reference(self.model, prompt, block_length=self.block, mask_id=self.mask_id,
                              **(self.knobs | kw))

    def prompt(self, length: int) -> list[int]:
        return [(7 * i + 11 * length) % 300 + 1 for i in range(length)]

    def proposer(self, ids: list[int], p: int) -> torch.Tensor:
        """The logits row that proposes position p in a forward over `ids` (Fast-dLLM: row p-1)."""
        if self.name == "llada2":
            return self.model.logits(ids, self.block)[p]
        return block_causal_logits(self.model, ids, self.block)[p - (self.name == "fast")]


def _eos(path: Path) -> set[int]:
    cfg = json.loads((path / "config.json").read_text())
    gen = json.loads((path / "generation_config.json").read_text())
    ids = gen.get("eos_token_id", [])
    return {cfg["eos_token_id"], *(ids if isinstance(ids, list) else [ids])}


def _mask_of(path: Path, text: str) -> int:
    return next(t["id"] for t in json.loads((path / "tokenizer.json").read_text())["added_tokens"]
                if t["content"] == text)


@pytest.fixture(scope="module")
def sdar(tmp_path_factory, one_thread) -> Family:
    """SDAR, B = 4, low_confidence_dynamic at 0.85 over 4 steps unless a knob says otherwise."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("sdar"), model_type="sdar", seed=3, block_size=4,
                                 logit_scale=DLLM_TEST_LOGIT_SCALE)
    mask_id = json.loads((path / "config.json").read_text())["mask_token_id"]
    knobs = dict(strategy="low_confidence_dynamic", denoising_steps=4, threshold=0.85)
    return Family("sdar", path, mask_id, _eos(path), 4, load_hf_reference(path), knobs, reference_dllm_generate)


@pytest.fixture(scope="module")
def llada2(tmp_path_factory, one_thread) -> Family:
    """LLaDA2 decoded in blocks of 8 (not its 32), LowConfidence at 0.95 unless a knob says otherwise."""
    path = write_tiny_llada2(tmp_path_factory.mktemp("llada2"), use_qkv_bias=True, use_bias=True, seed=0)
    knobs = dict(rule="low_confidence", threshold=0.95)
    return Family("llada2", path, _mask_of(path, LLADA2_MASK_TEXT), _eos(path), 8, LLaDA2Reference(path), knobs,
                  reference_generate)


@pytest.fixture(scope="module")
def fast(tmp_path_factory, one_thread) -> Family:
    """Fast-dLLM v2, B = 8 in sub-blocks of 4, threshold 0.7 unless a knob says otherwise."""
    path = write_tiny_fast_dllm(tmp_path_factory.mktemp("fast_dllm"), seed=11, bd_size=8,
                                logit_scale=FAST_DLLM_TEST_LOGIT_SCALE)
    knobs = dict(sub_block_length=4, threshold=0.7)
    return Family("fast", path, _mask_of(path, MASK_TEXT), _eos(path), 8, load_hf_qwen2(path), knobs,
                  reference_fast_dllm_generate)


@pytest.fixture(params=["sdar", "llada2", "fast"])
def family(request) -> Family:
    return request.getfixturevalue(request.param)
