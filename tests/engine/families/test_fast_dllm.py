"""Fast-dLLM v2 (`Fast_dLLM_Qwen`): token shift and sub-block decoding against the full-recompute oracle
in testing/references/fast_dllm_qwen.py (Hugging Face `Qwen2ForCausalLM` under a
block-causal mask), through the offline pipeline on real tiny checkpoints in the published format
(tied and untied heads)."""

from __future__ import annotations

import json

import pytest

from bench import fast_dllm as fast_dllm_bench
from configs.trajectory import DllmTrajectory
from engine import EngineConfig, GenerationConfig, pipeline
from engine.errors import RequestError
from testing.references.fast_dllm_qwen import reference_fast_dllm_generate
from testing.tiny_fast_dllm import FAST_DLLM_TEST_LOGIT_SCALE, MASK_TEXT, load_hf_qwen2, write_tiny_fast_dllm

B = 32
PROMPT_LENGTHS = (1, 5, 31, 32, 33, 64)
THRESHOLDS = (0.9, 0.7, 0.5, 0.3)
TOL = 1e-4


def make_prompt(length: int) -> list[int]:
    return [(7 * i + 11 * length) % 300 + 1 for i in range(length)]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["untied", "tied"])
def ckpt(request, tmp_path_factory):
    tied = request.param == "tied"
    path = write_tiny_fast_dllm(tmp_path_factory.mktemp(f"fast_dllm_{request.param}"), tie_word_embeddings=tied,
                                seed=11 + tied, logit_scale=FAST_DLLM_TEST_LOGIT_SCALE)
    cfg = json.loads((path / "config.json").read_text())
    gen = json.loads((path / "generation_config.json").read_text())
    vocab = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    mask_id = next(t["id"] for t in vocab if t["content"] == MASK_TEXT)
    return path, load_hf_qwen2(path), mask_id, {cfg["eos_token_id"], *gen["eos_token_id"]}


def engine_config(**kw) -> EngineConfig:
    return EngineConfig(max_model_len=256, num_kv_blocks=128, kv_block_size=8, logprobs_mode="raw_logprobs", **kw)


def reference(ckpt, prompt, *, sub_block, threshold, max_new_tokens, stop_ids=()):
    _, hf, mask_id, eos = ckpt
    return reference_fast_dllm_generate(hf, prompt, block_length=B, sub_block_length=sub_block, mask_id=mask_id,
                                        max_new_tokens=max_new_tokens, stop_ids=eos | set(stop_ids),
                                        threshold=threshold)


def assert_equal(out, ref, what) -> None:
    assert out.token_ids == ref.token_ids, what
    assert out.step_map == ref.step_map, what
    assert out.finish_reason == ref.finish_reason, what
    assert len(out.logprobs) == len(out.token_ids), what
    for entry, token, want in zip(out.logprobs, out.token_ids, ref.logprobs, strict=True):
        assert abs(entry[token] - want) < TOL, what


@pytest.mark.parametrize("sub_block", [8, 16])
def test_greedy_equals_reference(ckpt, sub_block):
    """Every prompt length class (shorter than a block, inside one, exactly one or two blocks, one
    past), every threshold per request, 40 and 5 new tokens, all in one batch: tokens, step_map,
    finish reasons and raw logprobs equal the reference's."""
    cases = [(n, t, m) for n in PROMPT_LENGTHS for t in THRESHOLDS for m in (40, 5)]
    params = [GenerationConfig(max_new_tokens=m, dllm_confidence_threshold=t, logprobs=0) for _, t, m in cases]
    with pipeline(str(ckpt[0]), engine_config(dllm_sub_block_length=sub_block)) as pipe:
        outs = pipe([make_prompt(n) for n, _, _ in cases], params)
    multi = 0
    for (n, t, m), out in zip(cases, outs, strict=True):
        ref = reference(ckpt, make_prompt(n), sub_block=sub_block, threshold=t, max_new_tokens=m)
        assert_equal(out, ref, (n, t, m))
        multi += len(set(out.step_map)) < len(out.step_map)
    assert multi > len(cases) // 4, "thresholds should let steps reveal several tokens"


def test_batch_equals_single_and_forwards_per_block(ckpt):
    """A request alone costs exactly the reference's forwards (one per step: a block's inherited
    token comes from the forward that commits the block before it, never an extra one), and gives
    what it gives inside a batch."""
    lengths = (5, 32, 64)
    with pipeline(str(ckpt[0]), engine_config()) as pipe:
        batch = pipe([make_prompt(n) for n in lengths], GenerationConfig(max_new_tokens=59, ignore_eos=True,
                                                                         logprobs=0))
        for n, together in zip(lengths, batch, strict=True):
            before = pipe.engine.stats.forwards
            alone = pipe(make_prompt(n), GenerationConfig(max_new_tokens=59, ignore_eos=True, logprobs=0))
            forwards = pipe.engine.stats.forwards - before
            ref = reference(ckpt, make_prompt(n), sub_block=8, threshold=0.9, max_new_tokens=59)
            assert alone.token_ids == together.token_ids == ref.token_ids
            assert alone.step_map == together.step_map == ref.step_map
            if (n + 59) % B == 0:
                assert forwards == ref.forwards == max(ref.step_map), n
            for g in (g for g in range(59) if (n + g) % B == 0):  # an inherited token is a step of its own
                assert alone.step_map.count(alone.step_map[g]) == 1
                assert min(alone.step_map[g + 1 : g + B]) > alone.step_map[g]


