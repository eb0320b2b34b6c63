"""What the Nemotron-Labs-Diffusion tests share (the engine's, the LoRA draft adapter's and the served
ones'): the tiny checkpoint and its fixtures (`ckpt`, `model`, `ids`: a module imports the ones it
uses), its settings, seeded prompts, the release's diffusion and LinearSpec loops
(testing/references/nemotron_labs_diffusion.py) run as the engine is asked to, and a response compared
with theirs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine import GenerationConfig
from testing.references import nemotron_labs_diffusion as ref
from testing.tiny.nemotron_labs_diffusion import load_ministral3, write_tiny_nemotron_labs_diffusion

NEW_TOKENS = 32  # four blocks of the tiny checkpoint's 8
LOGIT_SCALE = 8.0  # some denoising confidences pass 0.5 and 0.9: several reveals per step
TOL = 1e-4


def make_prompt(length: int) -> list[int]:
    return torch.randint(0, 320, (length,), generator=torch.Generator().manual_seed(700 + length)).tolist()


def diffusion(model, ids, prompt, threshold=None, temperature=0.0, seed=None, eos=(), new_tokens=NEW_TOKENS):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return ref.diffusion_generate(model, prompt, max_new_tokens=new_tokens, block_length=ids["block"],
                                  mask_id=ids["mask_id"], eos_ids=set(eos), threshold=threshold,
                                  temperature=temperature, generator=generator)


def gen(threshold=None, **fields) -> GenerationConfig:
    return GenerationConfig(**{"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "logprobs": 0,
                               "dllm_confidence_threshold": threshold, **fields})


def assert_same(out, want: ref.LoopResult, cut: int | None = None) -> None:
    """The engine's response equals the loop's (cut to its first `cut` tokens): tokens, step map, the
    step count, the finish reason and every revealed token's logprob."""
    n = len(want.token_ids) if cut is None else cut
    assert out.token_ids == want.token_ids[:n]
    assert out.step_map == want.step_map[:n]
    assert out.num_steps == max(want.step_map[:n])
    got = [math.nan if entry is None else next(iter(entry.values())) for entry in out.logprobs]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want.logprobs[:n]), atol=TOL, rtol=0, equal_nan=True)


def speculation(model, ids, prompt, threshold=None, temperature=0.0, seed=None, new_tokens=NEW_TOKENS):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return ref.linear_spec_generate(model, prompt, max_new_tokens=new_tokens, block_length=ids["block"],
                                    mask_id=ids["mask_id"], eos_ids=set(), threshold=threshold or 0.0,
                                    temperature=temperature, generator=generator)


def assert_speculated(out, want: ref.LoopResult) -> None:
    """`assert_same`, and the release's forward count and each verify's accepted tokens."""
    assert_same(out, want)
    assert out.nfe == want.nfe and out.acceptance_lengths == want.acceptance


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_nemotron_labs_diffusion(tmp_path_factory.mktemp("nld"), seed=5, logit_scale=LOGIT_SCALE)


@pytest.fixture(scope="module")
def model(ckpt):
    """The checkpoint as transformers' Ministral-3, which the release's loops run."""
    return load_ministral3(ckpt)


@pytest.fixture(scope="module")
def ids(ckpt) -> dict:
    """The checkpoint's mask and eos ids and block length."""
    cfg = json.loads((ckpt / "config.json").read_text())
    return {"mask_id": cfg["mask_token_id"], "eos": cfg["eos_token_id"], "block": cfg["block_size"]}
