"""Trajectory scoring of Nemotron-Labs-Diffusion's `diffusion` rollouts: blocks start at the prompt end,
each seed is scored on the causal row before its block, every other token on its pass's bidirectional
view of the block over the causal context. A rollout's scores equal the logprobs it was generated with
(greedy and seeded, every threshold rule, raw and processed logprobs, outputs ending inside a block and
cut by a stop id) and the release loop's; `ar` and `linear_spec` rollouts are pointed elsewhere."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from configs.trajectory import DllmTrajectory
from engine import EngineConfig, GenerationConfig, pipeline
from engine.carrier import Response
from engine.errors import RequestError
from testing.tiny.nemotron_labs_diffusion import write_tiny_nemotron_labs_diffusion
from tests.support import nemotron
from tests.support.nemotron import LOGIT_SCALE, TOL, diffusion, make_prompt
from tests.support.trajectories import scoring_config

ckpt, model, ids = nemotron.ckpt, nemotron.model, nemotron.ids  # the tiny checkpoint's fixtures
NEW = 20  # blocks of 8 from the prompt end: two whole blocks and half a third


MODES = ("raw_logprobs", "processed_logprobs")


def engine_config(mode: str) -> EngineConfig:
    return EngineConfig(max_model_len=128, kv_block_size=4, logprobs_mode=mode)


@pytest.fixture(scope="module")
def pipes(ckpt):
    with pipeline(str(ckpt), engine_config(MODES[0])) as raw, pipeline(str(ckpt), engine_config(MODES[1])) as processed:
        yield dict(zip(MODES, (raw, processed), strict=True))


def rollout_config(threshold: float | None, temperature: float, **fields) -> GenerationConfig:
    sampling = dict(temperature=temperature, random_seed=9) if temperature else dict(temperature=0.0)
    return GenerationConfig(**{"max_new_tokens": NEW, "ignore_eos": True, "logprobs": 1, "return_dllm_replay": True,
                               "dllm_confidence_threshold": threshold, **sampling, **fields})


def values(out: Response) -> list[float]:
    """Each output token's logprob (NaN for a position never revealed)."""
    return [math.nan if entry is None else entry[t] for entry, t in zip(out.logprobs, out.token_ids, strict=True)]


def check_scores(pipe, prompt: list[int], outs: list[Response], configs: list[GenerationConfig]) -> None:
    """Each rollout scored (all in one batch) gives its own tokens, step map and logprobs back."""
    scored = pipe([prompt] * len(outs), [scoring_config(o, c) for o, c in zip(outs, configs, strict=True)])
    for out, got in zip(outs, scored, strict=True):
        assert (got.token_ids, got.step_map) == (out.token_ids, out.step_map)
        torch.testing.assert_close(torch.tensor(values(got)), torch.tensor(values(out)), atol=TOL, rtol=0,
                                   equal_nan=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("threshold", "temperature"), [(None, 0.0), (0.5, 0.0), (0.9, 0.8)])
@pytest.mark.parametrize("length", [1, 7])
def test_scores_equal_the_rollouts_logprobs(pipes, mode, length, threshold, temperature):
    pipe, prompt = pipes[mode], make_prompt(length)
    base = rollout_config(threshold, temperature)
    free = pipe(prompt, base)
    # the free run, and the same rollout ended by a stop id inside its second and third blocks
    stops = [free.token_ids[g] for g in (10, 17) if free.token_ids[g] not in free.token_ids[:g]]
    configs = [base] + [base.model_copy(update={"stop_token_ids": [t]}) for t in stops]
    outs = pipe([prompt] * len(configs), configs)
    assert any(o.finish_reason == "stop" for o in outs[1:]) or not stops
    check_scores(pipe, prompt, outs, configs)


def test_passes_that_reveal_nothing_and_positions_left_masked(tmp_path, ids):
    """The head's mask row made a slightly larger copy of a frequent token's (as the engine's test of
    the release's behaviour does): passes write the mask id back, so steps skip, and positions stay
    masked (step 0, no logprob) to the end; such rollouts score as they were generated."""
    path = write_tiny_nemotron_labs_diffusion(tmp_path, seed=5, logit_scale=LOGIT_SCALE)
    tensors = load_file(str(path / "model.safetensors"))
    head = tensors["diffusion_head.weight"]
    with pipeline(str(path), engine_config(MODES[0])) as pipe:
        prompt = make_prompt(7)
        frequent = Counter(pipe(prompt, rollout_config(None, 0.0)).token_ids).most_common(1)[0][0]
    head[ids["mask_id"]] = head[frequent] * 1.02
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pipeline(str(path), engine_config(MODES[0])) as pipe:
        configs = [rollout_config(t, 0.0) for t in (None, 0.5)]
        outs = pipe([prompt] * 2, configs)
        assert any(0 in o.step_map for o in outs), "a position stays masked"
        check_scores(pipe, prompt, outs, configs)


def test_scores_equal_the_release_loop(pipes, model, ids):
    """Independent of the engine's own rollout: the release loop's raw logprobs, its seeds' included."""
    pipe, prompt = pipes["raw_logprobs"], make_prompt(7)
    want = diffusion(model, ids, prompt, 0.5, new_tokens=16)
    trajectory = DllmTrajectory(output_ids=want.token_ids, step_map=want.step_map)
    got = pipe(prompt, GenerationConfig(max_new_tokens=0, logprobs=0, dllm_trajectory=trajectory))
    torch.testing.assert_close(torch.tensor(values(got)), torch.tensor(want.logprobs), atol=TOL, rtol=0,
                               equal_nan=True)


@pytest.mark.parametrize(("mode", "says"), [("ar", "logprob_start_len"), ("linear_spec", "dllm_mode='diffusion'")])
def test_other_modes_are_refused(pipes, mode, says):
    pipe = pipes["raw_logprobs"]
    trajectory = DllmTrajectory(output_ids=[5, 6], step_map=[1, 2])
    with pytest.raises(RequestError, match=says) as e:
        pipe([1, 2, 3], GenerationConfig(max_new_tokens=0, logprobs=0, dllm_mode=mode, dllm_trajectory=trajectory))
    assert e.value.param == "dllm_trajectory"
