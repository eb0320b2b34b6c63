"""engine.jetengine: TraceRL's rollout calls run unchanged but for the import; outputs equal
engine.pipeline under the same rule for every remasking name; a weight reload between two calls
switches the outputs to the new weights'. One LLM and one reference pipeline serve the module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import EngineConfig, GenerationConfig, pipeline
from engine.jetengine import LLM, SamplingParams
from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, load_hf_reference, write_tiny_checkpoint

STRATEGIES = ("sequential", "low_confidence_static", "low_confidence_dynamic", "entropy_bounded", "random")
KV = dict(gpu_memory_utilization=0.05)  # of the CPU KV budget: what a test machine affords


def mask_id(ckpt: str) -> int:
    return json.loads((Path(ckpt) / "config.json").read_text())["mask_token_id"]


@pytest.fixture(scope="module")
def llm(dllm_ckpt):
    # TraceRL's construction (rollout worker), with the mask id of this checkpoint
    engine = LLM(dllm_ckpt, enforce_eager=True, tensor_parallel_size=1, mask_token_id=mask_id(dllm_ckpt),
                 block_length=4, **KV)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def ref(dllm_ckpt):
    with pipeline(dllm_ckpt, EngineConfig(dllm_block_length=4, logprobs_mode="processed_logprobs")) as pipe:
        yield pipe


def reference(pipe, prompts, sp: SamplingParams, **extra) -> list:
    """What engine.pipeline gives for JetEngine's settings."""
    config = GenerationConfig(max_new_tokens=sp.max_tokens, do_sample=True, temperature=sp.temperature,
                              top_k=sp.topk, top_p=sp.topp, random_seed=sp.seed, dllm_block_length=sp.block_length,
                              dllm_denoising_steps=sp.denoising_steps, dllm_confidence_threshold=sp.dynamic_threshold,
                              dllm_entropy_threshold=sp.eb_threshold, dllm_unmasking_strategy=sp.remasking_strategy,
                              skip_special_tokens=False, include_stop_str_in_output=True, logprobs=0, **extra)
    return pipe(prompts, config)


def check_equal(outs: list[dict], want: list) -> None:
    """Tokens, text and trajectories exactly; logprobs to float tolerance (batches differ in rounding)."""
    for o, w in zip(outs, want, strict=True):
        assert o["token_ids"] == w.token_ids and o["text"] == w.text
        assert o["trajectory"] == o["first_unmask_times"] == w.step_map
        assert len(o["logprobs"]) == len(o["entropies"]) == len(o["token_ids"])
        assert o["logprobs"] == pytest.approx([next(iter(e.values())) for e in w.logprobs], abs=1e-4)
        assert all(e >= 0.0 for e in o["entropies"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tracerl_rollout_equals_engine_pipeline(llm, ref, strategy):
    sampling_kwargs = dict(temperature=0.0, topk=0, topp=1.0, max_tokens=8, remasking_strategy=strategy,
                           block_length=4, denoising_steps=4, dynamic_threshold=0.9)
    sp = SamplingParams(**sampling_kwargs, seed=3 if strategy == "random" else None)
    prompts = ["Explain reinforcement learning.", [5, 6, 7, 8, 9, 10], "Hi"]
    outs = llm.generate_streaming(prompts, sp, max_active=2)
    triples = [(j, o["text"], o.get("first_unmask_times", None)) for j, o in enumerate(outs)]  # TraceRL's read
    assert [t[0] for t in triples] == [0, 1, 2] and all(t[2] for t in triples)
    ids = [ref.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else p for p in prompts]
    check_equal(outs, reference(ref, ids, sp))


def test_sampled_rollout_with_a_seed_equals_engine_pipeline(llm, ref):
    sp = SamplingParams(temperature=0.8, topk=20, topp=0.9, max_tokens=8, remasking_strategy="random", seed=11)
    check_equal(llm.generate([[3, 4, 5, 6, 7]], sp), reference(ref, [[3, 4, 5, 6, 7]], sp))


def test_stop_words_replace_eos_and_ignore_eos_turns_both_off(llm, ref):
    prompt = [[8, 9, 10, 11]]
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    stop = free["token_ids"][4]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, stop_words=[stop]))[0]
    assert out["token_ids"] == free["token_ids"][:free["token_ids"].index(stop) + 1]
    assert len(out["first_unmask_times"]) == len(out["token_ids"])


