"""What RL trainers read from a rollout, checked against independent computations with the HF model:
block-local step maps, the final-block replay, n samples per prompt with derived seeds, seeds across
replicas, and logprobs of the distribution the sampler actually drew from."""

from __future__ import annotations

import json

import pytest
import torch

from engine import EngineConfig, GenerationConfig, pipeline
from testing.references.sdar import block_causal_logits
from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, load_hf_reference, write_tiny_checkpoint
from tests.support.sampling_reference import processed_logprobs

B = 4
SAMPLING = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.1)


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("sdar_rl"), model_type="sdar", seed=31,
                                 logit_scale=DLLM_TEST_LOGIT_SCALE)
    mask_id = json.loads((path / "config.json").read_text())["mask_token_id"]
    return str(path), load_hf_reference(path), mask_id


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("ar_rl"), model_type="qwen3", seed=32, logit_scale=3.0)
    return str(path), load_hf_reference(path)


def _engine(**kw) -> EngineConfig:
    return EngineConfig(max_model_len=256, num_kv_blocks=128, kv_block_size=4, dllm_block_length=B, **kw)


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(11 * i + 5 * n + salt) % 280 + 6 for i in range(n)]


# ---- block_step_map ----------------------------------------------------------------------------
@pytest.mark.parametrize("prompt_len", [B, B + 1, B + 2, B + 3, 2])
def test_block_step_map_agrees_with_step_map(sdar, prompt_len):
    path, _, _ = sdar
    prompt = _prompt(prompt_len)
    with pipeline(path, _engine()) as pipe:
        out = pipe(prompt, GenerationConfig(max_new_tokens=21, ignore_eos=True, return_block_step_map=True))
        plain = pipe(prompt, GenerationConfig(max_new_tokens=21, ignore_eos=True))
    assert plain.block_step_map is None and out.step_map == plain.step_map
    block_of = [(prompt_len + g) // B for g in range(len(out.token_ids))]
    expected = []
    for g, s in enumerate(out.step_map):  # steps of block k start after every step of earlier blocks
        base = max((t for h, t in enumerate(out.step_map) if block_of[h] < block_of[g]), default=0)
        expected.append(s - base)
    assert out.block_step_map == expected
    assert min(out.block_step_map) == 1 and len(out.block_step_map) == len(out.token_ids)


# ---- final-block replay --------------------------------------------------------------------------
def _rebuild_and_check(hf, mask_id, prompt, out):
    """Rebuild every step's input from the outputs + replay; the model reproduces each revealed token
    (argmax) and each output token's logprob at its step."""
    n_out = len(out.token_ids)
    first_last_block = n_out - out.dllm_stop_length
    gen_tokens = out.token_ids[:first_last_block] + out.dllm_replay_token_ids
    gen_steps = out.step_map[:first_last_block] + out.dllm_replay_step_maps
    assert out.dllm_replay_token_ids[: out.dllm_stop_length] == out.token_ids[first_last_block:]
    assert out.dllm_replay_step_maps[: out.dllm_stop_length] == out.step_map[first_last_block:]
    assert (len(prompt) + len(gen_tokens)) % B == 0, "the replay covers the last block to its end"
    never = [g for g, s in enumerate(gen_steps) if s == 0]
    assert all(gen_tokens[g] == mask_id for g in never)
    for step in sorted({s for s in gen_steps if s}):
        block = min(g for g, s in enumerate(gen_steps) if s == step) + len(prompt)
        block_end = (block // B + 1) * B
        visible = [t if (s and s < step) else mask_id for t, s in zip(gen_tokens, gen_steps)]
        ids = prompt + visible[: block_end - len(prompt)]
        logits = block_causal_logits(hf, ids, B)
        for g, s in enumerate(gen_steps):
            if s != step:
                continue
            row = logits[len(prompt) + g]
            assert int(row.argmax()) == gen_tokens[g], (step, g)
            if g < n_out:
                assert abs(float(row.log_softmax(-1)[gen_tokens[g]]) - out.logprobs[g][gen_tokens[g]]) < 1e-4


def test_replay_rebuilds_every_step_of_the_last_block(sdar):
    path, hf, mask_id = sdar
    prompt = _prompt(6, 1)
    with pipeline(path, _engine(logprobs_mode="raw_logprobs")) as pipe:
        free = pipe(prompt, GenerationConfig(max_new_tokens=24, ignore_eos=True))
        cases = []
        for offset in range(B):  # a stop id at each offset of a block
            g = next((g for g in range(B, len(free.token_ids)) if (len(prompt) + g) % B == offset
                      and free.token_ids[g] not in free.token_ids[:g]), None)
            if g is not None:
                cases.append(GenerationConfig(max_new_tokens=24, ignore_eos=True, stop_token_ids=[free.token_ids[g]]))
        assert len(cases) >= 3
        cases += [GenerationConfig(max_new_tokens=m, ignore_eos=True) for m in (9, 11, 13)]  # cut inside a block
        outs = pipe([prompt] * len(cases), [c.model_copy(update={"return_dllm_replay": True, "logprobs": 0})
                                            for c in cases])
    for case, out in zip(cases, outs):
        assert out.dllm_stop_length >= 1
        assert out.finish_reason == ("stop" if case.stop_token_ids else "length")
        _rebuild_and_check(hf, mask_id, prompt, out)


# ---- n samples and seeds -------------------------------------------------------------------------
def test_n_samples_distinct_reproducible_prompt_once(qwen3):
    path, _ = qwen3
    prompt = _prompt(23, 3)
    with pipeline(path, _engine()) as pipe:
        before = pipe.engine.kv.prefix_hit_tokens
        outs = pipe(prompt, GenerationConfig(max_new_tokens=10, ignore_eos=True, do_sample=True, n=8,
                                             random_seed=500))
        hits = pipe.engine.kv.prefix_hit_tokens - before
        assert [o.index for o in outs] == list(range(8))
        assert len({tuple(o.token_ids) for o in outs}) == 8, "8 distinct samples"
        page = pipe.engine.config.kv_block_size
        assert hits == 7 * ((len(prompt) - 1) // page * page), "the prompt is computed once, reused 7 times"
        for i in (0, 5):
            alone = pipe(prompt, GenerationConfig(max_new_tokens=10, ignore_eos=True, do_sample=True,
                                                  random_seed=500 + i))
            assert alone.token_ids == outs[i].token_ids


def test_seeds_across_replicas(qwen3):
    """Two engines (two replicas): unseeded requests differ, seeded ones agree."""
    path, _ = qwen3
    prompt = _prompt(9, 4)
    unseeded = GenerationConfig(max_new_tokens=12, ignore_eos=True, do_sample=True, temperature=1.5)
    seeded = unseeded.model_copy(update={"random_seed": 77})
    with pipeline(path, _engine()) as a, pipeline(path, _engine()) as b:
        assert a(prompt, unseeded).token_ids != b(prompt, unseeded).token_ids
        assert a(prompt, seeded).token_ids == b(prompt, seeded).token_ids


# ---- processed logprobs --------------------------------------------------------------------------
def test_processed_logprobs_ar(qwen3):
    path, hf = qwen3
    prompt = _prompt(7, 5)
    with pipeline(path, _engine(logprobs_mode="processed_logprobs")) as pipe:
        out = pipe(prompt, GenerationConfig(max_new_tokens=12, ignore_eos=True, logprobs=0, random_seed=9, **SAMPLING))
    ids = prompt + out.token_ids
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([ids])).logits[0].float()
    for g, tok in enumerate(out.token_ids):
        pos = len(prompt) + g - 1
        want = processed_logprobs(logits[pos], set(ids[: pos + 1]), SAMPLING)[tok]
        assert abs(out.logprobs[g][tok] - float(want)) < 1e-5, g


def test_processed_logprobs_block_diffusion(sdar):
    path, hf, mask_id = sdar
    prompt = _prompt(6, 6)
    with pipeline(path, _engine(logprobs_mode="processed_logprobs")) as pipe:
        # 14 tokens end on a block end: no revealed position past the output enters the penalty history
        out = pipe(prompt, GenerationConfig(max_new_tokens=14, ignore_eos=True, logprobs=0, random_seed=3, **SAMPLING))
    gen, steps = out.token_ids, out.step_map
    for g, tok in enumerate(gen):
        step = steps[g]
        block_end = ((len(prompt) + g) // B + 1) * B
        visible = [t if s < step else mask_id for t, s in zip(gen, steps)]
        ids = prompt + visible[: block_end - len(prompt)]
        ids += [mask_id] * (block_end - len(ids))
        logits = block_causal_logits(hf, ids, B)[len(prompt) + g]
        history = set(prompt) | {t for t, s in zip(gen, steps) if s < step}
        want = processed_logprobs(logits, history, SAMPLING)[tok]
        assert abs(out.logprobs[g][tok] - float(want)) < 1e-5, g
