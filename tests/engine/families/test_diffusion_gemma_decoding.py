"""Renoising decoding of DiffusionGemma in the engine against transformers' `generate()` (batch 1
after `torch.manual_seed(seed)`, DynamicCache, SDPA, float32 CPU): seeded requests give its tokens
cut the same way, settle steps computed from its per-step drafts, logprobs from its last-step
logits; alone, batched, and whatever the batch around them.

The tiny checkpoint's canvases converge as a trained model's do (`converging_checkpoint`: its final
norm scaled up, its self-conditioning damped -- undamped, a random network's self-conditioning
amplifies any two implementations' ~1e-6 float32 differences 2-4x per step, and after a few steps
they no longer draw alike)."""

from __future__ import annotations

import pytest
import torch

from bench.diffusion_gemma import converging_checkpoint
from configs import EngineConfig, GenerationConfig
from engine.carrier import Response
from engine.core.decoding.renoising import RenoiseKnobs
from engine.core.llm_engine import LLMEngine
from engine.model.families.diffusion_gemma import generation_defaults
from testing.references.diffusion_gemma import Drafts, load_reference, settle_steps
from tests.support.gemma_decoding import (
    CANVAS,
    KNOBS,
    MAX_NEW,
    PAGE,
    PROBE,
    SEEDS,
    check_response,
    make_engine,
    params,
    probe_among_others,
    run,
    transformers_oracle,
)

pytest.importorskip("transformers.models.diffusion_gemma")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return converging_checkpoint(tmp_path_factory.mktemp("dg") / "tiny", CANVAS)


@pytest.fixture(scope="module")
def engine(ckpt):
    return make_engine(ckpt)


@pytest.fixture(scope="module")
def oracle(ckpt, engine):
    return transformers_oracle(ckpt, engine.spec.vocab_size)


def test_batched_requests_equal_transformers(engine, oracle):
    """Every (seed, prompt, max_new_tokens) in one batch of 45 requests."""
    results = run(engine, {f"{seed}-{length}-{max_new}": (ref["prompt"], params(max_new_tokens=max_new,
                                                                                 random_seed=seed))
                           for (seed, length), ref in oracle.items() for max_new in MAX_NEW})
    for (seed, length), ref in oracle.items():
        for max_new in MAX_NEW:
            check_response(results[f"{seed}-{length}-{max_new}"], ref, max_new)
    # the knobs made canvases end on the stop rule after varying numbers of steps
    assert len({s for ref in oracle.values() for s in ref["steps"]}) > 1


def test_flex_attention_gives_the_same_requests_transformers_tokens(ckpt, oracle):
    """attention_backend='flex' (eager FlexAttention on the CPU): 15 of the requests above, one batch."""
    engine = make_engine(ckpt, attention_backend="flex")
    assert engine.executor.runner.backend.name == "flex"
    results = run(engine, {f"{seed}-{length}": (ref["prompt"], params(max_new_tokens=40, random_seed=seed))
                           for (seed, length), ref in oracle.items()})
    for (seed, length), ref in oracle.items():
        check_response(results[f"{seed}-{length}"], ref, 40)


@pytest.mark.parametrize("size", [1, 4, 16])
def test_batch_invariance(engine, oracle, size):
    """A seeded request alone, with 3 others and with 15 others (other prompts, seeds, lengths)."""
    check_response(run(engine, probe_among_others(oracle, size))["probe"], oracle[PROBE], 40)


@pytest.mark.parametrize("raw", [False, True])
def test_logprobs_from_the_last_step(ckpt, engine, oracle, raw):
    seed, length = 1, 40
    ref = oracle[seed, length]
    eng = make_engine(ckpt, logprobs_mode="raw_logprobs") if raw else engine
    result = run(eng, {"lp": (ref["prompt"], params(max_new_tokens=3 * CANVAS, random_seed=seed, logprobs=2))})["lp"]
    check_response(result, ref, 3 * CANVAS)
    for c, z in enumerate(ref["last"]):
        temperature = KNOBS.temperature(KNOBS.max_denoising_steps - ref["steps"][c] + 1)
        expected = torch.log_softmax(z * temperature if raw else z, dim=-1)
        for pos in range(CANVAS):
            entry = result.logprobs[c * CANVAS + pos]
            token = result.token_ids[c * CANVAS + pos]
            assert abs(entry[token] - expected[pos, token].item()) < 1e-4
            top = sorted(expected[pos].tolist(), reverse=True)[:2]
            assert len(entry) in (2, 3) and max(entry.values()) == pytest.approx(top[0], abs=1e-4)


