"""Nemotron-Labs-Diffusion served by the engine's seeded block decoding, against the release's loops
(testing/references/nemotron_labs_diffusion.py) on the tiny checkpoint, float32 on the CPU.

`dllm_mode="diffusion"` (the default) gives the reference's tokens, step maps, `num_steps` and raw
logprobs exactly (logprobs within float error): every threshold rule, prompts whose blocks start at
different offsets, outputs over several blocks, greedy and seeded sampling, alone and batched with
`ar` requests of the same engine, ended by a stop id inside a block or by a length that is no
multiple of the block, with the mask id as a candidate, through preemptions, prefill chunks, the
overlap schedule, a prefix-cache hit and every attention backend the CPU runs. `ar` requests decode
as the autoregressive loop does, with no step map. Bad modes are refused naming `dllm_mode`.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from deployments.errors import ApiError
from deployments.sglang.serving import generate_plan
from engine import EngineConfig, GenerationConfig, pipeline
from engine.carrier import Response
from engine.errors import RequestError
from testing.references import nemotron_labs_diffusion as ref
from testing.tiny.nemotron_labs_diffusion import load_ministral3, write_tiny_nemotron_labs_diffusion
from tests.support import nemotron
from tests.support.nemotron import (
    LOGIT_SCALE,
    NEW_TOKENS,
    TOL,
    assert_same,
    assert_speculated,
    diffusion,
    gen,
    make_prompt,
    speculation,
)

ckpt, model, ids = nemotron.ckpt, nemotron.model, nemotron.ids  # the tiny checkpoint's fixtures
LENGTHS = (1, 7, 40)  # blocks start at the prompt end: 1, 7, 40 -- none a multiple of the block
THRESHOLDS = (None, 0.9, 0.5)


@pytest.fixture(scope="module")
def pipe(ckpt):
    with pipeline(str(ckpt), EngineConfig(max_model_len=128, kv_block_size=8, logprobs_mode="raw_logprobs")) as p:
        yield p


@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("length", LENGTHS)
def test_greedy_diffusion_equals_the_release_loop(pipe, model, ids, threshold, length):
    prompt = make_prompt(length)
    want = diffusion(model, ids, prompt, threshold)
    out = pipe(prompt, gen(threshold))
    assert_same(out, want)
    assert out.finish_reason == "length" and want.finish_reason == "length"
    assert out.num_steps == want.nfe, "1 + denoising passes + (blocks - 1): the loop's forwards less the last commit"


@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_seeded_sampling_draws_as_the_release_loop(pipe, model, ids, threshold):
    """At T = 1 every draw -- the seeds' multinomials, each pass's float64 uniforms -- comes from the
    request's own generator in the release's order: a seed replays the loop run with that seed."""
    prompt = make_prompt(7)
    want = diffusion(model, ids, prompt, threshold, temperature=1.0, seed=11)
    out = pipe(prompt, gen(threshold, do_sample=True, temperature=1.0, random_seed=11))
    assert_same(out, want)
    other = diffusion(model, ids, prompt, threshold, temperature=1.0, seed=12)
    assert other.token_ids != want.token_ids


def test_batched_with_ar_requests_each_decodes_as_alone(pipe, model, ids):
    """Diffusion requests (every threshold, greedy and seeded) and `ar` requests in the same forwards."""
    prompts = [make_prompt(n) for n in LENGTHS]
    configs, wants = [], []
    for prompt, threshold in zip(prompts, THRESHOLDS, strict=True):
        configs.append(gen(threshold))
        wants.append(diffusion(model, ids, prompt, threshold))
    configs.append(gen(0.9, do_sample=True, temperature=0.8, random_seed=3))
    wants.append(diffusion(model, ids, prompts[1], 0.9, temperature=0.8, seed=3))
    ar_prompts = [make_prompt(n) for n in (5, 33)]
    ar = [ref.ar_generate(model, p, max_new_tokens=NEW_TOKENS, eos_ids=set()) for p in ar_prompts]
    outs = pipe([*prompts, prompts[1], *ar_prompts], configs + [gen(None, dllm_mode="ar")] * 2)
    for out, want in zip(outs, wants, strict=False):
        assert_same(out, want)
    for out, want in zip(outs[len(wants):], ar, strict=True):
        assert out.token_ids == want.token_ids and out.step_map is None and out.num_steps is None
        got = [next(iter(entry.values())) for entry in out.logprobs]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want.logprobs), atol=TOL, rtol=0)


def test_a_stop_id_inside_a_block_ends_the_output_where_the_release_does(pipe, model, ids):
    """The release breaks a block's denoising once an eos has no mask before it and cuts after the first
    eos: a stop id the loop writes mid-output ends both at the same token and step."""
    prompt = make_prompt(7)
    full = diffusion(model, ids, prompt, 0.9)
    stop = full.token_ids[11]
    want = diffusion(model, ids, prompt, 0.9, eos={stop})
    out = pipe(prompt, gen(0.9, stop_token_ids=[stop]))
    assert_same(out, want)
    assert out.finish_reason == want.finish_reason == "stop" and out.token_ids[-1] == stop


def test_a_length_off_the_block_grid_cuts_the_last_block(pipe, model, ids):
    prompt = make_prompt(40)
    want = diffusion(model, ids, prompt, 0.5, new_tokens=16)
    out = pipe(prompt, gen(0.5, max_new_tokens=13))
    assert_same(out, want, cut=13)
    assert out.finish_reason == "length"


def test_a_prefix_cache_hit_decodes_the_same(pipe, model, ids):
    """A denoising pass writes its block's K/V slots and the commit rewrites them: only committed
    (causal) K/V reach the prefix cache, so a request that reuses them decodes as the first did."""
    prompt = make_prompt(40)
    first, again = pipe(prompt, gen(None)), pipe(prompt, gen(None))
    assert again.token_ids == first.token_ids and again.step_map == first.step_map
    assert pipe.engine.kv.prefix_hit_tokens > 0
    assert_same(first, diffusion(model, ids, prompt))


def test_ar_mode_is_the_autoregressive_loop(pipe, model):
    prompt = make_prompt(40)
    want = ref.ar_generate(model, prompt, max_new_tokens=NEW_TOKENS, eos_ids=set())
    out = pipe(prompt, gen(None, dllm_mode="ar", return_step_trace=True))
    assert out.token_ids == want.token_ids and out.step_map is None and out.num_steps is None
    assert not out.step_trace


def test_an_ar_mode_read_scores_each_slot_as_the_causal_model_does(pipe, model):
    """dllm_mode='ar' takes typed decisions as an autoregressive model: pinned tokens forced, each slot's
    label logprobs the causal log-softmax at its row (the prompt and the template before it)."""
    prompt, labels = make_prompt(12), [5, 9, 17]
    template = [-1, 40, 41, -1]
    out = pipe(prompt, GenerationConfig(max_new_tokens=8, dllm_mode="ar", dllm_template=template,
                                        dllm_allowed_token_ids=labels, dllm_read_only=True))
    assert out.finish_reason == "read" and out.token_ids[1:3] == [40, 41] and len(out.token_ids) == 4
    for g in (0, 3):
        with torch.no_grad():
            row = model(torch.tensor([prompt + out.token_ids[:g]])).logits[0, -1].float().log_softmax(-1)
        assert out.token_ids[g] == max(labels, key=lambda t: row[t])
        assert set(out.logprobs[g]) == set(labels)
        assert all(abs(v - float(row[t])) < 1e-4 for t, v in out.logprobs[g].items())
        assert abs(out.label_mass[g] - float(row[labels].exp().sum())) < 1e-4


@pytest.mark.parametrize("decisions", [
    {"dllm_template": [-1, 40, -1, 41]},
    {"dllm_template": [-1, 40, -1, 41], "dllm_allowed_token_ids": [5, 9, 17]},
    {"dllm_template": [-1, 40, 41, -1], "dllm_allowed_token_ids": [5, 9, 17], "dllm_read_only": True}])
def test_linear_spec_takes_typed_decisions_as_ar(pipe, decisions):
    """LinearSpec's output is ar's: with typed decisions a linear_spec request decodes as ar (the same
    tokens, logprobs and label masses, no speculation fields)."""
    prompt = make_prompt(12)
    spec, ar = (pipe(prompt, GenerationConfig(max_new_tokens=8, logprobs=0, dllm_mode=mode, **decisions))
                for mode in ("linear_spec", "ar"))
    assert (spec.token_ids, spec.logprobs, spec.label_mass) == (ar.token_ids, ar.logprobs, ar.label_mass)
    assert spec.token_ids[1] == 40 and spec.nfe is None and spec.acceptance_lengths is None


def test_modes_are_named_as_the_table_and_sglang_name_them(pipe, model, ids):
    prompt = make_prompt(7)
    assert pipe(prompt, gen(None, dllm_mode="FastDiffuser")).token_ids == diffusion(model, ids, prompt).token_ids
    with pytest.raises(ValueError, match="dllm_mode"):
        GenerationConfig(dllm_mode="autoregressive")


def test_a_bad_mode_over_http_is_a_400_naming_the_field():
    with pytest.raises(ApiError) as err:
        generate_plan({"text": "hi", "sampling_params": {"dllm_mode": "autoregressive"}})
    assert err.value.param == "sampling_params.dllm_mode" and "dllm_mode" in err.value.message


@pytest.mark.parametrize(("fields", "field"), [
    ({"dllm_mode": "ar", "dllm_confidence_threshold": 0.9}, "dllm_confidence_threshold"),
    ({"dllm_mode": "linear_spec", "top_p": 0.5}, "top_p"),
    ({"top_k": 5}, "top_k"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"dllm_block_length": 4}, "dllm_block_length"),
    ({"dllm_unmasking_strategy": "sequential"}, "dllm_unmasking_strategy"),
])
def test_what_a_mode_cannot_do_is_refused_by_name(pipe, fields, field):
    with pytest.raises(RequestError) as err:
        pipe.engine.add_request(make_prompt(3), GenerationConfig(max_new_tokens=8, **fields))
    assert err.value.param == field and field in str(err.value)
    assert not pipe.engine.has_unfinished()


@pytest.mark.parametrize("threshold", [None, 0.5])
@pytest.mark.parametrize("length", [7, 20])
def test_linear_spec_is_the_release_loop_and_greedy_equals_ar(pipe, model, ids, threshold, length):
    """Drafts (one pass at threshold 0, else passes until no mask) and causal verifies as the release:
    the same tokens, steps, logprobs (the verify rows'), forwards and acceptance lengths; greedy output is
    greedy AR's token for token."""
    prompt = make_prompt(length)
    out = pipe(prompt, gen(threshold, dllm_mode="LinearSpec"))
    assert_speculated(out, speculation(model, ids, prompt, threshold))
    assert out.token_ids == ref.ar_generate(model, prompt, max_new_tokens=NEW_TOKENS, eos_ids=set()).token_ids


def test_linear_spec_accepts_several_drafts_where_the_model_agrees_with_itself(ckpt, ids):
    """A head that makes one token the argmax of every row: drafts match the verify, so an iteration
    accepts the whole block (B tokens for two forwards), and the K/V kept are those of the accepted
    drafts (the output stays the release's)."""
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["diffusion_head.weight"][17] = tensors["diffusion_head.weight"].abs().sum(0) * 4
    path = ckpt.parent / "agreeing"
    path.mkdir(exist_ok=True)
    for f in ckpt.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    prompt = make_prompt(9)
    config = EngineConfig(max_model_len=128, kv_block_size=8, logprobs_mode="raw_logprobs")
    with pipeline(str(path), config) as p:
        out = p(prompt, gen(None, dllm_mode="linear_spec"))
    want = speculation(load_ministral3(path), ids, prompt)
    assert max(want.acceptance) == ids["block"]
    assert_speculated(out, want)


def test_seeded_linear_spec_draws_as_the_release_loop(pipe, model, ids):
    """Sampled: the seed's multinomial, every draft's and every verify's, from the request's generator in
    the release's order."""
    prompt = make_prompt(7)
    out = pipe(prompt, gen(None, dllm_mode="linear_spec", do_sample=True, temperature=0.8, random_seed=3))
    assert_speculated(out, speculation(model, ids, prompt, temperature=0.8, seed=3))


def test_every_mode_batched_and_retracted_decodes_as_alone(ckpt, model, ids):
    """linear_spec, diffusion and ar requests in the same forwards, in a cache too small for all of them
    (they preempt one another, mid-iteration too), with the overlap schedule: each is its loop's."""
    prompts = [make_prompt(n) for n in LENGTHS]
    config = EngineConfig(max_model_len=128, kv_block_size=8, num_kv_blocks=12, overlap_schedule=True,
                          logprobs_mode="raw_logprobs")
    with pipeline(str(ckpt), config) as p:
        outs = p([*prompts, prompts[0], prompts[1]],
                 [gen(None, dllm_mode="linear_spec"), gen(0.5, dllm_mode="linear_spec"),
                  gen(None, dllm_mode="linear_spec", do_sample=True, temperature=0.8, random_seed=5),
                  gen(0.9), gen(None, dllm_mode="ar")])
        assert p.engine.scheduler.num_preemptions > 0
    assert_speculated(outs[0], speculation(model, ids, prompts[0]))
    assert_speculated(outs[1], speculation(model, ids, prompts[1], 0.5))
    assert_speculated(outs[2], speculation(model, ids, prompts[2], temperature=0.8, seed=5))
    assert_same(outs[3], diffusion(model, ids, prompts[0], 0.9))
    assert outs[4].token_ids == ref.ar_generate(model, prompts[1], max_new_tokens=NEW_TOKENS, eos_ids=set()).token_ids


def test_linear_spec_over_http_reports_its_forwards_and_acceptance(pipe, model, ids):
    """/generate's meta_info carries `nfe` and `acceptance_lengths`; a stream's deltas add up to them."""
    from deployments.sglang.serving import generate_body

    prompt = make_prompt(7)
    want = speculation(model, ids, prompt)
    engine = pipe.engine
    engine.add_request(prompt, gen(None, dllm_mode="linear_spec"), "spec")
    chunks = []
    while engine.has_unfinished():
        chunks += engine.step()
    whole = Response.from_chunks(chunks)
    meta = generate_body(whole, gen(None))["meta_info"]
    assert meta["nfe"] == want.nfe and meta["acceptance_lengths"] == want.acceptance
    assert sum(len(c.acceptance_lengths or []) for c in chunks) == len(want.acceptance)


def test_an_engine_default_mode_of_linear_spec_applies(ckpt, model, ids):
    prompt = make_prompt(7)
    with pipeline(str(ckpt), EngineConfig(max_model_len=128, dllm_mode="linear_spec")) as p:
        out = p(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert out.token_ids == speculation(model, ids, prompt).token_ids and out.nfe is not None


def test_the_engine_default_mode_and_threshold_apply(ckpt, model, ids):
    prompt = make_prompt(7)
    config = EngineConfig(max_model_len=128, dllm_mode="ar", dllm_confidence_threshold=0.5)
    with pipeline(str(ckpt), config) as p:
        ar = p(prompt, GenerationConfig(max_new_tokens=8, ignore_eos=True))
        assert ar.token_ids == ref.ar_generate(model, prompt, max_new_tokens=8, eos_ids=set()).token_ids
        out = p(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True, dllm_mode="diffusion"))
    assert out.token_ids == diffusion(model, ids, prompt, 0.5).token_ids


def test_a_request_retracted_mid_block_recomputes_its_prefix_and_decodes_the_same(pipe, model, ids):
    """Retracted while a block is being denoised (its K/V gone), a request first recomputes its causal
    prefix, then denoises on: its output is the loop's."""
    engine, prompt = pipe.engine, make_prompt(7)
    rid = engine.add_request(prompt, gen(0.9))
    response = Response(index=0)
    for step in range(40):
        for chunk in engine.step():
            response.add(chunk)
        if step in (2, 9):  # block 0 mid-denoising, then a later block
            assert engine.retract_all() == 1
        if not engine.has_unfinished():
            break
    assert engine.scheduler.num_preemptions >= 2 and rid not in engine.seqs
    assert_same(response, diffusion(model, ids, prompt, 0.9))


@pytest.mark.parametrize("backend", ["triton", "flex"])
def test_every_attention_backend_runs_the_bidirectional_passes(ckpt, model, ids, backend):
    """The Triton kernel (under its interpreter here) in its pass mode and eager FlexAttention attend a
    denoising pass as the torch backend does, beside an `ar` request."""
    prompt = make_prompt(7)
    config = EngineConfig(max_model_len=128, kv_block_size=8, attention_backend=backend, logprobs_mode="raw_logprobs")
    with pipeline(str(ckpt), config) as p:
        out, ar = p([prompt, prompt[:5]], [gen(0.9, max_new_tokens=16), gen(None, max_new_tokens=8, dllm_mode="ar")])
    assert_same(out, diffusion(model, ids, prompt, 0.9, new_tokens=16))
    assert ar.token_ids == ref.ar_generate(model, prompt[:5], max_new_tokens=8, eos_ids=set()).token_ids


def test_preemptions_prefill_chunks_and_the_overlap_schedule_change_nothing(ckpt, model, ids):
    """A cache too small for the three requests at once (they preempt one another, mid-block too), a
    prefill budget that cuts the 40-token prompt into chunks, and forwards overlapped with applying."""
    prompts = [make_prompt(n) for n in LENGTHS]
    config = EngineConfig(max_model_len=128, kv_block_size=8, num_kv_blocks=12, max_prefill_token_num=16,
                          overlap_schedule=True, logprobs_mode="raw_logprobs")
    with pipeline(str(ckpt), config) as p:
        outs = p(prompts, [gen(t) for t in THRESHOLDS])
        assert p.engine.scheduler.num_preemptions > 0
    for out, prompt, threshold in zip(outs, prompts, THRESHOLDS, strict=True):
        assert_same(out, diffusion(model, ids, prompt, threshold))


def test_the_mask_id_as_a_candidate_reveals_nothing_as_in_the_release(tmp_path, model, ids):
    """The head's mask row made a slightly larger copy of a frequent token's: the mask id often wins a
    position's argmax. Written back it reveals nothing; a position still masked when its block ends keeps
    the mask id with step 0 and no logprob, and `num_steps` counts every pass (the loop's forwards)."""
    prompts = [make_prompt(n) for n in LENGTHS]
    frequent = Counter(t for p in prompts for t in diffusion(model, ids, p).token_ids).most_common(1)[0][0]
    path = write_tiny_nemotron_labs_diffusion(tmp_path, seed=5, logit_scale=LOGIT_SCALE)
    tensors = load_file(str(path / "model.safetensors"))
    head = tensors["diffusion_head.weight"]
    head[ids["mask_id"]] = head[frequent] * 1.02
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    masked_model = load_ministral3(path)
    config = EngineConfig(max_model_len=128, kv_block_size=8, logprobs_mode="raw_logprobs")
    with pipeline(str(path), config) as p:
        outs = p(prompts * 2, [gen(t) for t in (None, None, None, 0.5, 0.5, 0.5)])
    unrevealed = 0
    for out, prompt, threshold in zip(outs, prompts * 2, (None, None, None, 0.5, 0.5, 0.5), strict=True):
        want = diffusion(masked_model, ids, prompt, threshold)
        assert out.token_ids == want.token_ids and out.step_map == want.step_map
        assert out.num_steps == want.nfe
        got = [math.nan if entry is None else next(iter(entry.values())) for entry in out.logprobs]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want.logprobs), atol=TOL, rtol=0, equal_nan=True)
        unrevealed += want.step_map.count(0)
    assert unrevealed > 0