def test_stop_id_mid_block(ckpt):
    """A stop id revealed in the middle of a block ends the output there (finish_reason stop)."""
    prompt = make_prompt(33)
    free = reference(ckpt, prompt, sub_block=8, threshold=0.7, max_new_tokens=40)
    stop = free.token_ids[9]
    ref = reference(ckpt, prompt, sub_block=8, threshold=0.7, max_new_tokens=40, stop_ids=[stop])
    assert ref.finish_reason == "stop" and len(ref.token_ids) <= 10
    with pipeline(str(ckpt[0]), engine_config()) as pipe:
        out = pipe(prompt, GenerationConfig(max_new_tokens=40, dllm_confidence_threshold=0.7, logprobs=0,
                                            stop_token_ids=[stop]))
    assert_equal(out, ref, "stop")


def test_family_defaults_and_refusals(ckpt):
    path = str(ckpt[0])
    with pipeline(path, engine_config()) as pipe:
        engine = pipe.engine
        assert engine.block_length == B and engine.config.dllm_confidence_threshold == 0.9
        assert engine.mask_id == ckpt[2] and pipe.tokenizer.mask_token is None
        for field, value in (("dllm_unmasking_strategy", "low_confidence_static"), ("dllm_denoising_steps", 4),
                             ("dllm_entropy_threshold", 1.0), ("dllm_edit_threshold", 0.5)):
            with pytest.raises(RequestError) as err:
                engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=4, **{field: value}))
            assert err.value.param == field and field in str(err.value)
        assert not engine.has_unfinished()
    for bad in (5, 64):
        with pytest.raises(ValueError, match="dllm_sub_block_length"):
            pipeline(path, engine_config(dllm_sub_block_length=bad))
    for field, value in (("dllm_unmasking_strategy", "sequential"), ("dllm_denoising_steps", 4)):
        with pytest.raises(ValueError, match=field):
            pipeline(path, engine_config(**{field: value}))


def test_bench_engine_equals_published_loop(ckpt):
    """bench.fast_dllm at toy size: its copy of the published loop and the engine give identical tokens
    at 1 and 8 concurrent requests."""
    out = fast_dllm_bench.measure(ckpt[0], tokens=40, prompt_len=20, device="cpu")
    for concurrency in (1, 8):
        assert out[f"concurrency_{concurrency}"]["identical_tokens"], concurrency


def test_step_trace_has_one_event_per_step(ckpt):
    """Replaying the trace's events gives the output and its step_map, inherited tokens included."""
    with pipeline(str(ckpt[0]), engine_config()) as pipe:
        out = pipe(make_prompt(32), GenerationConfig(max_new_tokens=40, ignore_eos=True, return_step_trace=True,
                                                     dllm_confidence_threshold=0.5))
    steps = [e["step"] for e in out.step_trace]
    assert steps == list(range(1, max(out.step_map) + 1))
    tokens, step_map = [None] * 40, [None] * 40
    for event in out.step_trace:
        for g, token in zip(event["positions"], event["token_ids"], strict=True):
            tokens[g], step_map[g] = token, event["step"]
    assert tokens == out.token_ids and step_map == out.step_map
    assert out.step_trace[0]["positions"] == [0] and out.step_trace[0]["step"] == 1  # inherited from the prompt


def test_sampling_inherits_the_argmax_and_batch_equals_single(ckpt):
    """Sampled requests: a block's inherited first token is still the argmax of its row (the top raw
    logprob), the other tokens are drawn; a seeded request gives the same alone and batched."""
    gen = GenerationConfig(max_new_tokens=70, ignore_eos=True, do_sample=True, temperature=1.5, random_seed=7,
                           logprobs=1, dllm_confidence_threshold=0.5)
    prompts = [make_prompt(n) for n in (5, 32, 33)]
    with pipeline(str(ckpt[0]), engine_config()) as pipe:
        batch = pipe(prompts, gen)
        alone = [pipe(p, gen) for p in prompts]
    drawn = 0
    for prompt, a, b in zip(prompts, alone, batch, strict=True):
        assert a.token_ids == b.token_ids and a.step_map == b.step_map
        for g, (token, entry) in enumerate(zip(a.token_ids, a.logprobs, strict=True)):
            top = max(entry.values())
            if (len(prompt) + g) % B == 0:
                assert entry[token] == top, (len(prompt), g)
            drawn += entry[token] < top
    assert drawn > 0, "sampling at temperature 1.5 should draw tokens other than the argmax"


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_trajectory_scoring_gives_the_logged_logprobs(ckpt, mode):
    """Rollouts scored from their trajectory (views in sub-block order, rows shifted, a block's first
    token scored on the finished block before it, which the sampler did not filter) give the logprobs
    generation logged, greedy and sampled."""
    prompts = [make_prompt(n) for n in (5, 32, 33)]
    rollout = [GenerationConfig(max_new_tokens=m, logprobs=0, return_dllm_replay=True, dllm_confidence_threshold=t,
                                **extra)
               for m, t, extra in ((40, 0.5, {}), (61, 0.9, {"ignore_eos": True}),
                                   (45, 0.3, {"do_sample": True, "temperature": 1.2, "top_k": 20, "random_seed": 3}))]
    with pipeline(str(ckpt[0]), engine_config().model_copy(update={"logprobs_mode": mode})) as pipe:
        outs = pipe(prompts, rollout)
        scored = pipe(prompts, [GenerationConfig(**{**r.model_dump(exclude_unset=True), "max_new_tokens": 0,
                                                    "return_dllm_replay": False,
                                                    "dllm_trajectory": DllmTrajectory.from_response(o)})
                                for r, o in zip(rollout, outs, strict=True)])
    for out, got in zip(outs, scored, strict=True):
        assert got.token_ids == out.token_ids and got.step_map == out.step_map
        for token, logged, value in zip(out.token_ids, out.logprobs, got.logprobs, strict=True):
            assert abs(value[token] - logged[token]) < 1e-5