def test_trace_replays_to_the_output(engine, oracle):
    seed, length = 2, 1
    ref = oracle[seed, length]
    result = run(engine, {"tr": (ref["prompt"], params(max_new_tokens=40, random_seed=seed,
                                                       return_step_trace=True))})["tr"]
    check_response(result, ref, 40)
    canvas = [None] * 40
    for event in result.step_trace:
        for p, t in zip(event["positions"], event["token_ids"], strict=True):
            canvas[p] = t
        assert event["accepted"] >= 1 and event["temperature"] > 0 and event["mean_entropy"] >= 0
    assert canvas == result.token_ids
    assert [e["step"] for e in result.step_trace] == list(range(1, len(result.step_trace) + 1))
    assert len(result.step_trace) == sum(c["steps"] for c in result.dllm_replay_canvases)


def test_unseeded_requests_differ(engine, oracle):
    ref = oracle[0, 9]
    a, b = run(engine, {f"u{i}": (ref["prompt"], params(max_new_tokens=16)) for i in range(2)}).values()
    assert a.token_ids != b.token_ids


def _transformers(ckpt, prompt: list[int], seed: int, knobs: RenoiseKnobs, **kwargs) -> tuple[list[int], Drafts]:
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    drafts = Drafts()
    torch.manual_seed(seed)
    seqs = load_reference(ckpt).generate(
        torch.tensor([prompt]), max_new_tokens=3 * CANVAS, streamer=drafts,
        max_denoising_steps=knobs.max_denoising_steps, t_min=knobs.t_min, t_max=knobs.t_max,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=knobs.entropy_bound),
        stability_threshold=knobs.stability_threshold, confidence_threshold=knobs.stop_entropy, **kwargs).sequences
    return seqs[0, len(prompt):].tolist(), drafts


def test_stable_and_confident_stop(ckpt, engine, oracle):
    """The stability history (argmax unchanged since the previous step) decides the stop; the knobs are
    the request's own, over the engine's."""
    knobs = RenoiseKnobs(max_denoising_steps=40, entropy_bound=8.0, stability_threshold=1, stop_entropy=1.5)
    own = {f"dllm_{name}": value for name, value in vars(knobs).items()}
    expected = {seed: _transformers(ckpt, oracle[seed, 9]["prompt"], seed, knobs) for seed in SEEDS}
    results = run(engine, {str(seed): (oracle[seed, 9]["prompt"], params(max_new_tokens=3 * CANVAS, random_seed=seed,
                                                                          **own)) for seed in SEEDS})
    stops = set()
    for rid, result in results.items():
        tokens, drafts = expected[int(rid)]
        assert result.token_ids == tokens
        assert result.step_map == settle_steps(drafts)
        stops |= {c["stop"] for c in result.dllm_replay_canvases}
    assert stops == {"stable", "max_steps"}


def test_stop_id_cuts_the_output(ckpt, engine, oracle):
    """A stop id inside a canvas ends the request there (kept); transformers stops after that canvas."""
    ref = oracle[4, 40]
    stop = ref["tokens"][CANVAS + 5]
    first = ref["tokens"].index(stop)
    tokens, _ = _transformers(ckpt, ref["prompt"], 4, KNOBS, eos_token_id=stop)
    result = run(engine, {"eos": (ref["prompt"], params(max_new_tokens=3 * CANVAS, random_seed=4,
                                                        stop_token_ids=[stop]))})["eos"]
    assert result.finish_reason == "stop" and result.matched == stop
    assert result.token_ids == tokens[: first + 1] == ref["tokens"][: first + 1]
    assert len(result.step_map) == first + 1


def test_knobs_from_generation_config_and_overrides(tmp_path):
    sampler = {"entropy_bound": 0.2, "_cls_name": "EntropyBoundSamplerConfig"}
    gen = {"max_denoising_steps": 32, "sampler_config": sampler,
           "t_min": 0.3, "t_max": 0.9, "stability_threshold": 2, "confidence_threshold": 0.01, "max_new_tokens": 256}
    defaults = generation_defaults(gen)
    assert defaults == {"dllm_max_denoising_steps": 32, "dllm_entropy_bound": 0.2, "dllm_t_min": 0.3,
                        "dllm_t_max": 0.9, "dllm_stability_threshold": 2, "dllm_stop_entropy": 0.01}
    assert generation_defaults({"t_min": None}) == {}
    knobs = RenoiseKnobs.of_engine(EngineConfig(**defaults))
    assert knobs == RenoiseKnobs(32, 0.2, 0.3, 0.9, 2, 0.01)
    assert RenoiseKnobs.of_engine(EngineConfig()) == RenoiseKnobs()  # the release's
    assert knobs.for_request(GenerationConfig(dllm_t_max=0.7, top_k=3)) == RenoiseKnobs(32, 0.2, 0.3, 0.7, 2, 0.01)
    with pytest.raises(ValueError, match="dllm_t_min"):
        knobs.for_request(GenerationConfig(dllm_t_min=0.95))
    # T(c) as transformers' schedule computes it (float32 arithmetic on an int32 countdown), bit for bit
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        LinearTemperatureScheduleLogitsProcessor,
    )

    schedule = LinearTemperatureScheduleLogitsProcessor(knobs.t_min, knobs.t_max, knobs.max_denoising_steps)
    logits = torch.randn(4, 8)
    for c in (32, 17, 1):
        assert torch.equal(logits / knobs.temperature(c), schedule(None, logits, torch.tensor(c, dtype=torch.int32)))


