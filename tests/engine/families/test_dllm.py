"""Block-diffusion decoding against the full-recompute reference in testing/references/sdar.py."""

from __future__ import annotations

import json

import pytest

from engine import EngineConfig, GenerationConfig, Response, pipeline
from testing.references.sdar import reference_dllm_generate
from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, load_hf_reference, write_tiny_checkpoint

STRATEGIES = ["low_confidence_dynamic", "low_confidence_static", "sequential"]
ENTROPY_BOUNDS = [0.35, 2.0, 6.0]


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("sdar"), model_type="sdar", seed=3,
                                 logit_scale=DLLM_TEST_LOGIT_SCALE)
    cfg = json.loads((path / "config.json").read_text())
    gen = json.loads((path / "generation_config.json").read_text())
    stop_ids = {cfg["eos_token_id"], *gen["eos_token_id"]}
    return path, load_hf_reference(path), cfg["mask_token_id"], stop_ids


def _engine_config(**kw) -> EngineConfig:
    return EngineConfig(max_model_len=256, num_kv_blocks=256, kv_block_size=8, **kw)


def _prompts(block_length: int) -> list[list[int]]:
    """Prompt lengths covering every residue mod B (and a prompt shorter than one block)."""
    lengths = [block_length * 2, block_length * 2 + 1, block_length + 2, 3, 2 * block_length - 1]
    return [[(7 * i + 11 * n) % 300 + 1 for i in range(n)] for n in lengths]


def _check_against_reference(sdar, *, strategy, steps, block_length, max_new_tokens, stop_ids=None):
    path, hf, mask_id, eos = sdar
    prompts = _prompts(block_length)
    stops = eos | set(stop_ids or [])
    cfg = _engine_config(dllm_block_length=block_length, dllm_unmasking_strategy=strategy,
                         dllm_denoising_steps=steps, logprobs_mode="raw_logprobs")
    with pipeline(str(path), cfg) as pipe:
        outs = pipe(prompts, GenerationConfig(max_new_tokens=max_new_tokens, logprobs=0,
                                              stop_token_ids=list(stop_ids or [])))
    for prompt, out in zip(prompts, outs):
        ref = reference_dllm_generate(hf, prompt, block_length=block_length, mask_id=mask_id,
                                      max_new_tokens=max_new_tokens, stop_ids=stops, strategy=strategy,
                                      denoising_steps=steps, threshold=0.85)
        assert out.token_ids == ref.token_ids, (strategy, steps, len(prompt))
        assert out.step_map == ref.step_map, (strategy, steps, len(prompt))
        assert out.finish_reason == ref.finish_reason
        assert len(out.logprobs) == len(out.token_ids)
        for entry, tok, ref_lp in zip(out.logprobs, out.token_ids, ref.logprobs):
            assert abs(entry[tok] - ref_lp) < 1e-4
    return outs


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_matches_reference_b4(sdar, strategy, steps):
    _check_against_reference(sdar, strategy=strategy, steps=steps, block_length=4, max_new_tokens=13)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_matches_reference_b8(sdar, strategy):
    _check_against_reference(sdar, strategy=strategy, steps=3, block_length=8, max_new_tokens=19)


@pytest.mark.parametrize("block_length", [4, 8])
@pytest.mark.parametrize("bound", ENTROPY_BOUNDS)
def test_entropy_bounded_matches_reference(sdar, block_length, bound):
    path, hf, mask_id, eos = sdar
    prompts = _prompts(block_length)
    cfg = _engine_config(dllm_block_length=block_length, dllm_unmasking_strategy="entropy_bounded",
                         dllm_entropy_threshold=bound, logprobs_mode="raw_logprobs")
    with pipeline(str(path), cfg) as pipe:
        outs = pipe(prompts, GenerationConfig(max_new_tokens=17, logprobs=0))
    multi = 0
    for prompt, out in zip(prompts, outs):
        ref = reference_dllm_generate(hf, prompt, block_length=block_length, mask_id=mask_id, max_new_tokens=17,
                                      stop_ids=eos, strategy="entropy_bounded", denoising_steps=block_length,
                                      threshold=0.85, entropy_threshold=bound)
        assert (out.token_ids, out.step_map, out.finish_reason) == (ref.token_ids, ref.step_map, ref.finish_reason)
        assert all(abs(e[t] - lp) < 1e-4 for e, t, lp in zip(out.logprobs, out.token_ids, ref.logprobs))
        multi += len(out.step_map) - len(set(out.step_map))
    if bound >= 2.0:
        assert multi > 0, "a loose entropy bound should reveal several tokens in some step"


