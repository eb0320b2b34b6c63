"""Prompt scoring (`logprob_start_len`, `max_new_tokens=0`) is an autoregressive model's: the refusal on
any other model says that it is not autoregressive without calling a renoising model (DiffusionGemma) a
block-diffusion LM."""

from __future__ import annotations

import pytest

from configs import GenerationConfig
from engine.errors import RequestError
from engine.offline import pipeline

SCORING = [(dict(max_new_tokens=8, logprob_start_len=0, logprobs=0), "logprob_start_len"),
           (dict(max_new_tokens=0), "max_new_tokens")]


@pytest.mark.parametrize("fields,param", SCORING)
def test_scoring_on_diffusion_gemma_names_renoising(gemma_ckpt, fields, param):
    with pipeline(str(gemma_ckpt)) as pipe:
        with pytest.raises(RequestError) as e:
            pipe([5, 6, 7], GenerationConfig(**fields))
    assert e.value.param == param
    assert "block-diffusion LM" not in e.value.message
    assert "not autoregressive" in e.value.message and "renoising" in e.value.message


@pytest.mark.parametrize("fields,param", SCORING)
def test_scoring_on_a_block_diffusion_model_still_says_so(dllm_ckpt, fields, param):
    with pipeline(dllm_ckpt) as pipe:
        with pytest.raises(RequestError) as e:
            pipe([5, 6, 7], GenerationConfig(**fields))
    assert e.value.param == param and "block diffusion" in e.value.message
