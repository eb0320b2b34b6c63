"""A sequence's sampler group kept from step to step (`Sequence.keep_row_group`) is the group the strategy would
build afresh at that step: every step of a mixed batch is checked against a fresh build, and only the
greedy requests with nothing step-dependent keep one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import EngineConfig, GenerationConfig, pipeline

PLAIN = GenerationConfig(max_new_tokens=12, ignore_eos=True)
STEP_DEPENDENT = {  # each changes the group between steps, or draws
    "floor": GenerationConfig(max_new_tokens=12, ignore_eos=True, min_new_tokens=6),
    "sampled": GenerationConfig(max_new_tokens=12, ignore_eos=True, do_sample=True, temperature=0.8, random_seed=5),
    "penalty": GenerationConfig(max_new_tokens=12, ignore_eos=True, repetition_penalty=1.3),
}


def fields(group) -> dict:
    """The group as the sampler reads it: a greedy row never reads its draw counter."""
    out = {f.name: getattr(group, f.name) for f in dataclasses.fields(group)}
    if group.params.is_greedy:
        del out["first_draw"]
    return out


@pytest.mark.parametrize("model", ["ar", "dllm"])
def test_kept_groups_equal_fresh_ones(ar_ckpt, dllm_ckpt, model):
    ckpt, extra = (ar_ckpt, {}) if model == "ar" else (dllm_ckpt, {"dllm_block_length": 4})
    with pipeline(ckpt, EngineConfig(kv_block_size=4, **extra)) as pipe:
        decoding = pipe.engine.decoding
        build = decoding.row_groups
        kept: dict[str, bool] = {}

        def checked(slices):
            groups = build(slices)
            for sl, group in zip(slices, groups, strict=True):
                seq, was = sl.seq, sl.seq.row_group
                seq.row_group = None
                (fresh,) = build([sl])
                seq.row_group = was
                assert fields(group) == fields(fresh), seq.request_id
                kept[seq.request_id] = kept.get(seq.request_id, False) or was is not None
            return groups

        decoding.row_groups = checked
        prompts = [torch.arange(3 + i, 9 + 2 * i).tolist() for i in range(1 + len(STEP_DEPENDENT))]
        engine = pipe.engine
        ids = [engine.add_request(p, params) for p, params in zip(prompts, [PLAIN, *STEP_DEPENDENT.values()])]
        while engine.has_unfinished():
            engine.step()
    assert kept == {ids[0]: True, **{rid: False for rid in ids[1:]}}
