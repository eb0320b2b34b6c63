"""The embedded default models (models/, trained by training/train_tiny.py) do their task."""

from __future__ import annotations

import pytest

from engine import EngineConfig, GenerationConfig, pipeline
from tests.support.paths import ROOT
from training.train_tiny import heldout_addition

MODELS = ROOT / "models"
PROMPTS = [(f"{a}+{b}=", str(a + b)) for a, b in heldout_addition()]


@pytest.mark.parametrize("name", ["sdar-tiny", "qwen3-tiny"])
def test_held_out_addition_is_at_least_90_percent_exact(name):
    with pipeline(str(MODELS / name), EngineConfig(max_model_len=128)) as pipe:
        outs = pipe([p for p, _ in PROMPTS], GenerationConfig(max_new_tokens=8))
        exact = sum(o.text.strip() == answer for o, (_, answer) in zip(outs, PROMPTS))
        assert len(PROMPTS) == 50
        assert exact / len(PROMPTS) >= 0.9, f"{name}: {exact}/50 exact"
        if pipe.engine.is_dllm:
            tokens = sum(len(o.token_ids) for o in outs)
            steps = sum(len(set(o.step_map)) for o in outs)
            assert tokens / steps > 1.0, f"dynamic unmasking averaged {tokens / steps:.2f} tokens/step"


def test_sdar_default_decodes_a_copy_in_parallel():
    with pipeline(str(MODELS / "sdar-tiny")) as pipe:
        out = pipe("copy [h,e,l,l,o] ->", GenerationConfig(max_new_tokens=24))
    assert out.text.strip() == "[h,e,l,l,o]"
    assert len(out.token_ids) > len(set(out.step_map))