def test_per_request_decoding_knobs_equal_engines_configured_alike(sdar):
    """One batch mixing strategies, steps and thresholds per request equals, request by request,
    an engine configured with those settings (and the reference)."""
    path, hf, mask_id, eos = sdar
    knobs = [
        dict(dllm_unmasking_strategy="sequential", dllm_denoising_steps=2),
        dict(dllm_unmasking_strategy="low_confidence_dynamic", dllm_confidence_threshold=0.3),
        dict(dllm_unmasking_strategy="low_confidence_static", dllm_denoising_steps=3),
        dict(dllm_unmasking_strategy="entropy_bounded", dllm_entropy_threshold=2.0),
        dict(dllm_unmasking_strategy="low_confidence_dynamic", dllm_confidence_threshold=0.95, dllm_denoising_steps=1),
    ]
    prompts = _prompts(4)
    with pipeline(str(path), _engine_config(dllm_block_length=4)) as pipe:
        mixed = pipe(prompts, [GenerationConfig(max_new_tokens=15, **k) for k in knobs])
        with pytest.raises(ValueError, match="dllm_block_length"):
            pipe(prompts[0], GenerationConfig(max_new_tokens=4, dllm_block_length=8))
    for prompt, k, out in zip(prompts, knobs, mixed):
        with pipeline(str(path), _engine_config(dllm_block_length=4, **k)) as alone:
            single = alone(prompt, GenerationConfig(max_new_tokens=15))
        assert (out.token_ids, out.step_map) == (single.token_ids, single.step_map), k
        ref = reference_dllm_generate(
            hf, prompt, block_length=4, mask_id=mask_id, max_new_tokens=15, stop_ids=eos,
            strategy=k["dllm_unmasking_strategy"], denoising_steps=k.get("dllm_denoising_steps", 4),
            threshold=k.get("dllm_confidence_threshold", 0.85), entropy_threshold=k.get("dllm_entropy_threshold", 0.35))
        assert (out.token_ids, out.step_map) == (ref.token_ids, ref.step_map), k


def test_random_order_is_seeded_and_matches_reference(sdar):
    """`random` reveals each step's quota at positions drawn by the request's seed: the same seed gives
    the same order alone or batched, other seeds other orders, and every order equals the reference."""
    path, hf, mask_id, eos = sdar
    prompts = _prompts(4)[:3]
    seeds = [1, 2, 3]
    with pipeline(str(path), _engine_config(dllm_block_length=4, dllm_unmasking_strategy="random",
                                            dllm_denoising_steps=2)) as pipe:
        batched = pipe([prompts[0]] * 3, [GenerationConfig(max_new_tokens=12, random_seed=s) for s in seeds])
        alone = pipe(prompts[0], GenerationConfig(max_new_tokens=12, random_seed=1))
        others = pipe(prompts[1:], GenerationConfig(max_new_tokens=12, random_seed=7))
    assert (alone.token_ids, alone.step_map) == (batched[0].token_ids, batched[0].step_map)
    assert len({tuple(o.step_map) for o in batched}) > 1
    cases = [(prompts[0], s, o) for s, o in zip(seeds, batched)] + list(zip(prompts[1:], [7, 7], others))
    for prompt, seed, out in cases:
        ref = reference_dllm_generate(hf, prompt, block_length=4, mask_id=mask_id, max_new_tokens=12, stop_ids=eos,
                                      strategy="random", denoising_steps=2, threshold=0.85, seed=seed)
        assert (out.token_ids, out.step_map) == (ref.token_ids, ref.step_map), seed


def test_max_new_tokens_shorter_than_first_partial_block(sdar):
    outs = _check_against_reference(sdar, strategy="low_confidence_dynamic", steps=4, block_length=8,
                                    max_new_tokens=2)
    assert all(len(o.token_ids) == 2 and o.finish_reason == "length" for o in outs)