@pytest.mark.parametrize(("algorithm", "mode"), [("LinearSpec", "linear_spec"), ("FastDiffuser", "diffusion")])
def test_sglang_algorithm_flags_choose_the_engine_mode(algorithm, mode):
    """`blockserve serve --dllm-algorithm LinearSpec|FastDiffuser`, SGLang's flags, set the engine's mode."""
    from deployments.cli import app_args, build_parser

    engine = app_args(build_parser().parse_args(["serve", "ckpt", "--dllm-algorithm", algorithm]))["engine"]
    assert engine == {"dllm_mode": mode}
    assert EngineConfig(**engine).dllm_mode == mode


# ---- typed decisions in diffusion mode ---------------------------------------------------------------
DECISION_CASES = [  # (template, allowed sets, read steps, threshold)
    ([None, 40, 41, None, None, 42, None, None, None, 43, 44, 45, 46, 47, 48, 49, 50, None], None, None, None),
    ([41, None, None, 42], [5, 9, 17, 33], None, 0.9),  # the first block's seed pinned
    ([None, 40, None, None, *range(50, 62)], {0: [5, 9], 3: [7, 8, 9]}, 1, None),  # pinned blocks after the read's
    ([None, 40, None, None, None, None, 45, None, None, 50, None], [5, 9, 17, 33, 40, 45, 50], 2, 0.5),
    (None, [5, 9, 17], None, None),  # every position a slot
]


