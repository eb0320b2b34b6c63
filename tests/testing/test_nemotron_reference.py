"""The reference loops of Nemotron-Labs-Diffusion (testing/references/nemotron_labs_diffusion.py)
on the tiny checkpoint: greedy LinearSpec emits exactly greedy AR's tokens (it only ever emits the
verifier's AR tokens); sampled LinearSpec tokens carry exactly the AR conditionals; the reference AR
loop equals the engine's greedy decoding; the diffusion loop's step maps are well formed for each
threshold rule."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, GenerationConfig, pipeline
from testing.references import nemotron_labs_diffusion as ref
from tests.support import nemotron

NEW_TOKENS = 32
ckpt, model, ids = nemotron.ckpt, nemotron.model, nemotron.ids  # the tiny checkpoint's fixtures


def make_prompt(length: int) -> list[int]:
    return torch.randint(0, 320, (length,), generator=torch.Generator().manual_seed(700 + length)).tolist()


@pytest.mark.parametrize("block_length", [8, 32])
def test_greedy_linear_spec_equals_greedy_ar(model, ids, block_length, record_property):
    acceptance = []
    for length in (1, 7, 40):
        prompt = make_prompt(length)
        ar = ref.ar_generate(model, prompt, max_new_tokens=NEW_TOKENS, eos_ids=set())
        spec = ref.linear_spec_generate(model, prompt, max_new_tokens=NEW_TOKENS, block_length=block_length,
                                        mask_id=ids["mask_id"], eos_ids=set())
        assert spec.token_ids == ar.token_ids, f"prompt length {length}"
        assert len(spec.token_ids) == NEW_TOKENS and spec.finish_reason == "length"
        assert all(1 <= a <= block_length for a in spec.acceptance)
        assert spec.nfe == 1 + 2 * len(spec.acceptance), "threshold 0: one draft and one verify per block"
        # the seed at step 1, then every iteration's tokens at its verify
        assert spec.step_map[0] == 1 and spec.step_map == sorted(spec.step_map)
        assert spec.num_steps == 1 + len(spec.acceptance)
        torch.testing.assert_close(torch.tensor(spec.logprobs), torch.tensor(ar.logprobs), atol=1e-4, rtol=0)
        acceptance += spec.acceptance
    mean = sum(acceptance) / len(acceptance)
    record_property("mean_acceptance_length", mean)
    print(f"\nB={block_length}: mean acceptance length {mean:.3f} over {len(acceptance)} verifies")


def test_thresholded_drafts_stay_lossless(model, ids):
    prompt = make_prompt(7)
    ar = ref.ar_generate(model, prompt, max_new_tokens=NEW_TOKENS, eos_ids=set())
    spec = ref.linear_spec_generate(model, prompt, max_new_tokens=NEW_TOKENS, block_length=ids["block"],
                                    mask_id=ids["mask_id"], eos_ids=set(), threshold=0.9)
    assert spec.token_ids == ar.token_ids
    assert spec.nfe > 1 + 2 * len(spec.acceptance), "threshold 0.9 drafts a block in several passes"


def test_sampled_linear_spec_emits_ar_conditionals(model, ids):
    """At T = 1 every emitted token's logprob is the causal row's given the emitted prefix, and a seeded
    generator replays the run."""
    prompt = make_prompt(7)

    def run(seed: int) -> ref.LoopResult:
        return ref.linear_spec_generate(model, prompt, max_new_tokens=NEW_TOKENS, block_length=ids["block"],
                                        mask_id=ids["mask_id"], eos_ids=set(), temperature=1.0,
                                        generator=torch.Generator().manual_seed(seed))

    first = run(0)
    assert run(0).token_ids == first.token_ids and run(1).token_ids != first.token_ids
    rows = ref.block_logits(model, prompt + first.token_ids, len(prompt) - 1, bidirectional=False)[:-1]
    want = rows.log_softmax(-1).gather(-1, torch.tensor(first.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(first.logprobs), want, atol=1e-4, rtol=0)


def test_reference_ar_equals_the_engine(ckpt, model):
    prompt = make_prompt(40)
    want = ref.ar_generate(model, prompt, max_new_tokens=NEW_TOKENS, eos_ids=set()).token_ids
    with pipeline(str(ckpt), EngineConfig(max_model_len=128)) as pipe:
        out = pipe(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True, dllm_mode="ar"))
    assert out.token_ids == want


@pytest.mark.parametrize("threshold", [None, 0.9, 0.5])
@pytest.mark.parametrize("length", [1, 7, 40])
def test_diffusion_step_map_is_well_formed(model, ids, threshold, length):
    b = ids["block"]
    out = ref.diffusion_generate(model, make_prompt(length), max_new_tokens=NEW_TOKENS, block_length=b,
                                 mask_id=ids["mask_id"], eos_ids=set(), threshold=threshold)
    assert len(out.token_ids) == NEW_TOKENS and out.finish_reason == "length"
    blocks = [out.step_map[i:i + b] for i in range(0, NEW_TOKENS, b)]
    assert blocks[0][0] == 1, "block 0's seed comes from the prefill"
    for k, steps in enumerate(blocks):
        assert all(s > steps[0] for s in steps[1:]), f"block {k}: denoised after its seed"
        if k:
            assert steps[0] == max(blocks[k - 1]) + 1, f"block {k}: seed from the commit after block {k - 1}"
    assert min(out.step_map) >= 1
    denoising = out.nfe - NEW_TOKENS // b  # nfe counts every commit
    assert out.num_steps == 1 + denoising + (len(blocks) - 1)
    if threshold is None:  # one reveal per denoising step
        assert all(sorted(s[1:]) == list(range(s[0] + 1, s[0] + b)) for s in blocks)


def test_lower_thresholds_take_fewer_steps(model, ids):
    prompt = make_prompt(7)
    steps = [ref.diffusion_generate(model, prompt, max_new_tokens=NEW_TOKENS, block_length=ids["block"],
                                    mask_id=ids["mask_id"], eos_ids=set(), threshold=t).num_steps
             for t in (None, 0.9, 0.5)]
    assert steps[0] == 1 + NEW_TOKENS - 1 and steps[0] >= steps[1] >= steps[2] and steps[2] < steps[0]


def test_diffusion_stops_after_the_first_eos_and_needs_whole_blocks(model, ids):
    prompt = make_prompt(7)
    full = ref.diffusion_generate(model, prompt, max_new_tokens=NEW_TOKENS, block_length=ids["block"],
                                  mask_id=ids["mask_id"], eos_ids=set(), threshold=0.9)
    eos = full.token_ids[11]  # a token the loop writes: as a stop id the output must end at its first use
    stopped = ref.diffusion_generate(model, prompt, max_new_tokens=NEW_TOKENS, block_length=ids["block"],
                                     mask_id=ids["mask_id"], eos_ids={eos}, threshold=0.9)
    assert stopped.finish_reason == "stop" and stopped.token_ids == full.token_ids[:len(stopped.token_ids)]
    assert eos not in stopped.token_ids[:-1]
    with pytest.raises(ValueError, match="multiple of block_length"):
        ref.diffusion_generate(model, prompt, max_new_tokens=NEW_TOKENS + 1, block_length=ids["block"],
                               mask_id=ids["mask_id"], eos_ids=set())