def test_stop_id_inside_a_block(sdar):
    path, hf, mask_id, eos = sdar
    prompt = _prompts(4)[1]
    free = reference_dllm_generate(hf, prompt, block_length=4, mask_id=mask_id, max_new_tokens=16,
                                   stop_ids=eos, strategy="low_confidence_dynamic", denoising_steps=4,
                                   threshold=0.85)
    stop = free.token_ids[6]  # the stop id appears mid-block (block 2 of a prompt of length 9)
    outs = _check_against_reference(sdar, strategy="low_confidence_dynamic", steps=4, block_length=4,
                                     max_new_tokens=16, stop_ids=[stop])
    out = outs[1]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop
    assert len(out.token_ids) <= 7


def test_dynamic_unmasking_reveals_several_tokens_per_step(sdar):
    path = sdar[0]
    with pipeline(str(path), _engine_config()) as pipe:
        outs = pipe(_prompts(4), GenerationConfig(max_new_tokens=24, ignore_eos=True))
    tokens = sum(len(o.token_ids) for o in outs)
    steps = sum(len(set(o.step_map)) for o in outs)
    assert tokens / steps > 1.2, "the test checkpoint should let dynamic unmasking do real work"
    assert any(len(o.step_map) > len(set(o.step_map)) for o in outs)


def test_step_map_invariants(sdar):
    with pipeline(str(sdar[0]), _engine_config()) as pipe:
        out = pipe(_prompts(4)[0], GenerationConfig(max_new_tokens=20, ignore_eos=True))
    sm = out.step_map
    assert len(sm) == len(out.token_ids) and sm[0] >= 1 and min(sm) == 1
    blocks = [sm[i : i + 4] for i in range(0, len(sm), 4)]
    for earlier, later in zip(blocks, blocks[1:]):
        assert max(earlier) < min(later)


def test_commit_fusion_is_exact_and_saves_a_forward_per_block(sdar):
    path = sdar[0]
    prompts = _prompts(4)
    params = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    results, forwards = {}, {}
    for fusion in (True, False):
        with pipeline(str(path), _engine_config(dllm_commit_fusion=fusion)) as pipe:
            results[fusion] = [(o.token_ids, o.step_map) for o in (pipe(p, params) for p in prompts)]
            forwards[fusion] = pipe.engine.stats.forwards
    assert results[True] == results[False]
    # one request at a time: every block after the first needs an unfused commit forward
    assert forwards[True] < forwards[False]


def test_forwards_per_block_equal_denoising_forwards(sdar):
    """With fusion, a lone request spends exactly one forward per unmasking step."""
    with pipeline(str(sdar[0]), _engine_config(dllm_unmasking_strategy="sequential")) as pipe:
        out = pipe(_prompts(4)[0], GenerationConfig(max_new_tokens=16, ignore_eos=True))
        assert pipe.engine.stats.forwards == max(out.step_map) == 16


def test_stream_concatenates_to_unary_and_trace_rebuilds_step_map(sdar):
    path = sdar[0]
    params = GenerationConfig(max_new_tokens=18, ignore_eos=True, logprobs=2, return_step_trace=True)
    with pipeline(str(path), _engine_config(logprobs_mode="raw_logprobs")) as pipe:
        prompt = _prompts(4)[2]
        unary = pipe(prompt, params)
        chunks = list(pipe.stream(prompt, params))
    streamed = Response.from_chunks(chunks)
    for field in ("text", "token_ids", "step_map", "logprobs", "finish_reason", "step_trace"):
        assert getattr(streamed, field) == getattr(unary, field), field
    rebuilt: dict[int, int] = {}
    for event in streamed.step_trace:
        for pos, tok in zip(event["positions"], event["token_ids"]):
            rebuilt[pos] = event["step"]
            assert streamed.token_ids[pos] == tok
    assert [rebuilt[i] for i in range(len(streamed.token_ids))] == streamed.step_map
    # the trace shows a step before its block is complete: an event names a position whose
    # token had not been streamed yet when the event arrived
    seen, early = 0, False
    for chunk in chunks:
        for event in chunk.step_trace or []:
            early |= any(p >= seen + len(chunk.token_ids) for p in event["positions"])
        seen += len(chunk.token_ids)
    assert early
    assert len(chunks) > len(streamed.token_ids) // 4


def test_without_trace_request_the_fields_are_none(sdar):
    with pipeline(str(sdar[0]), _engine_config()) as pipe:
        out = pipe(_prompts(4)[0], GenerationConfig(max_new_tokens=6))
    assert out.step_trace is None and out.logprobs is None and out.step_map is not None