def test_weight_reload_between_calls_serves_the_new_weights(dllm_ckpt, tmp_path):
    other = write_tiny_checkpoint(tmp_path / "other", model_type="sdar", seed=9, logit_scale=DLLM_TEST_LOGIT_SCALE)
    sp = SamplingParams(temperature=0.0, max_tokens=8, remasking_strategy="low_confidence_dynamic")
    prompts = [[1, 2, 3, 4, 5]]
    llm = LLM(dllm_ckpt, enforce_eager=True, mask_token_id=mask_id(dllm_ckpt), block_length=4, **KV)
    try:
        before = llm.generate(prompts, sp)
        llm.offload_parameters()  # between iterations, as TraceRL's trainer does
        llm.reload_parameters(load_hf_reference(other))
        after = llm.generate(prompts, sp)
        llm.free_all_resources()
        llm.reload_from_hf_model(load_hf_reference(dllm_ckpt))
        again = llm.generate(prompts, sp)
    finally:
        llm.shutdown()
    with pipeline(str(other), EngineConfig(dllm_block_length=4, logprobs_mode="processed_logprobs")) as new:
        check_equal(after, reference(new, prompts, sp))
    assert after[0]["token_ids"] != before[0]["token_ids"]
    assert [(o["token_ids"], o["trajectory"]) for o in again] == [(o["token_ids"], o["trajectory"]) for o in before]


def test_refusals(dllm_ckpt, ar_ckpt):
    with pytest.raises(TypeError, match="not_a_jetengine_field"):
        LLM(dllm_ckpt, not_a_jetengine_field=1)
    with pytest.raises(TypeError, match="not_a_field"):
        SamplingParams(not_a_field=1)
    with pytest.raises(ValueError, match="diversity_enforce"):
        LLM(dllm_ckpt, diversity_enforce=True, **KV)
    with pytest.raises(ValueError, match="mask_token_id"):
        LLM(dllm_ckpt, mask_token_id=mask_id(dllm_ckpt) + 1, **KV)
    with pytest.raises(ValueError, match="model_type 'qwen3'.* is autoregressive: use engine.pipeline"):
        LLM(ar_ckpt, **KV)


def test_a_renoising_model_is_refused_naming_its_paradigm(gemma_ckpt):
    """Before anything loads, and not as JetEngine's default block_length refused (which a user cannot
    leave unset)."""
    with pytest.raises(ValueError, match="model_type 'diffusion_gemma'.* is decoded with renoising decoding: use"):
        LLM(str(gemma_ckpt), **KV)


def test_bad_sampling_params_name_jetengines_field(llm):
    with pytest.raises(ValueError, match="SamplingParams.topp"):
        llm.generate(["Hi"], SamplingParams(topp=0.0))
    with pytest.raises(ValueError, match="SamplingParams.block_length"):
        llm.generate(["Hi"], SamplingParams(block_length=8))


def test_tensor_parallel_size_2_runs_on_ray_and_equals_tp1(serve_cluster, dllm_ckpt, llm):
    """`tensor_parallel_size=2`: rank 1 is a Ray actor of the cluster this process is connected to; the
    rollouts (tokens, trajectories) equal tp=1's."""
    sp = SamplingParams(temperature=0.0, max_tokens=8, remasking_strategy="low_confidence_dynamic", block_length=4,
                        denoising_steps=4, dynamic_threshold=0.9)
    prompts = ["Explain reinforcement learning.", [5, 6, 7, 8, 9, 10]]
    sharded = LLM(dllm_ckpt, tensor_parallel_size=2, mask_token_id=mask_id(dllm_ckpt), block_length=4, **KV)
    try:
        assert sharded._pipe.engine.load().executor.executor == "ray_tp"
        outs = sharded.generate(prompts, sp)
    finally:
        sharded.shutdown()
    want = llm.generate(prompts, sp)
    assert [(o["token_ids"], o["trajectory"]) for o in outs] == [(o["token_ids"], o["trajectory"]) for o in want]