@pytest.mark.parametrize("chunk", [16, 7])
def test_long_prompts_in_chunks(ckpt, oracle, chunk):
    """Prompt encoder passes of at most `chunk` tokens (the 40-token prompt in 3 or 6); the sliding
    pages before the window released after each; every page back once the requests end."""
    eng = make_engine(ckpt, max_prefill_token_num=chunk)
    held = []
    original = eng.kv.register

    def register(table, tokens, committed):
        original(table, tokens, committed)
        held.append(eng.kv.held_pages(table))

    eng.kv.register = register
    results = run(eng, {str(seed): (oracle[seed, 40]["prompt"], params(max_new_tokens=40, random_seed=seed))
                        for seed in SEEDS})
    for rid, result in results.items():
        check_response(result, oracle[int(rid), 40], 40)
    window = eng.spec.extra.sliding_window
    assert max(h["sliding_attention"] for h in held) <= -(-(window - 1 + max(chunk, CANVAS)) // PAGE) + 1
    assert max(h["full_attention"] for h in held) > max(h["sliding_attention"] for h in held)
    assert all(m.num_free_pages == m.num_pages for m in eng.kv.managers.values())


@pytest.mark.parametrize(("field", "value"), [
    ("dllm_confidence_threshold", 0.5), ("dllm_unmasking_strategy", "sequential"), ("dllm_block_length", CANVAS),
    ("repetition_penalty", 1.2), ("min_new_tokens", 2), ("min_p", 0.1), ("dllm_t_min", 0.95),
    ("dllm_trajectory", {"output_ids": [5, 6], "step_map": [1, 2]})])
def test_what_the_paradigm_cannot_do_is_refused_naming_the_field(engine, field, value):
    from engine.errors import RequestError

    extra = {"max_new_tokens": 0, "logprobs": 0} if field == "dllm_trajectory" else {}
    with pytest.raises(RequestError, match=field) as refused:
        engine.add_request([1, 2, 3], GenerationConfig(**{"max_new_tokens": 4, field: value, **extra}))
    assert refused.value.param == field
    assert not engine.has_unfinished()


def test_other_paradigms_engine_knobs_are_refused_at_start(ckpt):
    with pytest.raises(ValueError, match="dllm_confidence_threshold"):
        make_engine(ckpt, dllm_confidence_threshold=0.5)


def test_engine_defaults_come_from_generation_config(tmp_path):
    import json
    import shutil

    path = tmp_path / "dg"
    shutil.copytree(converging_checkpoint(tmp_path / "src", CANVAS), path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen |= {"max_denoising_steps": 7, "t_min": 0.2, "sampler_config": {"entropy_bound": 0.3}}
    (path / "generation_config.json").write_text(json.dumps(gen))
    eng = LLMEngine(str(path), EngineConfig(device="cpu", kv_block_size=PAGE, num_kv_blocks=256, dllm_t_max=0.7))
    knobs = eng.decoding.knobs
    assert (knobs.max_denoising_steps, knobs.t_min, knobs.entropy_bound, knobs.t_max) == (7, 0.2, 0.3, 0.7)


def test_top_k_and_top_p_filter_what_is_sampled():
    from engine.core.decoding.renoising import filtered

    z = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 0.0, 5.0, 4.9]])
    assert torch.isinf(filtered(z, 2, 1.0)).tolist() == [[False, False, True, True], [True, True, False, False]]
    kept = ~torch.isinf(filtered(z, 0, 0.6))  # the nucleus: 0.665 of row 0 is its first token alone
    assert kept.tolist() == [[True, False, False, False], [False, False, True, True]]
    assert torch.equal(filtered(z, 0, 1.0), z)