def decided(model, ids, prompt, case, temperature=0.0, seed=None) -> tuple[ref.LoopResult, dict[int, float]]:
    template, allowed, read, threshold = case
    mass: dict[int, float] = {}
    want = ref.diffusion_generate(model, prompt, max_new_tokens=24, block_length=ids["block"], mask_id=ids["mask_id"],
                                  eos_ids=set(), threshold=threshold, temperature=temperature,
                                  generator=None if seed is None else torch.Generator().manual_seed(seed),
                                  template=template, allowed=allowed, read_steps=read, label_mass=mass)
    return want, mass


def test_diffusion_mode_decisions_are_the_release_loop_with_the_block_prefilled(pipe, model, ids):
    """Pins written when their block opens (a pinned seed after its draw), slots within their sets, reads
    (k = 1, 2) ending at the template: tokens, step maps, logprobs and label mass are the loop's, greedy and
    seeded, every case in one batch."""
    prompts, configs, wants = [], [], []
    for i, case in enumerate(DECISION_CASES):
        template, allowed, read, threshold = case
        for temperature, seed in ((0.0, None), (0.8, 3)):
            prompts.append(make_prompt(7 + i))
            sampled = {"do_sample": True, "temperature": temperature, "random_seed": seed} if temperature else {}
            configs.append(gen(threshold, max_new_tokens=24, dllm_template=template, dllm_allowed_token_ids=allowed,
                               dllm_read_only=read is not None or None, dllm_max_steps=read, **sampled))
            wants.append(decided(model, ids, prompts[-1], case, temperature, seed))
    for out, (want, mass), config in zip(pipe(prompts, configs), wants, configs, strict=True):
        assert_same(out, want)
        if config.dllm_allowed_token_ids is None:
            assert out.label_mass is None and not mass
            continue
        got = {g: m for g, m in enumerate(out.label_mass) if m is not None}
        assert got.keys() == mass.keys() and all(abs(got[g] - mass[g]) < TOL for g in mass)