def test_sglang_gemma4_renoise_flags(tmp_path):
    from deployments.cli import app_args, build_parser

    algo = tmp_path / "algo.yaml"
    algo.write_text("max_denoising_steps: 32\nsampler_config:\n  entropy_bound: 0.2\ntemperature_schedule:\n"
                    "  t_min: 0.3\n  t_max: 0.9\nstopping_config:\n  confidence_threshold: 0.01\n"
                    "  stability_threshold: 2\nuse_temperature_table: true\n")
    argv = ["serve", "ckpt", "--dllm-algorithm", "Gemma4Renoise", "--dllm-algorithm-config", str(algo)]
    engine = app_args(build_parser().parse_args(argv))["engine"]
    assert engine == {"dllm_max_denoising_steps": 32, "dllm_entropy_bound": 0.2, "dllm_t_min": 0.3,
                      "dllm_t_max": 0.9, "dllm_stop_entropy": 0.01, "dllm_stability_threshold": 2}
    algo.write_text("seed: 3\n")
    with pytest.raises(SystemExit, match="seed"):
        app_args(build_parser().parse_args(argv))


def test_weight_updates_and_memory_release_keep_the_tokens(ckpt, oracle):
    """A checkpoint update to the same weights (from disk, and as tensors by their checkpoint names,
    the encoder duplicates included), and releasing and resuming the weights and the KV cache with a
    request in flight: the seeded request still gives transformers' tokens and settle steps."""
    from safetensors.torch import load_file

    from engine.worker.weight_sources import disk_source, tensor_source

    eng = make_engine(ckpt)
    seed, length = 0, 9
    ref = oracle[seed, length]
    eng.update_weights(disk_source(str(ckpt)), "disk")
    check_response(run(eng, {"a": (ref["prompt"], params(max_new_tokens=40, random_seed=seed))})["a"], ref, 40)
    named = list(load_file(ckpt / "model.safetensors").items())
    eng.update_weights(tensor_source(named, None), "tensors")
    eng.add_request(ref["prompt"], params(max_new_tokens=40, random_seed=seed), "b")
    chunks = eng.step() + eng.step() + eng.step()  # the prompt, then canvas steps
    eng.release_memory(["kv_cache", "weights"])
    eng.resume_memory(["kv_cache", "weights"])
    while eng.has_unfinished():
        chunks += eng.step()
    result = Response.from_chunks(chunks)
    check_response(result, ref, 40)
    assert result.weight_version == "tensors"


def test_pipeline_samples_are_seeded_seed_and_seed_plus_one(ckpt, oracle):
    from engine import pipeline

    ref = oracle[0, 9]
    knobs = {f"dllm_{name}": value for name, value in vars(KNOBS).items()}
    with pipeline(str(ckpt), EngineConfig(device="cpu", kv_block_size=PAGE, num_kv_blocks=512, **knobs)) as pipe:
        outs = pipe([ref["prompt"]], GenerationConfig(max_new_tokens=40, random_seed=0, n=2))
    assert [o.token_ids for o in outs] == [oracle[0, 9]["tokens"][:40], oracle[1, 9]["tokens"][:40]]


def test_prefix_caching_reuses_committed_pages_exactly(ckpt, oracle):
    """Requests whose prompts share a cached prefix (the 40-token prompt crosses the window of 8, so
    the sliding group serves the match from its released-but-published pages) reuse it and still
    give transformers' tokens; a request in the same batch as its prompt's first computation waits
    for it (the n samples of a prompt compute it once)."""
    eng = make_engine(ckpt, enable_prefix_caching=True)
    ref = oracle[0, 40]
    check_response(run(eng, {"first": (ref["prompt"], params(max_new_tokens=40, random_seed=0))})["first"], ref, 40)
    hits = eng.kv.prefix_hit_tokens
    results = run(eng, {str(seed): (ref["prompt"], params(max_new_tokens=40, random_seed=seed)) for seed in SEEDS})
    for rid, result in results.items():
        check_response(result, oracle[int(rid), 40], 40)
    reused = eng.kv.prefix_hit_tokens - hits
    assert reused == len(SEEDS) * ((len(ref["prompt"]) - 1) // PAGE * PAGE)
    # after a flush (a weight update) nothing is reused
    eng.flush_cache()
    before = eng.kv.prefix_hit_tokens
    check_response(run(eng, {"again": (ref["prompt"], params(max_new_tokens=16, random_seed=0))})["again"], ref, 16)
    assert eng.kv.prefix_hit_tokens == before


@pytest.mark.parametrize("layer_types", [("full_attention",), ("sliding_attention", "sliding_attention")])
def test_a_network_with_one_kind_of_layer_serves(tmp_path, layer_types):
    """A checkpoint whose layers are all full (or all sliding) attention has one K/V pool: its requests
    are admitted and decode as transformers' `generate()` does (no empty pool holds them back)."""
    path = converging_checkpoint(tmp_path / "tiny", CANVAS, layer_types=layer_types)
    prompt = [5, 6, 7, 8, 9]
    tokens, drafts = _transformers(path, prompt, 3, KNOBS)
    result = run(make_engine(path), {"r": (prompt, params(max_new_tokens=3 * CANVAS, random_seed=3))})["r"]
    assert result.token_ids == tokens
    assert result.step_map == settle_steps(drafts)
